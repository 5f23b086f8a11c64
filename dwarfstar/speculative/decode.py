"""Speculative decoding on a `Session`: the MTP block drafts, one target pass verifies, rollback is a
truncate of the target state to the accepted tokens (`rollback.py`).

A step starts with the target state holding every emitted token but the last (`pending`). The draft
proposes up to N tokens; the target runs [pending, d_1..d_n] in one pass; `verify` keeps the first m
drafts and names the next token. If m < n the target state is cut back to [pending, d_1..d_m]
without running them again: the raw-window rows the rejected tokens overwrote come back from the
snapshot taken before the pass, the compressor frontiers are rebuilt from the pass's recorded
projections, and the compressed rows they appended lie past pos // ratio, where nothing reads them.
Only a pass longer than the raw window (which overwrote kept rows) is redone from the snapshot.
The draft's own window is restored to its snapshot after drafting.

Alignment. A draft row at position i pairs the hidden streams after position i with a token and
predicts the token at i + 2. "next" (the DeepSeek-V3 training convention, as vLLM runs it) pairs it
with the token at i + 1; "same" (ds4's driver) with the token at i. Drafting k > 1 feeds the block
its own output streams as the next row's hidden.

Where it runs. The speculator drives a runner (`LocalRunner`: the target model in this process) and
a `DraftTrack` (the draft state, the target streams not fed to it yet). A route supplies its own
runner and a remote track (`dwarfstar.distributed.speculation`): the same loop, with the draft on
the last stage, next to the streams.

`margin` is ds4's confidence gate: drafting stops at the first draft whose top-1 / top-2 logit gap
is below it. It changes only how much is drafted, never what is emitted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from dwarfstar.errors import DwarfStarError
from dwarfstar.model.file_v41 import ModelFile41
from dwarfstar.model.forward import Transformer
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.model.loader import ModelFile
from dwarfstar.model.model_v41 import Model41
from dwarfstar.model.state import SequenceState, StateSnapshot
from dwarfstar.prompt.dsml_guard import ToolGuard
from dwarfstar.sampling import Sampler, SamplingParams
from dwarfstar.session.session import Session
from dwarfstar.speculative.dspark import DSparkDraft, DSparkDrafter, DSparkTrack
from dwarfstar.speculative.dspark_v41 import DSparkDraft41, LocalRunner41
from dwarfstar.speculative.mtp import MTPDraft, forward_of, load_draft
from dwarfstar.speculative.mtp_options import (
    ALIGNMENTS,
    MAX_DRAFT,
    MTP41_REFUSAL,
    DSparkOptions,
    MTPOptions,
    check_settings,
)
from dwarfstar.speculative.rollback import CompressorTap, can_truncate, truncate
from dwarfstar.speculative.track import DraftTrack
from dwarfstar.speculative.verify import Verdict, rule_probabilities, verify_greedy, verify_sampled, without_refused

# truncate: cut the state back in place (no pass); rerun: restore the snapshot and run the kept tokens
# again, one more pass, which computes them exactly as plain decoding does (the MoE of a longer pass
# groups rows differently, so truncated states differ from plain decoding's in float rounding)
ROLLBACKS = ("truncate", "rerun")


class Drafter:
    """What proposes tokens: `propose(speculator, n, sampler)` -> (drafts, their draft distributions
    or None when greedy). The MTP block is one; tests script others."""

    def propose(self, spec: Speculator, n: int, sampler: Sampler) -> tuple[list[int], list[torch.Tensor] | None]:
        raise NotImplementedError


@dataclass
class SpecStats:
    steps: int = 0
    drafted: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT)  # drafts proposed at position k
    accepted: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT)  # of those, accepted
    emitted: int = 0
    rollbacks: int = 0  # steps that rejected a draft and truncated the target state

    def record(self, n: int, verdict: Verdict) -> None:
        self.steps += 1
        for k in range(n):
            self.drafted[k] += 1
            self.accepted[k] += k < verdict.accepted

    def acceptance(self) -> list[float]:
        """Per draft position, the share of drafts accepted (of those proposed there)."""
        return [a / d for a, d in zip(self.accepted, self.drafted, strict=True) if d]

    def add(self, other: SpecStats) -> None:
        """Count `other`'s steps as well (figures over several runs)."""
        self.steps, self.emitted, self.rollbacks = (
            self.steps + other.steps,
            self.emitted + other.emitted,
            self.rollbacks + other.rollbacks,
        )
        self.drafted = [a + b for a, b in zip(self.drafted, other.drafted, strict=True)]
        self.accepted = [a + b for a, b in zip(self.accepted, other.accepted, strict=True)]

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per verification step."""
        return sum(self.accepted) / self.steps if self.steps else 0.0


class LocalRunner:
    """How a speculator runs a target model in its own process: its passes, its snapshots, and the
    rollback of its states. A route has its own (`dwarfstar.distributed.speculation`), whose last
    stage holds the draft."""

    def __init__(self, model: Transformer) -> None:
        self.target = model

    def track(self, draft: MTPDraft | DSparkDrafter, state: SequenceState, shift: int) -> DraftTrack | DSparkTrack:
        """The draft following `state` from its position now."""
        if isinstance(draft, DSparkDrafter):
            return DSparkTrack(draft, state.pos, draft.confidence)
        return DraftTrack(draft, shift, state.pos)

    def run(
        self,
        tokens: list[int],
        state: SequenceState,
        all_logits: bool,
        track: DraftTrack,
        images: Sequence[ImageSpan] = (),
    ) -> tuple[Any, Any]:
        """Logits of a pass (with its image blocks) and what it leaves for the draft (`track.rows`)."""
        with capturing(self.target, track.layers) as captured:
            logits, streams = self.target.forward_streams(tokens, state, all_logits=all_logits, images=images or None)
        return logits, track.rows(streams, captured, slice(0, len(tokens)))

    def snapshot(self, state: SequenceState) -> StateSnapshot:
        return state.snapshot()

    def verify(
        self, token_lists: Sequence[Sequence[int]], states: Sequence[SequenceState], tracks: Sequence[DraftTrack]
    ) -> tuple[list[tuple[torch.Tensor, Any, slice]], CompressorTap]:
        """One pass over every sequence's verified tokens, its compressor projections recorded."""
        layers = sorted({il for track in tracks for il in track.layers})
        with CompressorTap(self.target) as tap, capturing(self.target, layers) as captured:
            passes = forward_streams_batch(self.target, token_lists, states)
        return [
            (logits, track.rows(h, captured, rows), rows)
            for (logits, h, rows), track in zip(passes, tracks, strict=True)
        ], tap

    def can_truncate(self, verified: int, tap: CompressorTap) -> bool:
        return can_truncate(self.target, verified)

    def truncate(
        self, state: SequenceState, snap: StateSnapshot, tap: CompressorTap, rows: slice, kept: list[int], logits
    ) -> None:
        truncate(self.target, state, snap, tap.of(rows), kept, logits)

    def restore(self, state: SequenceState, snap: StateSnapshot) -> None:
        state.restore(snap)


@contextmanager
def capturing(target: Transformer, layers: Sequence[int]) -> Iterator[dict[int, Any]]:
    """The streams after each of `layers` in the passes run inside, by layer (none: no tap)."""
    captured: dict[int, Any] = {}
    if not layers:
        yield captured
        return

    def tap(il: int, h: Any, batch: Any) -> None:
        if il in layers:
            captured[il] = h

    target.taps.append(tap)
    try:
        yield captured
    finally:
        target.taps.remove(tap)


def runner_for(backend: Any) -> Any:
    """The backend's own runner (a route's), else one for the forward pass it runs (V4.1's: `LocalRunner41`)."""
    own = getattr(backend, "speculation_runner", None)
    if own is not None:
        return own()
    return LocalRunner41(backend) if isinstance(backend, Model41) else LocalRunner(forward_of(backend))


class Speculator:
    """Speculative generation for one session of `target`, drafting with `drafter` (MTP by default)."""

    def __init__(
        self,
        session: Session,
        draft: MTPDraft,
        n_draft: int,
        alignment: str = "next",
        margin: float = 0.0,
        drafter: Drafter | None = None,
        rollback: str = "truncate",
    ) -> None:
        check_settings(n_draft, alignment, margin)
        if rollback not in ROLLBACKS:
            raise DwarfStarError(f"unknown rollback {rollback!r}; choose one of {', '.join(ROLLBACKS)}")
        self.session, self.runner, self.draft = session, runner_for(session.backend), draft
        self.target = self.runner.target
        self.n_draft, self.shift, self.margin = n_draft, ALIGNMENTS[alignment], margin
        self.truncates = rollback == "truncate"
        self.drafter = drafter or MTPDrafter()
        # the draft follows the target from where speculation starts: a session that already holds a
        # prefix (a server's reused one) has no target streams for it, so the draft's rows begin here
        self.track = self.runner.track(draft, session.state, self.shift)
        self.pending = -1  # the step's pending token, for the drafter
        self.stats = SpecStats()

    @property
    def state(self):
        return self.session.state

    # -- the target ----------------------------------------------------------------------------------------
    def _run(self, tokens: list[int], known: list[int], all_logits: bool) -> torch.Tensor:
        """Run tokens through the target, keep their streams for the draft, feed the draft what it can."""
        logits = self._pass(tokens, known, all_logits)
        self.session.stats.computed += len(tokens)
        return logits

    def _pass(
        self, tokens: list[int], known: list[int], all_logits: bool, images: Sequence[ImageSpan] = ()
    ) -> torch.Tensor:
        logits, streams = self.runner.run(tokens, self.state, all_logits, self.track, images)
        self.track.hold(streams)
        self._feed(known)
        return logits

    def _feed(self, known: list[int]) -> None:
        """Draft rows for every held hidden row whose paired token is known (`known`: the sequence)."""
        self.track.feed(known, self.state.pos)

    def prefill(
        self,
        tokens: Sequence[int],
        images: Sequence[ImageSpan] = (),
        should_stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """Append a prompt, with its image blocks, in the session's passes (`Session.prefill`: its
        chunks and marks, a block never split, `should_stop` between passes), each run through the
        target here so the draft follows. Returns the next-token logits."""
        known = self.state.tokens + list(tokens)

        def run(piece: list[int], spans: list[ImageSpan]) -> None:
            self._pass(piece, known, all_logits=False, images=spans)

        return self.session.prefill(tokens, should_stop=should_stop, images=images, run=run)

    # -- generation ------------------------------------------------------------------------------------------
    def generate(
        self,
        max_tokens: int,
        sampler: Sampler | SamplingParams,
        stop_tokens: Sequence[int] = (),
        should_stop: Callable[[], bool] | None = None,
        guard: ToolGuard | None = None,
    ) -> Iterator[int]:
        """As `Session.generate`: up to max_tokens tokens, each kept in the session, a stop token last."""
        if self.state.logits is None:
            raise DwarfStarError("nothing to continue: prefill a prompt first")
        if self.track.fed_to + self.track.held != self.state.pos:
            raise DwarfStarError("the session changed outside the speculator; prefill through it")
        sampler = sampler if isinstance(sampler, Sampler) else Sampler(sampler)
        stops, budget = set(stop_tokens), min(max_tokens, self.session.ctx - self.state.pos)
        if budget <= 0:
            return
        pending = self.session.backend.sample_batch(self.state.logits.reshape(1, -1), [sampler])[0]
        if guard is not None:
            pending = guard.choose(pending, self.state.logits, sampler)
            guard.push(pending)

        def ends(token: int) -> bool:  # once per emitted token, in order
            if guard is not None:
                guard.push(token)
            return token in stops

        emitted = 1
        yield pending
        while pending not in stops and emitted < budget and not (should_stop and should_stop()):
            emit = step_batch([self], [pending], [sampler], [budget - emitted], [ends], [guard])[0]
            yield from emit
            emitted += len(emit)
            pending = emit[-1]
        self.append(pending)

    def append(self, token: int) -> None:
        """Run the pending token into the state: the end of a reply whose last token stays in the KV."""
        self._run([token], self.state.tokens + [token], all_logits=False)

    def _draft(self, pending: int, sampler: Sampler, room: int) -> tuple[list[int], list[torch.Tensor] | None]:
        """The drafts after `pending` (at most room - 1, so that the step emits at most `room`); none
        before the draft has a row (the first step of speculation started on a filled session)."""
        self._feed(self.state.tokens + [pending])
        self.pending = pending
        n = min(self.n_draft, room - 1) if self.track.ready else 0
        return self.drafter.propose(self, n, sampler) if n > 0 else ([], None)

    def _settle(self, step: _Step, logits: torch.Tensor, streams: Any, tap: Any, rows: slice) -> list[int]:
        """Verify the step's drafts against the pass's logits [n+1, vocab]; keep what is accepted."""
        pending, drafts = step.verified[0], step.verified[1:]
        if step.sampler.params.greedy:
            verdict = verify_greedy(without_refused(logits, step.sampler.params), drafts)
        else:
            p = [rule_probabilities(row, step.sampler.params) for row in logits]
            verdict = verify_sampled(p, step.q or [], drafts, step.sampler)
        if step.guard is not None:
            verdict = _guided(step.guard, drafts, verdict, logits)
        self.stats.record(len(drafts), verdict)
        emit = [*drafts[: verdict.accepted], verdict.token][: step.room]
        end = next((i for i, token in enumerate(emit) if step.ends(token)), None)
        emit = emit if end is None else emit[: end + 1]
        self.stats.emitted += len(emit)
        keep = [pending, *emit[:-1]]  # a prefix of what was verified
        known = self.state.tokens[: self.state.pos - len(step.verified)] + keep + emit[-1:]
        if len(keep) < len(step.verified):
            self.stats.rollbacks += 1
            if self.truncates and self.runner.can_truncate(len(step.verified), tap):
                self.runner.truncate(self.state, step.snap, tap, rows, keep, logits)
                streams = streams[: len(keep)]
            else:  # (or the pass overwrote kept ring rows) back to before it, then the kept tokens again
                self.runner.restore(self.state, step.snap)
                self._run(keep, known, all_logits=False)
                return emit
        self.track.hold(streams)
        self._feed(known)
        return emit


def _guided(guard: ToolGuard, drafts: list[int], verdict: Verdict, logits: torch.Tensor) -> Verdict:
    """`verdict` with the tool-call guard's choices: row k of `logits` follows the first k emitted
    tokens, so the first token the guard replaces becomes the correction at its place."""
    guard = guard.copy()
    for k, token in enumerate([*drafts[: verdict.accepted], verdict.token]):
        chosen = guard.choose(token, logits[k])
        if chosen != token:
            return Verdict(k, chosen)
        guard.push(token)
    return verdict


@dataclass
class _Step:
    """One speculator's part of a batched step."""

    verified: list[int]  # the pending token, then the drafts
    q: list[torch.Tensor] | None  # the drafts' distributions (sampling)
    snap: StateSnapshot | None  # the target state before the pass, when there are drafts to reject
    sampler: Sampler
    room: int
    ends: Callable[[int], bool]
    guard: ToolGuard | None = None


def step_batch(
    specs: Sequence[Speculator],
    pending: Sequence[int],
    samplers: Sequence[Sampler],
    rooms: Sequence[int],
    ends: Sequence[Callable[[int], bool]],
    guards: Sequence[ToolGuard | None] | None = None,
) -> list[list[int]]:
    """One draft-verify round for several speculators of one target, verified in one batched pass.

    Each emits at most its `room` tokens, cut after the first for which its `ends(token)` is true
    (called in order, once per emitted token). Each state then holds its pending token and every
    emitted token but the last, the new pending one. A speculator's tool-call guard (`guards`, at the
    state before the pending token's successor) chooses among the verified tokens as it chooses in
    plain decoding: the first it would replace is replaced, and the round ends there."""
    runner = specs[0].runner
    if any(spec.target is not runner.target for spec in specs):
        raise DwarfStarError("speculators verified together must share one target model")
    steps = []
    guards = guards or [None] * len(specs)
    for spec, token, sampler, room, end, guard in zip(specs, pending, samplers, rooms, ends, guards, strict=True):
        drafts, q = spec._draft(token, sampler, room)
        snap = runner.snapshot(spec.state) if drafts else None
        steps.append(_Step([token, *drafts], q, snap, sampler, room, end, guard))
    passes, tap = runner.verify(
        [step.verified for step in steps], [spec.state for spec in specs], [spec.track for spec in specs]
    )
    emitted = []
    for spec, step, (logits, streams, rows) in zip(specs, steps, passes, strict=True):
        spec.session.stats.computed += len(step.verified)
        emitted.append(spec._settle(step, logits, streams, tap, rows))
    return emitted


@torch.inference_mode()
def forward_streams_batch(
    model: Transformer, token_lists: Sequence[Sequence[int]], states: Sequence[SequenceState]
) -> list[tuple[torch.Tensor, Any, slice]]:
    """`Transformer.forward_streams` for several sequences in one pass: per sequence its logits at
    every position [T, vocab], its final streams [T, n, dim] and its rows in the batch."""
    batch = model.batch(token_lists, states)
    h, y, _ = model.run_to_head(model.embed(batch), batch, True)
    logits = model.ops.logits(y, batch)
    model.advance(batch)
    out = []
    for seq in batch.seqs:
        mine = logits[seq.rows]
        seq.state.logits = mine[-1].clone()
        out.append((mine, h[seq.rows], seq.rows))
    return out


class MTPDrafter(Drafter):
    """The MTP block drafting on its own output: the first draft from the target's streams, each
    further one from the block's output streams of the row before (`DraftTrack.propose`, wherever
    the speculator's track lives)."""

    def propose(self, spec: Speculator, n: int, sampler: Sampler) -> tuple[list[int], list[torch.Tensor] | None]:
        drafts, logits = spec.track.propose(spec.state.tokens + [spec.pending], n, sampler, spec.margin)
        if sampler.params.greedy:
            return drafts, None
        return drafts, [rule_probabilities(row, sampler.params) for row in logits]


@dataclass(frozen=True)
class MTPSpeculation:
    """A loaded draft and its settings: a speculator for any session of its target (a server's)."""

    options: MTPOptions
    draft: MTPDraft

    def start(self, session: Session) -> Speculator:
        o = self.options
        return Speculator(session, self.draft, o.n_draft, o.alignment, o.margin)


@dataclass(frozen=True)
class DSparkSpeculation:
    """A loaded DSpark drafter: a speculator for any session of its target, drafting whole blocks."""

    options: DSparkOptions
    draft: DSparkDrafter

    def start(self, session: Session) -> Speculator:
        return Speculator(session, self.draft, self.draft.d.block_size)  # type: ignore[arg-type]


def check_drafter(options: DSparkOptions, backend: Any, model: ModelFile | ModelFile41) -> None:
    """`--dspark-strict`: the drafter loads for `backend` running `model` with every check speculation
    makes (a bad file is the same named error), then is let go: decoding will not use it."""
    _dspark(options, backend, model).close()


def _dspark(options: DSparkOptions, backend: Any, model: ModelFile | ModelFile41) -> DSparkDrafter:
    """The DSpark drafter of `model`'s family on `backend` (a route's: on its last stage)."""
    path = options.file_for(model.path)
    remote = getattr(backend, "dspark_draft", None)
    if remote is not None:
        return remote(model, path, options.confidence)
    if isinstance(model, ModelFile41):
        return DSparkDraft41(backend, model, path, options.confidence)
    return DSparkDraft(forward_of(backend), model, path, options.confidence)


def load_speculation(
    options: MTPOptions | DSparkOptions, backend: Any, model: ModelFile | ModelFile41
) -> MTPSpeculation | DSparkSpeculation:
    """The draft `options` name for `backend` running `model` (the engine's), loaded once."""
    if isinstance(options, DSparkOptions):
        return DSparkSpeculation(options, _dspark(options, backend, model))
    if isinstance(model, ModelFile41):
        raise DwarfStarError(MTP41_REFUSAL)
    return MTPSpeculation(options, load_draft(backend, model, options.file_for(model.path)))
