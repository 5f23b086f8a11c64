"""Who picks the next tokens of a reply: the model's sampler (with MTP speculation, or without), or a script.

`ScriptedPolicy` is a deterministic stand-in for the model: each reply is given text (control tokens
written as their strings, `</think>`, `<｜DSML｜...>`), put through the live session as sampled tokens
are (in one prefill), so the agent loop, its tools and its context accounting run for real with any
model, including one too small to call a tool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from dwarfstar.errors import DwarfStarError
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.prompt.dsml_guard import ToolGuard
from dwarfstar.sampling import Sampler, SamplingParams
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import DSparkSpeculation, MTPSpeculation, SpecStats, Speculator
from dwarfstar.tokenizer.tokenizer import Tokenizer


class Policy:
    """Who picks a reply's tokens. The prompt's tokens go into the session through `extend` too, so a
    policy that keeps state per position (the MTP draft) sees every token the model sees."""

    def extend(
        self,
        session: Session,
        tokens: Sequence[int],
        should_stop: Callable[[], bool],
        images: Sequence[ImageSpan] = (),
    ) -> None:
        """Append prompt tokens, with their image blocks (offsets into `tokens`); `should_stop` raises
        Cancelled between chunks (the session stays valid)."""
        session.prefill(tokens, should_stop=should_stop, images=images)

    def reply(
        self, session: Session, max_tokens: int, should_stop: Callable[[], bool], guard: ToolGuard | None = None
    ) -> Iterator[int]:
        """Append and yield a reply's tokens; the last one is EOS when the reply ended by itself. A
        sampling policy's tool-call `guard` chooses among the model's tokens (prompt/dsml_guard.py)."""
        raise NotImplementedError


class SampledPolicy(Policy):
    def __init__(self, params: SamplingParams, eos: int) -> None:
        self.sampler = Sampler(params)  # one generator for the session: a seed gives a reproducible run
        self.eos = eos

    def reply(
        self, session: Session, max_tokens: int, should_stop: Callable[[], bool], guard: ToolGuard | None = None
    ) -> Iterator[int]:
        return session.generate(max_tokens, self.sampler, [self.eos], should_stop, guard)


class SpeculativePolicy(SampledPolicy):
    """The model's replies, drafted by its MTP block and verified by the model: at temperature 0 the
    same tokens as SampledPolicy, otherwise the same distribution (speculative/verify.py).

    The speculator follows the live session: prompts are prefilled through it, so the draft has a row
    for every position. When the session changes under it (cut back for a compaction or /new, loaded
    from disk on /switch) a new speculator starts at the session's length: KV files hold no target
    hidden states, so the draft's rows begin there. That costs some acceptance, never exactness.
    """

    def __init__(self, params: SamplingParams, eos: int, speculation: MTPSpeculation | DSparkSpeculation) -> None:
        super().__init__(params, eos)
        self.speculation = speculation
        self.speculator: Speculator | None = None
        self.followed: list[int] = []  # the session's tokens when the speculator last ran
        self.finished: list[SpecStats] = []  # the stats of the speculators replaced so far

    def start(self, session: Session) -> None:
        """Follow `session` from here (also checks that its backend can speculate)."""
        if self.speculator is not None:
            self.finished.append(self.speculator.stats)
        self.speculator = self.speculation.start(session)
        self.followed = list(session.tokens)

    def _following(self, session: Session) -> Speculator:
        spec = self.speculator
        if spec is None or spec.session is not session or session.tokens != self.followed:
            self.start(session)
        assert self.speculator is not None
        return self.speculator

    def extend(
        self,
        session: Session,
        tokens: Sequence[int],
        should_stop: Callable[[], bool],
        images: Sequence[ImageSpan] = (),
    ) -> None:
        spec = self._following(session)
        try:
            spec.prefill(tokens, images=images, should_stop=should_stop)
        finally:
            self.followed = list(session.tokens)

    def reply(
        self, session: Session, max_tokens: int, should_stop: Callable[[], bool], guard: ToolGuard | None = None
    ) -> Iterator[int]:
        spec = self._following(session)
        start, count, last = len(session.tokens), 0, -1
        try:
            for last in spec.generate(max_tokens, self.sampler, [self.eos], should_stop, guard):
                count += 1
                yield last
        finally:
            # every token yielded must be in the session (the loop renders it), and only those: the
            # speculator holds a step's last token back until the next step, and the loop stops
            # reading at EOS, which ends a step
            if len(session.tokens) > start + count:  # a caller that stopped reading mid-step
                session.truncate(start + count)
                self.start(session)  # the draft ran past the cut: follow from the cut
            else:
                if len(session.tokens) == start + count - 1:
                    spec.append(last)
                self.followed = list(session.tokens)

    def describe(self) -> str:
        """The acceptance figures of every speculator so far."""
        stats = [*self.finished, *([self.speculator.stats] if self.speculator else [])]
        steps = sum(s.steps for s in stats)
        accepted = sum(sum(s.accepted) for s in stats)
        drafted = sum(sum(s.drafted) for s in stats)
        share = f"{accepted / drafted:.0%}" if drafted else "-"
        mean = f"{accepted / steps:.2f}" if steps else "0"
        described = self.speculation.options.describe()
        return f"{described}: {steps} steps, {mean} drafts accepted per step ({share} of drafts)"


class ScriptedPolicy(Policy):
    def __init__(self, tokenizer: Tokenizer, eos: int, replies: list[str]) -> None:
        self.tokenizer, self.eos = tokenizer, eos
        self.replies = list(replies)

    def reply(
        self, session: Session, max_tokens: int, should_stop: Callable[[], bool], guard: ToolGuard | None = None
    ) -> Iterator[int]:
        """The next scripted reply (a script is not sampled: `guard` has nothing to choose)."""
        if not self.replies:
            raise DwarfStarError("the script has no reply left")
        ids = [*self.tokenizer.encode_with_specials(self.replies.pop(0)), self.eos][:max_tokens]
        if should_stop():
            return
        session.prefill(ids)  # one pass, not one per token: the same state, and scripts can be long
        yield from ids
