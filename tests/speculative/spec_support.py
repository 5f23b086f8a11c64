"""What the speculative tests share: plain greedy runs, and a scripted drafter."""

from __future__ import annotations

import io

from dwarfstar.kvcache.payload import write_payload
from dwarfstar.model.state import SequenceState
from dwarfstar.sampling import GREEDY
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import Drafter, Speculator
from dwarfstar.speculative.mtp import MTPDraft

CTX, CHUNK = 1024, 16  # chunks of 16: the 20-token prompt is two prefill calls


def plain_greedy(backend, prompt: list[int], n: int) -> Session:
    session = Session(backend, ctx=CTX, chunk=CHUNK)
    session.prefill(prompt)
    list(session.generate(n, GREEDY))
    return session


def speculative(backend, draft: MTPDraft, prompt: list[int], n_draft: int, **options) -> Speculator:
    spec = Speculator(Session(backend, ctx=CTX, chunk=CHUNK), draft, n_draft, **options)
    spec.prefill(prompt)
    return spec


def payload(state: SequenceState, backend) -> bytes:
    buf = io.BytesIO()
    write_payload(buf, state, backend.args, CTX, CHUNK)
    return buf.getvalue()


class ScriptedDrafter(Drafter):
    """Proposes the known greedy continuation `truth` (prompt + output), wrong wherever the drafted
    position p has p % wrong_every == 1, so steps accept all, some or none of their drafts."""

    def __init__(self, truth: list[int], wrong_every: int) -> None:
        self.truth, self.wrong_every = truth, wrong_every

    def propose(self, spec, n, sampler):
        first = spec.state.pos + 1  # the pending token sits at state.pos
        drafts = []
        for p in range(first, first + n):
            token = self.truth[p] if p < len(self.truth) else 3
            drafts.append(token + 1 if p % self.wrong_every == 1 else token)
        return drafts, None


def first_gap(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
