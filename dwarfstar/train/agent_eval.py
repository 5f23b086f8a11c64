"""Does a nano model keep its manners after a long agent prompt: held-out prompts from our generator
(dwarfstar/train/agent_prompts.py, other seeds than training's), each followed by a held-out
greeting and a held-out tool request, greedy, in thinking mode as the clients ask, the server's
DSML parser on the text.

- a greeting passes when the turn ends (EOS) within TURN_TOKENS tokens with a non-empty answer and
  no tool-call block, valid or given up as invalid (tool_eval.ends_turn);
- a tool request passes when its one call names the prompt's core tool with exactly the argument.

With `--tool-guard` each reply is decoded under the server's tool-call guard (prompt/dsml_guard.py:
a block's tool and parameter names kept to the prompt's declared tools), as `serve` runs by default.
`--seen-prompts` and `--seen-turns` ask training's own prompts (seed 0's) or greetings and requests
instead, to tell what a run learned to generalise from what it learned by heart.

    .venv/bin/python -m dwarfstar.train.agent_eval dwarfstar/data/nano.gguf [--prompts 20] [--tokens 4000 16000]
        [--tool-guard] [--seen-prompts] [--seen-turns]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dwarfstar.model.forward import Transformer
from dwarfstar.prompt.dsml_parser import parse_completion
from dwarfstar.prompt.render_options import DS4, OFFICIAL, RenderOptions
from dwarfstar.tokenizer.specials import EOS, USER
from dwarfstar.tokenizer.tokenizer import Tokenizer
from dwarfstar.train.agent_data import AgentTurn, agent_turns
from dwarfstar.train.agent_prompts import SHAPES, AgentPrompt, agent_prompt, conversation
from dwarfstar.train.chat_data import PromptEncoder
from dwarfstar.train.corpus import read_split
from dwarfstar.train.tool_eval import CORPUS, TURN_TOKENS, FileModel, ends_turn, reply_after, served_guard

HELDOUT_SEED = 10_000  # evaluation prompts use seeds from here on; training's are below (seed 0's: 0...)


@dataclass
class AgentScore:
    ended: int = 0  # greetings whose turn ended within TURN_TOKENS with an answer and no call
    greetings: int = 0
    right: int = 0  # tool requests answered by the right call with exactly the argument
    requests: int = 0
    bare_right: int = 0  # of those, the requests that leave the argument bare (no quotes or backticks)
    bare: int = 0
    samples: list[str] = field(default_factory=list)


def generated_prompts(
    n: int, tokens: tuple[int, int], count: Callable[[str], int], first: int = HELDOUT_SEED
) -> list[AgentPrompt]:
    """`n` prompts of seeds from `first`, the shapes in turn: held-out ones, or a training run's (seed
    S's from S * 1000)."""
    return [agent_prompt(SHAPES[i % len(SHAPES)], first + i, tokens, count) for i in range(n)]


def prompt_options(i: int) -> RenderOptions:
    """The server template of training's or evaluation's `i`-th prompt: both, in turn."""
    return DS4 if i % 2 == 0 else OFFICIAL


@torch.no_grad()
def agent_scores(
    model: Transformer,
    head: Callable[[torch.Tensor], torch.Tensor],
    local: torch.Tensor,
    vocab: torch.Tensor,
    tokenizer: Tokenizer,
    prompts: list[AgentPrompt],
    book: str,
    keep: int = 4,
    guarded: bool = False,
    heldout: bool = True,
) -> dict[str, AgentScore]:
    """Per client shape: each prompt with one held-out greeting and one held-out tool request (the
    prompt's state computed once, each turn continuing from a copy). `head`, `local` and `vocab` as
    in tool_eval.tool_call_accuracy; `guarded`: under the tool-call guard (full ids only); `heldout`:
    held-out greetings and requests, else training's (agent_turns)."""
    encode = PromptEncoder(tokenizer)
    user, eos = tokenizer.token_id(USER), tokenizer.token_id(EOS)
    turns = agent_turns(book, 40 * len(prompts), HELDOUT_SEED, heldout=heldout)
    greetings = [t for t in turns if t.kind == "greeting"]
    requests = [t for t in turns if t.kind != "greeting"]
    scores = {shape: AgentScore() for shape in SHAPES}
    for i, prompt in enumerate(prompts):
        state = None
        for turn in (greetings[i], requests[i]):
            ids = encode.render(
                conversation(prompt, [{"role": "user", "content": turn.text}]),
                tools=prompt.tools,
                thinking=True,
                options=prompt_options(i),
            )
            cut = ids.index(user)
            if state is None:
                state = model.new_state()
                model.hidden_batch([local[torch.tensor(ids[:cut])]], [state], all_positions=False)
            guard = served_guard(prompt.tools, tokenizer, True, guarded)
            out, text = reply_after(model, head, local, vocab, tokenizer, state, ids[cut:], TURN_TOKENS, guard)
            _score_turn(scores[prompt.shape], prompt, turn, text, out[-1] == int(local[eos]), len(ids))
    return scores


def _score_turn(score: AgentScore, prompt: AgentPrompt, turn: AgentTurn, text: str, ended: bool, n: int) -> None:
    parsed = parse_completion(text, thinking=True, ended=ended)
    calls = [(c.name, c.arguments) for c in parsed.tool_calls]
    if turn.kind == "greeting":
        score.greetings += 1
        score.ended += ends_turn(parsed, ended)
    else:
        right = len(calls) == 1 and prompt.core[turn.kind].accepts(calls[0], turn.argument)
        score.requests += 1
        score.right += right
        if not turn.request.quoted:
            score.bare += 1
            score.bare_right += right
    if len(score.samples) < 4:
        score.samples.append(f"[{n} tokens] {turn.text!r} -> {calls or text[:100]!r}{'' if ended else ' (no end)'}")


def file_agent_scores(
    path: Path,
    n: int,
    tokens: tuple[int, int],
    corpus: Path = CORPUS,
    guarded: bool = False,
    seen_prompts: bool = False,
    seen_turns: bool = False,
) -> dict[str, AgentScore]:
    """A model file's scores, QAT rounding on as served (`guarded`: under the tool-call guard; `seen_*`:
    training's prompts, turns)."""
    f = FileModel.open(path)
    first = 0 if seen_prompts else HELDOUT_SEED
    prompts = generated_prompts(n, tokens, lambda text: len(f.tokenizer.encode(text)), first)
    book = read_split(corpus).train
    return agent_scores(
        f.model, f.head, f.ids, f.ids, f.tokenizer, prompts, book, guarded=guarded, heldout=not seen_turns
    )


def report(scores: dict[str, AgentScore]) -> list[str]:
    lines = []
    for shape, s in scores.items():
        lines.append(
            f"{shape}: greetings ended within {TURN_TOKENS} tokens {s.ended}/{s.greetings}, "
            f"tool calls right {s.right}/{s.requests} (bare arguments {s.bare_right}/{s.bare})"
        )
        lines += [f"  {line}" for line in s.samples]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description="a nano model's turns after held-out agent prompts")
    parser.add_argument("model", type=Path)
    parser.add_argument("--prompts", type=int, default=20, help="held-out agent prompts, the shapes in turn")
    parser.add_argument("--tokens", type=int, nargs=2, default=(4000, 16000), help="their length bounds")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--tool-guard", action="store_true", help="decode under the server's tool-call guard")
    parser.add_argument("--seen-prompts", action="store_true", help="a seed-0 training run's own prompts")
    parser.add_argument("--seen-turns", action="store_true", help="training's greetings and requests")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    scores = file_agent_scores(
        opts.model, opts.prompts, tuple(opts.tokens), opts.corpus, opts.tool_guard, opts.seen_prompts, opts.seen_turns
    )
    print("\n".join(report(scores)))
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
