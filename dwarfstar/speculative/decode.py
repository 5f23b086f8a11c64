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

`margin` is ds4's confidence gate: drafting stops at the first draft whose top-1 / top-2 logit gap
is below it. It changes only how much is drafted, never what is emitted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dwarfstar.errors import DwarfStarError
from dwarfstar.model.forward import Transformer
from dwarfstar.model.state import SequenceState, StateSnapshot
from dwarfstar.session.sampling import Sampler, SamplingParams
from dwarfstar.session.session import Session
from dwarfstar.speculative.mtp import MTPDraft, forward_of
from dwarfstar.speculative.rollback import CompressorTap, can_truncate, truncate
from dwarfstar.speculative.verify import Verdict, draw, next_uniform, rule_probabilities, verify_greedy, verify_sampled

MAX_DRAFT = 8  # drafts per step: verifying N tokens routes up to 6N experts per layer
MAX_MARGIN = 1000.0  # ds4's range for --mtp-margin
ALIGNMENTS = {"next": 1, "same": 0}  # the paired token's offset from the hidden state's position
# truncate: cut the state back in place (no pass); rerun: restore the snapshot and run the kept tokens
# again, one more pass, which computes them exactly as plain decoding does (the MoE of a longer pass
# groups rows differently, so truncated states differ from plain decoding's in float rounding)
ROLLBACKS = ("truncate", "rerun")


def check_settings(n_draft: int, alignment: str, margin: float) -> None:
    """The draft count, alignment and margin are usable, else a clear error (named as the flags)."""
    if not 1 <= n_draft <= MAX_DRAFT:
        raise DwarfStarError(f"--mtp-draft must be in 1..{MAX_DRAFT}, got {n_draft}")
    if alignment not in ALIGNMENTS:
        raise DwarfStarError(f"unknown MTP alignment {alignment!r}; choose one of {', '.join(ALIGNMENTS)}")
    if not 0 <= margin <= MAX_MARGIN:
        raise DwarfStarError(f"--mtp-margin must be in 0..{MAX_MARGIN:g}, got {margin}")


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

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per verification step."""
        return sum(self.accepted) / self.steps if self.steps else 0.0


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
        self.session, self.target, self.draft = session, forward_of(session.backend), draft
        self.n_draft, self.shift, self.margin = n_draft, ALIGNMENTS[alignment], margin
        self.truncates = rollback == "truncate"
        self.drafter = drafter or MTPDrafter()
        # the draft follows the target from where speculation starts: a session that already holds a
        # prefix (a server's reused one) has no target streams for it, so the draft's rows begin here
        self.base = session.state.pos
        self.draft_state = draft.new_state()
        self.hidden: Any = None  # target streams of positions base + draft_state.pos .. state.pos - 1, not yet fed
        self.last: tuple[torch.Tensor, Any] | None = None  # the draft's last row: logits, output streams
        self.pending = -1  # the step's pending token, for the drafter
        self.stats = SpecStats()

    @property
    def state(self):
        return self.session.state

    # -- the target ----------------------------------------------------------------------------------------
    def _run(self, tokens: list[int], known: list[int], all_logits: bool) -> torch.Tensor:
        """Run tokens through the target, keep their streams for the draft, feed the draft what it can."""
        logits, streams = self.target.forward_streams(tokens, self.state, all_logits=all_logits)
        storage = self.state.cache.storage
        self.hidden = streams if self.hidden is None else storage.cat((self.hidden, streams))
        self.session.stats.computed += len(tokens)
        self._feed(known)
        return logits

    def _feed(self, known: list[int]) -> None:
        """Draft rows for every held hidden row whose paired token is known (`known`: the sequence)."""
        start = self.drafted_to
        end = min(self.state.pos, len(known) - self.shift)
        if end <= start:
            return
        count = end - start
        rows, rest = self.hidden[:count], self.hidden[count:]
        self.last = self.draft.rows(rows, known[start + self.shift : end + self.shift], self.draft_state)
        self.hidden = rest if rest.shape[0] else None

    @property
    def drafted_to(self) -> int:
        """The target position the draft's next row reads."""
        return self.base + self.draft_state.pos

    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append a prompt in the session's chunks; the draft follows. Returns the next-token logits."""
        tokens = list(tokens)
        self.session._check_room(len(tokens))
        self.session.stats.requested += len(tokens)
        known = self.state.tokens + tokens
        done, chunk = 0, self.session.chunk
        while done < len(tokens):
            end = min(len(tokens), done + chunk - self.state.pos % chunk)
            self._run(tokens[done:end], known, all_logits=False)
            done = end
        return self.state.logits

    # -- generation ------------------------------------------------------------------------------------------
    def generate(
        self,
        max_tokens: int,
        sampler: Sampler | SamplingParams,
        stop_tokens: Sequence[int] = (),
        should_stop: Callable[[], bool] | None = None,
    ) -> Iterator[int]:
        """As `Session.generate`: up to max_tokens tokens, each kept in the session, a stop token last."""
        if self.state.logits is None:
            raise DwarfStarError("nothing to continue: prefill a prompt first")
        if self.drafted_to + (0 if self.hidden is None else self.hidden.shape[0]) != self.state.pos:
            raise DwarfStarError("the session changed outside the speculator; prefill through it")
        sampler = sampler if isinstance(sampler, Sampler) else Sampler(sampler)
        stops, budget = set(stop_tokens), min(max_tokens, self.session.ctx - self.state.pos)
        if budget <= 0:
            return
        pending = self.session.backend.sample_batch(self.state.logits.reshape(1, -1), [sampler])[0]
        emitted = 1
        yield pending
        while pending not in stops and emitted < budget and not (should_stop and should_stop()):
            emit = step_batch([self], [pending], [sampler], [budget - emitted], [stops.__contains__])[0]
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
        n = min(self.n_draft, room - 1) if self.last is not None else 0
        return self.drafter.propose(self, n, sampler) if n > 0 else ([], None)

    def _settle(self, step: _Step, logits: torch.Tensor, streams: Any, tap: CompressorTap, rows: slice) -> list[int]:
        """Verify the step's drafts against the pass's logits [n+1, vocab]; keep what is accepted."""
        pending, drafts = step.verified[0], step.verified[1:]
        if step.sampler.params.greedy:
            verdict = verify_greedy(logits, drafts)
        else:
            p = [rule_probabilities(row, step.sampler.params) for row in logits]
            verdict = verify_sampled(p, step.q or [], drafts, step.sampler)
        self.stats.record(len(drafts), verdict)
        emit = [*drafts[: verdict.accepted], verdict.token][: step.room]
        end = next((i for i, token in enumerate(emit) if step.ends(token)), None)
        emit = emit if end is None else emit[: end + 1]
        self.stats.emitted += len(emit)
        keep = [pending, *emit[:-1]]  # a prefix of what was verified
        known = self.state.tokens[: self.state.pos - len(step.verified)] + keep + emit[-1:]
        if len(keep) < len(step.verified):
            self.stats.rollbacks += 1
            if self.truncates and can_truncate(self.target, len(step.verified)):
                truncate(self.target, self.state, step.snap, tap.of(rows), keep, logits)
                streams = streams[: len(keep)]
            else:  # (or the pass overwrote kept ring rows) back to before it, then the kept tokens again
                self.state.restore(step.snap)
                self._run(keep, known, all_logits=False)
                return emit
        storage = self.state.cache.storage
        self.hidden = streams if self.hidden is None else storage.cat((self.hidden, streams))
        self._feed(known)
        return emit


@dataclass
class _Step:
    """One speculator's part of a batched step."""

    verified: list[int]  # the pending token, then the drafts
    q: list[torch.Tensor] | None  # the drafts' distributions (sampling)
    snap: StateSnapshot | None  # the target state before the pass, when there are drafts to reject
    sampler: Sampler
    room: int
    ends: Callable[[int], bool]


def step_batch(
    specs: Sequence[Speculator],
    pending: Sequence[int],
    samplers: Sequence[Sampler],
    rooms: Sequence[int],
    ends: Sequence[Callable[[int], bool]],
) -> list[list[int]]:
    """One draft-verify round for several speculators of one target, verified in one batched pass.

    Each emits at most its `room` tokens, cut after the first for which its `ends(token)` is true
    (called in order, once per emitted token). Each state then holds its pending token and every
    emitted token but the last, the new pending one."""
    target = specs[0].target
    if any(spec.target is not target for spec in specs):
        raise DwarfStarError("speculators verified together must share one target model")
    steps = []
    for spec, token, sampler, room, end in zip(specs, pending, samplers, rooms, ends, strict=True):
        drafts, q = spec._draft(token, sampler, room)
        snap = spec.state.snapshot() if drafts else None
        steps.append(_Step([token, *drafts], q, snap, sampler, room, end))
    with CompressorTap(target) as tap:
        passes = forward_streams_batch(target, [step.verified for step in steps], [spec.state for spec in specs])
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
    h = model.run_layers(model.embed(batch), batch)
    y, _ = model.head(h, batch, True)
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
    further one from the block's output streams of the row before."""

    def propose(self, spec: Speculator, n: int, sampler: Sampler) -> tuple[list[int], list[torch.Tensor] | None]:
        greedy = sampler.params.greedy
        drafts: list[int] = []
        dists: list[torch.Tensor] = []
        snap = spec.draft_state.snapshot() if n > 1 else None
        assert spec.last is not None
        logits, streams = spec.last
        sequence = spec.state.tokens + [spec.pending]
        for k in range(n):
            if k:
                token = sequence[spec.drafted_to + spec.shift]
                logits, streams = spec.draft.rows(streams, [token], spec.draft_state)
            if spec.margin and _margin(logits) < spec.margin:
                break
            if greedy:
                token = int(logits.argmax())
            else:
                q = rule_probabilities(logits, sampler.params)
                token = draw(q, next_uniform(sampler))
                dists.append(q)
            drafts.append(token)
            sequence.append(token)
        if snap is not None:
            spec.draft_state.restore(snap)
        return drafts, None if greedy else dists


def _margin(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])
