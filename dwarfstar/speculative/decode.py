"""Speculative decoding on a `Session`: the MTP block drafts, one target pass verifies, rollback is a
snapshot restore plus the accepted tokens.

A step starts with the target state holding every emitted token but the last (`pending`). The draft
proposes up to N tokens; the target runs [pending, d_1..d_n] in one pass; `verify` keeps the first m
drafts and names the next token. If m < n the target returns to the snapshot taken before the pass
and runs [pending, d_1..d_m] again: that rewrites exactly the raw-window rows and compressor
frontiers the rejected tokens touched, and the compressed rows they appended lie past pos // ratio,
where nothing reads them (no full replay). The draft's own window is rolled back the same way.

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
from dwarfstar.session.sampling import Sampler, SamplingParams
from dwarfstar.session.session import Session
from dwarfstar.speculative.mtp import MTPDraft
from dwarfstar.speculative.verify import Verdict, draw, next_uniform, rule_probabilities, verify_greedy, verify_sampled

MAX_DRAFT = 8  # drafts per step: verifying N tokens routes up to 6N experts per layer
MAX_MARGIN = 1000.0  # ds4's range for --mtp-margin
ALIGNMENTS = {"next": 1, "same": 0}  # the paired token's offset from the hidden state's position


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
    ) -> None:
        if not isinstance(session.backend, Transformer):
            raise DwarfStarError("speculative decoding needs a backend built on the shared forward pass")
        if not 1 <= n_draft <= MAX_DRAFT:
            raise DwarfStarError(f"--mtp-draft must be in 1..{MAX_DRAFT}, got {n_draft}")
        if alignment not in ALIGNMENTS:
            raise DwarfStarError(f"unknown MTP alignment {alignment!r}; choose one of {', '.join(ALIGNMENTS)}")
        if not 0 <= margin <= MAX_MARGIN:
            raise DwarfStarError(f"--mtp-margin must be in 0..{MAX_MARGIN:g}, got {margin}")
        if session.state.pos:
            raise DwarfStarError("start speculation on an empty session: the draft needs every position's state")
        self.session, self.target, self.draft = session, session.backend, draft
        self.n_draft, self.shift, self.margin = n_draft, ALIGNMENTS[alignment], margin
        self.drafter = drafter or MTPDrafter()
        self.draft_state = draft.new_state()
        self.hidden: Any = None  # target streams of positions draft_state.pos .. state.pos - 1, not yet fed
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
        start = self.draft_state.pos
        end = min(self.state.pos, len(known) - self.shift)
        if end <= start:
            return
        count = end - start
        rows, rest = self.hidden[:count], self.hidden[count:]
        self.last = self.draft.rows(rows, known[start + self.shift : end + self.shift], self.draft_state)
        self.hidden = rest if rest.shape[0] else None

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
        if self.draft_state.pos + (0 if self.hidden is None else self.hidden.shape[0]) != self.state.pos:
            raise DwarfStarError("the session changed outside the speculator; prefill through it")
        sampler = sampler if isinstance(sampler, Sampler) else Sampler(sampler)
        stops, budget = set(stop_tokens), min(max_tokens, self.session.ctx - self.state.pos)
        if budget <= 0:
            return
        pending = self.target.sample_batch(self.state.logits.reshape(1, -1), [sampler])[0]
        emitted = 1
        yield pending
        while pending not in stops and emitted < budget and not (should_stop and should_stop()):
            emit = self._step(pending, sampler, budget - emitted, stops)
            yield from emit
            emitted += len(emit)
            pending = emit[-1]
        self._run([pending], self.state.tokens + [pending], all_logits=False)

    def _step(self, pending: int, sampler: Sampler, room: int, stops: set[int]) -> list[int]:
        """One draft-verify round after `pending`: the tokens it emits (at most `room`, cut after a stop
        token). The state then holds pending and every emitted token but the last, the new pending."""
        known = self.state.tokens + [pending]
        self._feed(known)
        self.pending = pending
        n = min(self.n_draft, room - 1)
        drafts, q = self.drafter.propose(self, n, sampler) if n > 0 else ([], None)
        snap = self.state.snapshot() if drafts else None
        logits, streams = self.target.forward_streams([pending, *drafts], self.state, all_logits=True)
        self.session.stats.computed += 1 + len(drafts)
        if sampler.params.greedy:
            verdict = verify_greedy(logits, drafts)
        else:
            p = [rule_probabilities(row, sampler.params) for row in logits]
            verdict = verify_sampled(p, q or [], drafts, sampler)
        self.stats.record(len(drafts), verdict)
        emit = [*drafts[: verdict.accepted], verdict.token][:room]
        stop = next((i for i, token in enumerate(emit) if token in stops), None)
        emit = emit if stop is None else emit[: stop + 1]
        self.stats.emitted += len(emit)
        keep = [pending, *emit[:-1]]  # a prefix of what was verified
        if len(keep) == 1 + len(drafts):
            storage = self.state.cache.storage
            self.hidden = streams if self.hidden is None else storage.cat((self.hidden, streams))
            self._feed(known + emit)
        else:  # rollback: back to before the pass, then only the kept tokens
            self.state.restore(snap)
            self._run(keep, known + emit, all_logits=False)
        return emit


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
                token = sequence[spec.draft_state.pos + spec.shift]
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
