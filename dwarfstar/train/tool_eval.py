"""Held-out tool-call accuracy of a model in training, in process: the prompt each API's client
would send (its tools shape, the server's ds4 template, thinking off unless asked), greedy decoding,
and the server's DSML parser on the text. Also the held-out greetings after the same short tools
prompts: does the turn end with an answer and no call (the decision the agent prompts need too).
With `--client-tools` the short prompts declare each client's own core tools instead (`Read`,
`exec_command`...; chat_data.CLIENT_TOOLS), and a right call is that client's. With `--tool-guard`
each reply is decoded under the server's tool-call guard, as `serve` runs by default. With `--bare`
the requests leave their argument bare (`per favore leggi il file quaderno.txt`).

It measures what the served checks (tests/nano_tools/served_checks.py) measure through the SDKs,
without a server, so a training run can log it as it goes, and scores a file on the served
checks' own requests:

    .venv/bin/python -m dwarfstar.train.tool_eval build/nano/nano.gguf [--requests 20] [--thinking] [--greetings]
        [--client-tools] [--tool-guard] [--bare]
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.model.forward import Transformer
from dwarfstar.model.loader import open_model
from dwarfstar.prompt.dsml import BLOCK_OPEN, DSML
from dwarfstar.prompt.dsml_guard import ToolGrammar, ToolGuard
from dwarfstar.prompt.dsml_parser import ParsedCompletion, parse_completion
from dwarfstar.prompt.render_options import DS4
from dwarfstar.tokenizer.specials import EOS, USER
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json
from dwarfstar.train.chat_data import (
    CLIENT_CORE,
    CLIENT_TOOLS,
    TOOLS,
    TOOLS_CORE,
    PromptEncoder,
    ToolRequest,
    tool_requests,
)
from dwarfstar.train.corpus import read_split
from dwarfstar.train.greetings import HELDOUT_GREETINGS

CORPUS = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "text" / "promessi_sposi.txt"
CALL_TOKENS = 60  # a DSML call of one short argument is about 45 tokens
TURN_TOKENS = 64  # a greeting's turn must end within this many tokens (reasoning included)


@dataclass(frozen=True)
class ToolCallScore:
    right: int  # the right tool with exactly the argument (a shell command's words: CoreTool.accepts)
    named: int  # one parsed call of the right tool, whatever its argument
    total: int
    samples: list[str]  # the first few generations, for the log

    @property
    def rate(self) -> float:
        return self.right / self.total


@dataclass(frozen=True)
class GreetingScore:
    ended: int  # turns ended within TURN_TOKENS with an answer and no call
    called: int  # replies that opened a tool call
    total: int
    samples: list[str]


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
    client: bool = False,
    guarded: bool = False,
) -> ToolCallScore:
    """How many of `requests`, declared with the tools in `shape`'s form, get a parsed call of the
    right tool with exactly the request's argument (a shell command: its words, `CoreTool.accepts`).
    `head` maps final rows to logits over the compact ids `vocab` plus one for all other ids (a
    choice of that one ends the generation);
    `local` maps full ids to compact ones; `thinking`: the requests ask for thinking, as the coding
    agents do, so the reply reasons (or closes its reasoning) before it calls; `client`: the tools
    declared and the call expected are the client's own (`_short_prompts`); `guarded`: decoded under
    the server's tool-call guard (`served_guard`)."""
    right, named, samples = 0, 0, []
    for request, state, tail, guard in _short_prompts(
        model, local, tokenizer, requests, shape, thinking, client, guarded
    ):
        out, text = reply_after(model, head, local, vocab, tokenizer, state, tail, CALL_TOKENS, guard)
        ended = "<rest>" if out[-1] == vocab.numel() else ""  # an id outside the training data
        parsed = parse_completion(text, thinking=thinking, ended=True)
        calls = [(c.name, c.arguments) for c in parsed.tool_calls]
        tool = (CLIENT_CORE[shape] if client else TOOLS_CORE)[request.tool]
        right += len(calls) == 1 and tool.accepts(calls[0], request.argument)
        named += [name for name, _ in calls] == [tool.name]
        if len(samples) < keep:
            samples.append(f"{request.text!r} -> {calls or text[:80] + ended!r}")
    return ToolCallScore(right, named, len(requests), samples)


def _short_prompts(
    model: Transformer,
    local: torch.Tensor,
    tokenizer: Tokenizer,
    requests: Sequence[ToolRequest],
    shape: str,
    thinking: bool,
    client: bool = False,
    guarded: bool = False,
) -> Iterator[tuple[ToolRequest, object, list[int], ToolGuard | None]]:
    """Each request with its prompt in `shape`'s tools form (ds4 template), the tools `TOOLS` or with
    `client` the shape's client's own (`CLIENT_TOOLS`): the state after the system prompt, which every
    request shares and which runs once, the rest of its ids, and with `guarded` a fresh guard over the
    declared tools for its reply (`served_guard`)."""
    declared = CLIENT_TOOLS[shape] if client else TOOLS[shape]
    encode = PromptEncoder(tokenizer)
    user = tokenizer.token_id(USER)
    state = None
    for request in requests:
        ids = encode.render([{"role": "user", "content": request.text}], tools=declared, thinking=thinking, options=DS4)
        cut = ids.index(user)  # the system prompt with the tools is the same for every request
        if state is None:
            state = model.new_state()
            model.hidden_batch([local[torch.tensor(ids[:cut])]], [state], all_positions=False)
        yield request, state, ids[cut:], served_guard(declared, tokenizer, thinking, guarded)


def served_guard(tools: list[dict], tokenizer: Tokenizer, thinking: bool, guarded: bool) -> ToolGuard | None:
    """The tool-call guard `serve` decodes under by default, over the declared `tools` (its ids are the
    tokenizer's, so it takes a model file, whose compact ids are the full ones); None if not `guarded`."""
    return ToolGuard(ToolGrammar(tools), tokenizer, thinking=thinking) if guarded else None


def ends_turn(parsed: ParsedCompletion, ended: bool) -> bool:
    """A reply (`parsed`, `ended` by EOS) that ends its turn: a non-empty answer and no tool call,
    valid or given up, nor a stray piece of one (a block's closing tag and an invoke, which the parser
    leaves in the answer as text: the user would read the markup)."""
    clean = parsed.invalid_dsml is None and DSML not in parsed.content
    return ended and not parsed.tool_calls and clean and bool(parsed.content.strip())


@torch.no_grad()
def greeting_endings(
    model: Transformer,
    head: Callable[[torch.Tensor], torch.Tensor],
    local: torch.Tensor,
    vocab: torch.Tensor,
    tokenizer: Tokenizer,
    shape: str,
    thinking: bool = False,
    client: bool = False,
    guarded: bool = False,
) -> GreetingScore:
    """How many of the held-out greetings, after `shape`'s tools prompt, end their turn within
    TURN_TOKENS tokens with an answer and no call; the arguments as in `tool_call_accuracy`."""
    requests = [ToolRequest("greeting", language, text, "") for text, language, _ in HELDOUT_GREETINGS]
    eos = int(local[tokenizer.token_id(EOS)])
    ended, called, samples = 0, 0, []
    for request, state, tail, guard in _short_prompts(
        model, local, tokenizer, requests, shape, thinking, client, guarded
    ):
        out, text = reply_after(model, head, local, vocab, tokenizer, state, tail, TURN_TOKENS, guard)
        closed = out[-1] == eos
        ended += ends_turn(parse_completion(text, thinking=thinking, ended=closed), closed)
        called += BLOCK_OPEN in text
        if len(samples) < 3:
            samples.append(f"{request.text!r} -> {text[:80]!r}{'' if closed else ' (no end)'}")
    return GreetingScore(ended, called, len(requests), samples)


@dataclass(frozen=True)
class FileModel:
    """A model file as served (QAT rounding on), with the arguments the scores take: its full ids
    are the compact ones."""

    model: ReferenceModel
    tokenizer: Tokenizer
    ids: torch.Tensor

    @classmethod
    def open(cls, path: Path) -> FileModel:
        model = ReferenceModel(open_model(path))
        tokenizer = Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), model.args.vocab_size)
        return cls(model, tokenizer, torch.arange(model.args.vocab_size))

    def head(self, y: torch.Tensor) -> torch.Tensor:
        return self.model.ops.logits(y, None)


def file_tool_accuracy(
    path: Path,
    n: int,
    corpus: Path = CORPUS,
    thinking: bool = False,
    client: bool = False,
    guarded: bool = False,
    unquoted: float = 0.0,
) -> list[tuple[str, ToolCallScore]]:
    """A model file's score on the requests of the served checks (tests/nano_tools: `n` held-out
    requests per client shape, seeds 0, 1, 2 in shape order), an `unquoted` share of them with the
    argument bare (`tool_requests`)."""
    f = FileModel.open(path)
    book = read_split(corpus).train
    args = f.model, f.head, f.ids, f.ids, f.tokenizer
    return [
        (shape, tool_call_accuracy(*args, requests, shape, 3, thinking, client, guarded))
        for seed, shape in enumerate(sorted(TOOLS))
        for requests in [tool_requests(book, n, seed, heldout=True, unquoted=unquoted)]
    ]


def file_greeting_endings(
    path: Path, thinking: bool = False, client: bool = False, guarded: bool = False
) -> list[tuple[str, GreetingScore]]:
    """A model file's held-out greetings after each client shape's tools prompt."""
    f = FileModel.open(path)
    return [
        (shape, greeting_endings(f.model, f.head, f.ids, f.ids, f.tokenizer, shape, thinking, client, guarded))
        for shape in sorted(TOOLS)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description="held-out tool-call accuracy of a nano model file")
    parser.add_argument("model", type=Path)
    parser.add_argument("--requests", type=int, default=20, help="per client shape")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--thinking", action="store_true", help="the requests ask for thinking")
    parser.add_argument("--greetings", action="store_true", help="score the held-out greetings' turn endings")
    parser.add_argument("--client-tools", action="store_true", help="declare and expect the clients' own tools")
    parser.add_argument("--tool-guard", action="store_true", help="decode under the server's tool-call guard")
    parser.add_argument("--bare", action="store_true", help="the requests' argument without quotes or backticks")
    opts = parser.parse_args()
    if opts.greetings:
        for shape, greetings in file_greeting_endings(opts.model, opts.thinking, opts.client_tools, opts.tool_guard):
            print(f"{shape}: {greetings.ended}/{greetings.total} greetings ended, {greetings.called} opened a call")
            for line in greetings.samples:
                print(f"  {line}")
        return
    scores = file_tool_accuracy(
        opts.model, opts.requests, opts.corpus, opts.thinking, opts.client_tools, opts.tool_guard, float(opts.bare)
    )
    for shape, score in scores:
        print(f"{shape}: {score.right}/{score.total} right, {score.named}/{score.total} the right tool")
        for line in score.samples:
            print(f"  {line}")


if __name__ == "__main__":
    main()
