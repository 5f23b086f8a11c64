"""A request's life in the engine worker (`scheduler.py`): its phase, what each phase holds, and the
queue its events travel back to the event loop on.

    QUEUED --admitted--> PREFILL --prompt in the KV--> DECODE --finished--> DONE
    QUEUED, PREFILL, DECODE --failed or cancelled--> DONE

The moves are `NEXT`; a job changes phase only through `admit`, `start_decoding` and `end`, and a
move `NEXT` does not list raises `IllegalTransition` (a scheduler bug), instead of leaving the job in
a phase nothing serves.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from dwarfstar.kvcache.kvpolicy import SaveReason
from dwarfstar.model.image_spans import ImageSpan, cut_outside
from dwarfstar.model.state import SequenceState
from dwarfstar.prompt.dsml_guard import ToolGuard
from dwarfstar.sampling import Sampler
from dwarfstar.serving.generation import Event, GenerationRequest, TokenLogprob, Usage
from dwarfstar.serving.output import OutputDecoder
from dwarfstar.serving.pool import DiskLookup, Lease
from dwarfstar.session.loopguard import Repetition
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import Speculator

_job_ids = itertools.count(1)


class Phase(Enum):
    QUEUED = "queued"  # waiting for a session (and, maybe, for its disk-cache read)
    PREFILL = "prefill"  # holding a session, prompt tokens still to run
    DECODE = "decode"  # generating
    DONE = "done"  # finished, failed or cancelled: its session given back


NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.QUEUED: frozenset({Phase.PREFILL, Phase.DONE}),
    Phase.PREFILL: frozenset({Phase.DECODE, Phase.DONE}),
    Phase.DECODE: frozenset({Phase.DONE}),
    Phase.DONE: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass(frozen=True)
class DiskRead:
    """While queued: the disk-cache read under way for the request (on the disk cache's reader thread)."""

    better_than: int  # the prefix memory already offers, which a file must beat
    future: Future[SequenceState | None]

    def lookup(self) -> DiskLookup:
        return DiskLookup(self.better_than, self.future.result())


@dataclass
class KV:
    """From admission: the leased session, and the prompt tokens not yet in its KV."""

    lease: Lease
    pending: list[int]
    images: list[ImageSpan] = field(default_factory=list)  # the image blocks among `pending` (offsets into it)
    save_stops: list[tuple[int, SaveReason]] = field(default_factory=list)  # disk-cache saves due inside the prefill

    def take(self, budget: int) -> tuple[list[int], list[ImageSpan]]:
        """The next prefill piece and its image blocks (offsets into it): up to `budget` pending tokens,
        cut at the session's next chunk end or checkpoint mark and at the next disk-cache save (empty
        when the budget is spent), and never inside an image block (one that starts the piece is
        taken whole, past the budget)."""
        session = self.lease.session
        done = len(session.tokens)
        size = min(budget, session.room(self.images))
        if self.save_stops:
            size = min(size, self.save_stops[0][0] - done)
        size = cut_outside(self.images, max(size, 0))
        piece, self.pending = self.pending[:size], self.pending[size:]
        mine = [span for span in self.images if span.stop <= size]
        self.images = [replace(span, offset=span.offset - size) for span in self.images[len(mine) :]]
        return piece, mine


@dataclass
class Decoding:
    """From the end of the prefill: how the next token is drawn, and how tokens become the client's events."""

    sampler: Sampler
    decoder: OutputDecoder
    drawn: int | None = None  # the next token, drawn by the decode step that ran the last one
    logprobs: list[TokenLogprob] = field(default_factory=list)  # the tokens' so far, when the request asks
    repetition: Repetition | None = None  # the loop guard's watch on the output, when it is on
    guard: ToolGuard | None = None  # the tool-call guard, when the request has it (prompt/dsml_guard.py)


@dataclass
class Drafting:
    """With `serve --mtp`: the request's speculator, and the token emitted but not yet in the KV (from
    the request's first generated token on: the next draft-verify round runs it, with its drafts)."""

    speculator: Speculator
    pending: int | None = None

    def counts(self) -> tuple[int, int]:
        """Drafts verified and accepted so far."""
        stats = self.speculator.stats
        return sum(stats.drafted), sum(stats.accepted)


class Job:
    """One request's life in the worker, and the queue its events travel back to the event loop on."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, replayed: list[str]) -> None:
        self.id = next(_job_ids)
        self.request = request
        self.replayed = replayed  # tool-call ids rendered from their sampled DSML (for the trace)
        self.usage = Usage(prompt_tokens=len(request.prompt_ids))
        self.cancelled = threading.Event()
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._phase = Phase.QUEUED
        self.disk_read: DiskRead | None = None
        self.images: list[ImageSpan] | None = None  # the prompt's image blocks, encoded when first looked at
        self.kv: KV | None = None
        self.decoding: Decoding | None = None
        self.drafting: Drafting | None = None

    # -- the event loop's side -----------------------------------------------------------------------
    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, event: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            pass

    async def next_event(self, timeout: float | None = None) -> Event | None:
        """The next event, or None when `timeout` seconds pass without one."""
        try:
            return await asyncio.wait_for(self._events.get(), timeout)
        except TimeoutError:
            return None

    # -- phases ---------------------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._phase

    def _move(self, to: Phase) -> None:
        if to not in NEXT[self._phase]:
            raise IllegalTransition(f"job {self.id} cannot go from {self._phase.value} to {to.value}")
        self._phase = to

    def admit(self, kv: KV) -> None:
        self._move(Phase.PREFILL)
        self.kv, self.disk_read = kv, None

    def start_decoding(self, decoding: Decoding, drafting: Drafting | None) -> None:
        self._move(Phase.DECODE)
        self.decoding, self.drafting = decoding, drafting

    def end(self) -> None:
        self._move(Phase.DONE)

    @property
    def session(self) -> Session:
        return self.kv.lease.session

    @property
    def speculating(self) -> bool:
        """Decoding by draft-verify rounds: a token is emitted and waits, with its drafts, for the next round."""
        return self.drafting is not None and self.drafting.pending is not None

    def trace_record(self, finish: str) -> dict[str, Any]:
        """The request's `--trace` record: what it asked, where its KV came from, what it made."""
        request, lease, usage = self.request, self.kv.lease if self.kv is not None else None, self.usage
        decoder = self.decoding.decoder if self.decoding is not None else None
        completion = decoder.completion if decoder is not None else None
        return {
            "job": self.id,
            "api": request.api,
            "request": request.trace_body,
            "prompt": request.prompt.text if request.prompt is not None else None,
            "cache": lease.source if lease is not None else None,
            "match": lease.plan.match if lease is not None else None,
            "prompt_tokens": usage.prompt_tokens,
            "image_blocks": [[span.offset, span.length] for span in self.images or ()],  # (first position, length)
            "cached_tokens": usage.cached_tokens,
            "prefilled_tokens": usage.prefilled_tokens,
            "replayed_tokens": lease.replayed if lease is not None else 0,
            "completion_tokens": usage.completion_tokens,
            "draft_tokens": usage.draft_tokens,
            "accepted_draft_tokens": usage.accepted_draft_tokens,
            "finish": finish,
            "generated": decoder.text if decoder is not None else "",
            "dsml": completion.raw_dsml if completion is not None else None,
            "replayed_tool_ids": self.replayed,
            "problems": decoder.problems if decoder is not None else [],
            "loop_guard": self.loop_guard_detail(),
        }

    def loop_guard_detail(self) -> str | None:
        """What the loop guard found: a repetition that ended the output, or a tool loop in the history."""
        repetition = self.decoding.repetition if self.decoding is not None else None
        if repetition is not None and repetition.detail is not None:
            return repetition.detail
        return self.request.tool_loop
