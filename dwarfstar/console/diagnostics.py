"""ds4's diagnostic outputs of `dwarfstar run`: the session trace, `--dump-tokens`, `--dump-logprobs`.

`--dump-logprobs` writes ds4's JSON (DS4_SURFACE §5.3):
`{"source", "prompt_tokens", "ctx", "top_k", "steps": [{"step", "selected": {"id", "text", "bytes"},
"top_logprobs": [{"token": {"id", "text", "bytes"}, "logit", "logprob"}]}]}`, plus each step's
`logprob` of the selected token, as the official API vectors have it. `bytes` is authoritative;
`text` is the bytes as UTF-8 with every byte that is not valid UTF-8 written as the code point U+00XX.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO

from dwarfstar.sampling import Sampler, SamplingParams
from dwarfstar.session.session import Session, decode_batch, sample_next
from dwarfstar.tokenizer.tokenizer import Tokenizer

MAX_LOGPROBS_TOP_K = 128  # ds4's cap


class Trace:
    """A human-readable log of what the session did: rendered prompts, cache reuse, generated text."""

    def __init__(self, path: Path) -> None:
        self.file: TextIO = path.open("a", encoding="utf-8")
        self.start = time.perf_counter()

    def write(self, title: str, body: str | None = None) -> None:
        self.file.write(f"[{time.perf_counter() - self.start:9.3f}] {title}\n")
        if body is not None:
            self.file.write(body if body.endswith("\n") else body + "\n")
            self.file.write("-" * 40 + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def dump_tokens(tokenizer: Tokenizer, text: str) -> str:
    """ds4's `--dump-tokens`: the ids on one line, then one `%6d  <piece>` line per token."""
    ids = tokenizer.encode_with_specials(text)
    lines = ["[" + ", ".join(map(str, ids)) + "]"]
    lines += [f"{token:6d}  {tokenizer.piece(token)}" for token in ids]
    return "\n".join(lines) + "\n"


def byte_text(data: bytes) -> str:
    """UTF-8 text of `data`; each byte that is not part of valid UTF-8 becomes U+00XX (as ds4 writes it)."""
    text = data.decode("utf-8", errors="surrogateescape")
    return "".join(chr(ord(c) - 0xDC00) if 0xDC80 <= ord(c) <= 0xDCFF else c for c in text)


def _token_entry(tokenizer: Tokenizer, token: int) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token)
    return {"id": token, "text": byte_text(raw), "bytes": list(raw)}


def greedy_logprobs(session: Session, tokenizer: Tokenizer, steps: int, top_k: int, eos: int) -> list[dict[str, Any]]:
    """Greedy continuation from the session's state, with the top-k alternatives of every step.

    The tokens and logprobs are drawn as a server request's are (a greedy sampler that asks for
    `top_k` logprobs: `dwarfstar.sampling`), so the same prompt gives the same numbers here and in the
    API. The caller clamps `top_k` to MAX_LOGPROBS_TOP_K, since the JSON reports it. Stops after
    `steps` tokens, after EOS (which is recorded), or when the context is full.
    """
    out: list[dict[str, Any]] = []
    limit = min(steps, session.ctx - len(session.tokens))
    if limit <= 0:
        return out
    sampler = Sampler(SamplingParams(temperature=0.0, logprobs=top_k))
    token = sample_next([session], [sampler])[0]
    for step in range(limit):
        drawn = sampler.logprobs
        out.append(
            {
                "step": step,
                "selected": _token_entry(tokenizer, token),
                "logprob": drawn.logprob,
                "top_logprobs": [
                    {"token": _token_entry(tokenizer, alt.token), "logit": alt.logit, "logprob": alt.logprob}
                    for alt in drawn.top
                ],
            }
        )
        if token == eos or step + 1 == limit:
            break
        token = decode_batch([session], [token], [sampler])[0]  # the step draws the next token with it
    return out


def write_logprobs(path: Path, prompt_tokens: int, ctx: int, top_k: int, steps: list[dict[str, Any]]) -> None:
    doc = {"source": "dwarfstar", "prompt_tokens": prompt_tokens, "ctx": ctx, "top_k": top_k, "steps": steps}
    path.write_text(json.dumps(doc, ensure_ascii=True, indent=1) + "\n", encoding="utf-8")
