"""Logprobs in the APIs: which requests ask for them, and their shapes.

The numbers are the sampler's (`dwarfstar.sampling`): the model's log-softmax of logits / T at the
request's temperature (T = 1 for a greedy request), before min-p, top-k and top-p, computed on the
device with the draw and read in the decode step's one host sync. `dwarfstar run --dump-logprobs`
draws through the same sampler, so the same prompt gives the same numbers there.

There is one entry per generated token but the end-of-sentence token, in the order generated:
reasoning and tool-call tokens included, so the list lines up with `completion_tokens` less the EOS.
A request that asks is not speculated (`serve --mtp`): an accepted draft has no draw of its own.

How a request asks (validation.py, `logprobs`):
- Chat Completions: `logprobs: true`, and `top_logprobs` 0–20 alternatives (which needs `logprobs`).
  Each entry is `{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}` in
  `choices[0].logprobs.content`; a stream carries the entries of the tokens since the last chunk.
- Completions: `logprobs` 0–20 alternatives; `choices[0].logprobs` holds `tokens`,
  `token_logprobs`, `top_logprobs` (a `{token: logprob}` object per token) and `text_offset`.
- Responses: `include: ["message.output_text.logprobs"]` and `top_logprobs` 0–20 (which needs the
  include); the entries, as chat's, are in the message's `output_text.logprobs`, and in each
  `response.output_text.delta` when streamed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dwarfstar.sampling import TokenLogprobs
from dwarfstar.serving.errors import bad_request
from dwarfstar.serving.fields import Fields
from dwarfstar.serving.generation import TokenLogprob
from dwarfstar.tokenizer.tokenizer import Tokenizer

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat and responses
RESPONSES_INCLUDE = "message.output_text.logprobs"


def _top(fields: Fields, key: str, needs: str, asked: bool) -> int | None:
    top = fields.integer(key, low=0, high=MAX_TOP_LOGPROBS)
    if top is not None and not asked:
        raise bad_request(f"{key} needs {needs}", param=key)
    return top


def chat_logprobs(fields: Fields) -> int | None:
    """Alternatives per token a chat request asks for (None: no logprobs)."""
    asked = bool(fields.flag("logprobs"))
    top = _top(fields, "top_logprobs", '"logprobs": true', asked)
    return (top or 0) if asked else None


def completion_logprobs(fields: Fields) -> int | None:
    """Completions' `logprobs`: the number of alternatives, 0 for the chosen token's alone."""
    return fields.integer("logprobs", low=0, high=MAX_TOP_LOGPROBS)


def responses_logprobs(fields: Fields) -> int | None:
    include = fields.array("include") or []
    asked = RESPONSES_INCLUDE in include
    top = _top(fields, "top_logprobs", f'"include": ["{RESPONSES_INCLUDE}"]', asked)
    return (top or 0) if asked else None


def token_text(tokenizer: Tokenizer, token: int) -> tuple[str, list[int]]:
    """A token's text (a partial UTF-8 sequence replaced) and its exact bytes."""
    data = tokenizer.token_bytes(token)
    return data.decode("utf-8", errors="replace"), list(data)


def event_of(tokenizer: Tokenizer, drawn: TokenLogprobs) -> TokenLogprob:
    """The client's view of a draw's logprobs."""
    text, data = token_text(tokenizer, drawn.token)
    top = tuple((*token_text(tokenizer, alt.token), alt.logprob) for alt in drawn.top)
    return TokenLogprob(text, data, drawn.logprob, top)


def openai_entry(entry: TokenLogprob) -> dict[str, Any]:
    """Chat's and Responses' shape of one token's logprobs."""
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": entry.bytes,
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, b, lp in entry.top],
    }


def completion_block(entries: Sequence[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """Completions' `logprobs` object; `offset`: the text length before the first entry (a stream's)."""
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t: lp for t, _, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


class Pending:
    """A stream's logprob entries not yet sent: they ride on the next chunk."""

    def __init__(self) -> None:
        self.entries: list[TokenLogprob] = []

    def take(self) -> list[TokenLogprob]:
        entries, self.entries = self.entries, []
        return entries
