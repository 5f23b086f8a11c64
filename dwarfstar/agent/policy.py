"""Who picks the next tokens of a reply: the model's sampler, or a script.

`ScriptedPolicy` is a deterministic stand-in for the model: each reply is given text (control tokens
written as their strings, `</think>`, `<｜DSML｜...>`), put through the live session as sampled tokens
are (in one prefill), so the agent loop, its tools and its context accounting run for real with any
model, including one too small to call a tool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from dwarfstar.errors import DwarfStarError
from dwarfstar.session.sampling import Sampler, SamplingParams
from dwarfstar.session.session import Session
from dwarfstar.tokenizer.tokenizer import Tokenizer


class Policy(Protocol):
    def reply(self, session: Session, max_tokens: int, should_stop: Callable[[], bool]) -> Iterator[int]:
        """Append and yield a reply's tokens; the last one is EOS when the reply ended by itself."""
        ...


class SampledPolicy:
    def __init__(self, params: SamplingParams, eos: int) -> None:
        self.sampler = Sampler(params)  # one generator for the session: a seed gives a reproducible run
        self.eos = eos

    def reply(self, session: Session, max_tokens: int, should_stop: Callable[[], bool]) -> Iterator[int]:
        return session.generate(max_tokens, self.sampler, [self.eos], should_stop)


class ScriptedPolicy:
    def __init__(self, tokenizer: Tokenizer, eos: int, replies: list[str]) -> None:
        self.tokenizer, self.eos = tokenizer, eos
        self.replies = list(replies)

    def reply(self, session: Session, max_tokens: int, should_stop: Callable[[], bool]) -> Iterator[int]:
        if not self.replies:
            raise DwarfStarError("the script has no reply left")
        ids = [*self.tokenizer.encode_with_specials(self.replies.pop(0)), self.eos][:max_tokens]
        if should_stop():
            return
        session.prefill(ids)  # one pass, not one per token: the same state, and scripts can be long
        yield from ids
