"""Held-out tool-call accuracy of a model in training, in process: the prompt each API's client
would send (its tools shape, the server's ds4 template, thinking off unless asked), greedy decoding,
and the server's DSML parser on the text.

It measures what the served checks (tests/nano_tools/served_checks.py) measure through the SDKs,
without a server, so a training run can log it as it goes, and scores a file on the served
checks' own requests:

    .venv/bin/python -m dwarfstar.train.tool_eval build/nano/nano.gguf [--requests 20] [--thinking]
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.model.forward import Transformer
from dwarfstar.model.loader import open_model
from dwarfstar.prompt.dsml_guard import ToolGuard
from dwarfstar.prompt.dsml_parser import parse_completion
from dwarfstar.prompt.render_options import DS4
from dwarfstar.tokenizer.specials import EOS, USER
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json
from dwarfstar.train.chat_data import ARGUMENT, TOOLS, PromptEncoder, ToolRequest, tool_requests
from dwarfstar.train.corpus import read_split

CORPUS = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "text" / "promessi_sposi.txt"
CALL_TOKENS = 60  # a DSML call of one short argument is about 45 tokens


@dataclass(frozen=True)
class ToolCallScore:
    right: int  # the right tool with exactly the argument
    named: int  # one parsed call of the right tool, whatever its argument
    total: int
    samples: list[str]  # the first few generations, for the log

    @property
    def rate(self) -> float:
        return self.right / self.total


def greedy(
    model: Transformer,
    head: Callable[[torch.Tensor], torch.Tensor],
    state,
    last: torch.Tensor,
    stops: set[int],
    n: int,
    guard: ToolGuard | None = None,
) -> list[int]:
    """Up to `n` greedy tokens (compact ids) from the final row `last`, ending at one of `stops`; with
    a tool-call `guard` (whose ids are the tokenizer's: compact ids that are the full ones) as served."""
    out: list[int] = []
    y = last
    for _ in range(n):
        row = head(y)[0]
        token = int(row.argmax())
        if guard is not None:
            token = guard.choose(token, row)
            guard.push(token)
        out.append(token)
        if token in stops:
            break
        (y,) = model.hidden_batch([torch.tensor([token])], [state], all_positions=False)
    return out


def reply_after(
    model: Transformer,
    head: Callable[[torch.Tensor], torch.Tensor],
    local: torch.Tensor,
    vocab: torch.Tensor,
    tokenizer: Tokenizer,
    state,
    tail: Sequence[int],
    n: int,
    guard: ToolGuard | None = None,
) -> tuple[list[int], str]:
    """The greedy reply to `tail` (full ids) from a copy of a prompt prefix's `state`, up to `n`
    tokens, ended by EOS or an id outside `vocab`: its compact ids and its text (`guard`: `greedy`'s)."""
    fork = copy.deepcopy(state)
    (y,) = model.hidden_batch([local[torch.tensor(tail)]], [fork], all_positions=False)
    out = greedy(model, head, fork, y, {int(local[tokenizer.token_id(EOS)]), vocab.numel()}, n, guard)
    return out, tokenizer.decode([int(vocab[t]) for t in out if t < vocab.numel()])


@torch.no_grad()
def tool_call_accuracy(
    model: Transformer,
    head: Callable[[torch.Tensor], torch.Tensor],
    local: torch.Tensor,
    vocab: torch.Tensor,
    tokenizer: Tokenizer,
    requests: Sequence[ToolRequest],
    shape: str,
    keep: int = 3,
    thinking: bool = False,
) -> ToolCallScore:
    """How many of `requests`, declared with the tools in `shape`'s form, get a parsed call of the
    right tool with exactly the request's argument. `head` maps final rows to logits over the
    compact ids `vocab` plus one for all other ids (a choice of that one ends the generation);
    `local` maps full ids to compact ones; `thinking`: the requests ask for thinking, as the coding
    agents do, so the reply reasons (or closes its reasoning) before it calls."""
    encode = PromptEncoder(tokenizer)
    user = tokenizer.token_id(USER)
    prefixes: dict[tuple[int, ...], object] = {}
    right, named, samples = 0, 0, []
    for request in requests:
        ids = encode.render(
            [{"role": "user", "content": request.text}], tools=TOOLS[shape], thinking=thinking, options=DS4
        )
        cut = ids.index(user)  # the system prompt with the tools is the same for every request
        key = tuple(ids[:cut])
        if key not in prefixes:
            prefixes[key] = model.new_state()
            model.hidden_batch([local[torch.tensor(ids[:cut])]], [prefixes[key]], all_positions=False)
        out, text = reply_after(model, head, local, vocab, tokenizer, prefixes[key], ids[cut:], CALL_TOKENS)
        ended = "<rest>" if out[-1] == vocab.numel() else ""  # an id outside the training data
        parsed = parse_completion(text, thinking=thinking, ended=True)
        calls = [(c.name, c.arguments) for c in parsed.tool_calls]
        right += calls == [(request.tool, {ARGUMENT[request.tool]: request.argument})]
        named += [name for name, _ in calls] == [request.tool]
        if len(samples) < keep:
            samples.append(f"{request.text!r} -> {calls or text[:80] + ended!r}")
    return ToolCallScore(right, named, len(requests), samples)


def file_tool_accuracy(
    path: Path, n: int, corpus: Path = CORPUS, thinking: bool = False
) -> list[tuple[str, ToolCallScore]]:
    """A model file's score, QAT rounding on as served, on the requests of the served checks
    (tests/nano_tools: `n` held-out requests per client shape, seeds 0, 1, 2 in shape order)."""
    model = ReferenceModel(open_model(path))
    tokenizer = Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), model.args.vocab_size)
    ids = torch.arange(model.args.vocab_size)
    book = read_split(corpus).train
    return [
        (
            shape,
            tool_call_accuracy(
                model, lambda y: model.ops.logits(y, None), ids, ids, tokenizer, requests, shape, thinking=thinking
            ),
        )
        for seed, shape in enumerate(sorted(TOOLS))
        for requests in [tool_requests(book, n, seed, heldout=True)]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description="held-out tool-call accuracy of a nano model file")
    parser.add_argument("model", type=Path)
    parser.add_argument("--requests", type=int, default=20, help="per client shape")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--thinking", action="store_true", help="the requests ask for thinking")
    opts = parser.parse_args()
    for shape, score in file_tool_accuracy(opts.model, opts.requests, opts.corpus, opts.thinking):
        print(f"{shape}: {score.right}/{score.total} right, {score.named}/{score.total} the right tool")
        for line in score.samples:
            print(f"  {line}")


if __name__ == "__main__":
    main()
