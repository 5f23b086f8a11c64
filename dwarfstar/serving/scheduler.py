"""The engine worker: one thread owns the backend and serves every request in one loop.

Each turn of the loop
1. drops requests whose client left (queued ones, and active ones at the chunk or step they reached);
2. admits queued requests while the session pool has a session for them (prefix reuse happens here;
   a disk-cache restore is read on the disk cache's reader thread, and the request waiting for it
   holds up the queue behind it, not the running generations);
3. samples one token for every decoding request and advances them all in one batched forward;
   with MTP speculation (`serve --mtp`), a request past its first token instead drafts after its
   pending token, and all such requests are verified together in one batched pass, each emitting
   its accepted drafts and one more token (`dwarfstar.speculative`);
4. runs one prefill slice of one prefilling request (round robin), smaller while others decode, so a
   long prompt delays running generations by a slice, not by its whole prefill.
The event loop never runs model code: handlers submit a `Job` and read its events from an asyncio
queue the worker fills. The waiting queue is bounded; `submit` refuses beyond it (HTTP 429).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from dwarfstar.experts.store import ExpertStore
from dwarfstar.experts.telemetry import summary as expert_summary
from dwarfstar.model.state import SequenceState
from dwarfstar.serving.disk import DiskCache
from dwarfstar.serving.generation import Event, Failed, Finished, GenerationRequest, Started, Usage
from dwarfstar.serving.metrics import Metrics
from dwarfstar.serving.output import OutputDecoder
from dwarfstar.serving.pool import DiskLookup, Lease, SessionPool
from dwarfstar.serving.replay import ToolMemory
from dwarfstar.serving.trace import Trace
from dwarfstar.session.kvpolicy import SaveReason
from dwarfstar.session.sampling import Sampler
from dwarfstar.session.session import Session, decode_batch, prefill_batch, sample_next
from dwarfstar.speculative.decode import MTPSpeculation, Speculator, step_batch
from dwarfstar.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

BUSY_PREFILL_SLICE = 512  # prompt tokens per loop turn while other requests are decoding
_job_ids = itertools.count(1)


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


class Job:
    """One request's life in the worker, and the queue its events travel back to the event loop on."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, replayed: list[str]) -> None:
        self.id = next(_job_ids)
        self.request = request
        self.replayed = replayed  # tool-call ids rendered from their sampled DSML (for the trace)
        self.cancelled = threading.Event()
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        # worker-side state
        self.phase = "queued"  # queued | prefill | decode | done
        self.usage = Usage(prompt_tokens=len(request.prompt_ids))
        self.lease: Lease | None = None
        self.pending: list[int] = []
        self.save_stops: list[tuple[int, SaveReason]] = []  # disk-cache saves due inside the prefill
        self.sampler: Sampler | None = None
        self.drawn: int | None = None  # the next token, drawn by the decode step that took the last one
        self.decoder: OutputDecoder | None = None
        self.spec: Speculator | None = None  # with --mtp, from the request's first generated token
        self.spec_pending: int | None = None  # emitted, not yet in the KV: the next step verifies after it
        # the disk-cache lookup under way for this queued request: its better_than and the reader's result
        self.disk_lookup: tuple[int, Future[SequenceState | None]] | None = None

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


class Scheduler:
    def __init__(
        self,
        pool: SessionPool,
        tokenizer: Tokenizer,
        metrics: Metrics,
        tool_memory: ToolMemory,
        *,
        max_queue: int,
        trace: Trace | None = None,
        disk: DiskCache | None = None,
        speculation: MTPSpeculation | None = None,
        experts: ExpertStore | None = None,
    ) -> None:
        self.pool, self.tokenizer, self.metrics, self.speculation = pool, tokenizer, metrics, speculation
        self.experts = experts  # --ssd-streaming's cache, whose figures each trace record carries
        self.tool_memory, self.trace, self.max_queue, self.disk = tool_memory, trace, max_queue, disk
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []
        self._stopping = False
        self._turn = 0
        self._thread = threading.Thread(target=self._run, name="dwarfstar-engine", daemon=True)

    # -- event-loop side -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise ShuttingDown
            if len(self._waiting) >= self.max_queue:
                raise QueueFull
            self._waiting.append(job)
            self.metrics.set("dwarfstar_queue_depth", len(self._waiting))
            self._cond.notify()

    # -- worker ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._active and not self._admissible():
                    self._cond.wait()
                if self._stopping:
                    left = list(self._waiting) + self._active
                    self._waiting.clear()
                    break
                dropped = [job for job in self._waiting if job.cancelled.is_set()]
                for job in dropped:
                    self._waiting.remove(job)
            if dropped:
                self.metrics.inc("dwarfstar_cancelled_requests_total", len(dropped), phase="queued")
            try:
                for job in [job for job in self._active if job.cancelled.is_set()]:
                    self._cancel(job)
                self._admit()
                self._decode_step()
                self._prefill_step()
                self._update_gauges()
            except Exception as exc:  # a bug outside any one request's work: end them all, keep serving
                log.exception("engine loop error")
                for job in list(self._active):
                    self._fail(job, exc)
        for job in left:
            job.emit(Failed("server shutting down", job.usage))
        self.pool.save_all()

    def _admissible(self) -> bool:
        """A queued request can be looked at now: there is one, and it waits for no disk read."""
        if not self._waiting:
            return False
        lookup = self._waiting[0].disk_lookup
        return lookup is None or lookup[1].done()

    def _wake(self, _: Future) -> None:
        with self._cond:
            self._cond.notify()

    def _start_disk_lookup(self, job: Job) -> None:
        """Hand the head request's disk-cache lookup to the reader thread, when its admission would make one."""
        request = job.request
        better_than = self.pool.disk_lookup_due(request.prompt, request.prompt_ids, request.steering)
        if better_than is not None:
            job.disk_lookup = (better_than, self.disk.restore_async(request.prompt, better_than))
            job.disk_lookup[1].add_done_callback(self._wake)

    def _admit(self) -> None:
        while True:
            with self._cond:
                if not self._waiting:
                    return
                job = self._waiting[0]  # only this thread removes jobs, so it stays the head
            request = job.request
            try:
                if self.disk is not None and job.disk_lookup is None:
                    self._start_disk_lookup(job)
                looked_up = None
                if job.disk_lookup is not None:
                    better_than, future = job.disk_lookup
                    if not future.done():
                        return  # the file is being read; the running requests go on meanwhile
                    looked_up = DiskLookup(better_than, future.result())
                lease = self.pool.acquire(request.prompt, request.prompt_ids, request.steering, looked_up)
            except Exception as exc:
                with self._cond:
                    self._waiting.popleft()
                self._fail(job, exc)
                continue
            if lease is None:
                return
            with self._cond:
                self._waiting.popleft()
            try:
                self._start(job, lease)
            except Exception as exc:
                self._fail(job, exc)

    def _start(self, job: Job, lease: Lease) -> None:
        job.lease, job.phase = lease, "prefill"
        job.pending = lease.plan.suffix
        job.usage.cached_tokens = lease.plan.keep
        lease.live.tool_ids.update(job.replayed)
        if self.disk is not None:
            job.save_stops = self.disk.prefill_stops(lease.live, job.request.prompt_ids, lease.plan.keep)
        self._active.append(job)
        self.metrics.inc("dwarfstar_cache_lookups_total", source=lease.source)
        self.metrics.inc("dwarfstar_prompt_tokens_total", job.usage.prompt_tokens)
        self.metrics.inc("dwarfstar_cached_tokens_total", job.usage.cached_tokens)
        job.emit(Started(Usage(**vars(job.usage))))
        if not job.pending:
            self._start_decode(job)

    def _start_decode(self, job: Job) -> None:
        job.phase = "decode"
        job.sampler = Sampler(job.request.sampling)
        job.decoder = OutputDecoder(self.tokenizer, job.request)
        if self.speculation is not None:
            job.spec = self.speculation.start(job.lease.session)

    def _prefill_step(self) -> None:
        """One pass over the waiting prompts: a budget of tokens (a chunk; a slice while others decode,
        so their next token is not held up long) shared out in turn, every piece in one batched call."""
        prefilling = [job for job in self._active if job.phase == "prefill"]
        if not prefilling:
            return
        busy = any(job.phase == "decode" for job in self._active)
        budget = BUSY_PREFILL_SLICE if busy else prefilling[0].lease.session.chunk
        first = self._turn % len(prefilling)
        self._turn += 1
        jobs, pieces = [], []
        for job in prefilling[first:] + prefilling[:first]:
            session = job.lease.session
            size = min(budget, session.chunk - len(session.tokens) % session.chunk)  # up to its next chunk end
            if job.save_stops:
                size = min(size, job.save_stops[0][0] - len(session.tokens))
            if size <= 0:
                break
            piece, job.pending = job.pending[:size], job.pending[size:]
            jobs.append(job)
            pieces.append(piece)
            budget -= len(piece)
        lengths = [len(job.lease.session.tokens) for job in jobs]
        start = time.perf_counter()
        try:
            prefill_batch([job.lease.session for job in jobs], pieces)
        except Exception as exc:
            if len(jobs) == 1:
                self._fail(jobs[0], exc)
                return
            log.warning("batched prefill of %d requests failed (%s); prefilling each alone", len(jobs), exc)
            jobs, pieces = self._prefill_alone(jobs, pieces, lengths)
        seconds = time.perf_counter() - start
        tokens = sum(map(len, pieces))
        self.metrics.inc("dwarfstar_prefill_tokens_total", tokens)
        self.metrics.inc("dwarfstar_prefill_seconds_total", seconds)
        self.metrics.set("dwarfstar_prefill_tokens_per_second", tokens / max(seconds, 1e-9))
        for job in jobs:
            try:
                session = job.lease.session
                if job.save_stops and len(session.tokens) == job.save_stops[0][0]:
                    self.disk.save(job.lease.live, job.save_stops.pop(0)[1])
                if not job.pending:
                    self._start_decode(job)
            except Exception as exc:
                self._fail(job, exc)

    def _prefill_alone(
        self, jobs: list[Job], pieces: list[list[int]], lengths: list[int]
    ) -> tuple[list[Job], list[list[int]]]:
        """After a failed batched prefill: each request rebuilt as it was before the call, then given
        its piece alone; those that fail on their own fail. Returns the others and their pieces."""
        kept: tuple[list[Job], list[list[int]]] = ([], [])
        for job, piece, length in zip(jobs, pieces, lengths, strict=True):
            try:
                self._rebuild(job.lease.session, length)
                prefill_batch([job.lease.session], [piece])
            except Exception as exc:
                self._fail(job, exc)
                continue
            kept[0].append(job)
            kept[1].append(piece)
        return kept

    @staticmethod
    def _rebuild(session: Session, length: int) -> None:
        """The session's state as it was at `length` tokens, recomputed from its nearest checkpoint
        below (a forward that raised midway may have written some layers' rows)."""
        if length == 0:
            session.reset()
            return
        last = session.tokens[length - 1]
        session.truncate(length - 1)
        session.prefill([last])

    def _decode_step(self) -> None:
        stepping: list[Job] = []
        tokens: list[int] = []
        closing: list[tuple[Job, str]] = []  # finished, but their last token still goes into the KV
        decoding = [job for job in self._active if job.phase == "decode" and job.spec_pending is None]
        speculating = [job for job in self._active if job.phase == "decode" and job.spec_pending is not None]
        if speculating:
            self._speculative_step(speculating)
        if not decoding:
            return
        for job, token in self._sample(decoding):
            session = job.lease.session
            try:
                job.usage.completion_tokens += 1
                self.metrics.inc("dwarfstar_generated_tokens_total")
                if token != self.tokenizer.eos_id:
                    for event in job.decoder.push(token):
                        job.emit(event)
                reason = self._finish_reason(job, token)
                # A tool-call turn's last token is run too, so the live KV, and a disk file saved from
                # it, hold the whole DSML block the client sends back (with its id, for exact replay).
                if reason is None and job.spec is not None:
                    job.spec_pending = token  # speculation runs it, with its drafts, from the next turn
                elif reason is None or (reason == "tool_calls" and len(session.tokens) < session.ctx):
                    stepping.append(job)
                    tokens.append(token)
                    if reason is not None:
                        closing.append((job, reason))
                else:
                    self._finish(job, reason)
            except Exception as exc:
                self._fail(job, exc)
        if not stepping:
            return
        start = time.perf_counter()
        lengths = [len(job.lease.session.tokens) for job in stepping]
        try:
            # the step draws each request's next token with it (inside the captured step on a GPU)
            drawn = decode_batch([job.lease.session for job in stepping], tokens, [job.sampler for job in stepping])
            for job, token in zip(stepping, drawn, strict=True):
                job.drawn = token
        except Exception as exc:
            log.warning("batched decode of %d requests failed (%s); stepping each alone", len(stepping), exc)
            kept = self._step_alone(stepping, tokens, lengths)
            closing = [(job, reason) for job, reason in closing if job in kept]
            stepping = kept
        seconds = time.perf_counter() - start
        self.metrics.inc("dwarfstar_decode_seconds_total", seconds)
        self.metrics.inc("dwarfstar_decode_steps_total")
        self.metrics.set("dwarfstar_decode_tokens_per_second", len(stepping) / max(seconds, 1e-9))
        self.metrics.raise_to("dwarfstar_decode_batch_max", len(stepping))
        if len(stepping) > 1:
            self.metrics.inc("dwarfstar_batched_decode_steps_total")
        for job, reason in closing:
            try:
                self._finish(job, reason)
            except Exception as exc:
                self._fail(job, exc)
        if self.disk is not None:
            for job in stepping:
                if job.phase == "decode" and self.disk.continued_due(job.lease.live, job.decoder.in_tool_call):
                    self.disk.save(job.lease.live, SaveReason.CONTINUED)

    def _speculative_step(self, jobs: list[Job]) -> None:
        """One draft-verify round for every speculating request, their target passes batched: each
        emits its accepted drafts and one more token, pushed one by one as plain decoding pushes its
        sampled token, and cut at the first that ends the request."""
        reasons: dict[int, str | None] = {}

        def ends_for(job: Job) -> Callable[[int], bool]:
            length = len(job.lease.session.tokens)  # before the pass: the pending token not yet in

            def ends(token: int) -> bool:
                nonlocal length
                length += 1  # the tokens before this one, as plain decoding would hold them
                job.usage.completion_tokens += 1
                self.metrics.inc("dwarfstar_generated_tokens_total")
                if token != self.tokenizer.eos_id:
                    for event in job.decoder.push(token):
                        job.emit(event)
                reasons[job.id] = self._finish_reason(job, token, length)
                return reasons[job.id] is not None

            return ends

        sessions = [job.lease.session for job in jobs]
        rooms = [
            min(job.request.max_tokens - job.usage.completion_tokens, s.ctx - len(s.tokens))
            for job, s in zip(jobs, sessions, strict=True)
        ]
        before = [(sum(job.spec.stats.drafted), sum(job.spec.stats.accepted)) for job in jobs]
        start = time.perf_counter()
        try:
            emitted = step_batch(
                [job.spec for job in jobs],
                [job.spec_pending for job in jobs],
                [job.sampler for job in jobs],
                rooms,
                [ends_for(job) for job in jobs],
            )
        except Exception as exc:  # a pass that raised may have written some layers: these states are gone
            for job in jobs:
                self._fail(job, exc)
            return
        seconds = time.perf_counter() - start
        self.metrics.inc("dwarfstar_decode_seconds_total", seconds)
        self.metrics.inc("dwarfstar_decode_steps_total")
        self.metrics.set("dwarfstar_decode_tokens_per_second", sum(map(len, emitted)) / max(seconds, 1e-9))
        self.metrics.raise_to("dwarfstar_decode_batch_max", len(jobs))
        if len(jobs) > 1:
            self.metrics.inc("dwarfstar_batched_decode_steps_total")
        self.metrics.inc("dwarfstar_speculative_steps_total", len(jobs))
        for job, emit, (drafted, accepted) in zip(jobs, emitted, before, strict=True):
            drafted, accepted = sum(job.spec.stats.drafted) - drafted, sum(job.spec.stats.accepted) - accepted
            job.usage.draft_tokens += drafted
            job.usage.accepted_draft_tokens += accepted
            self.metrics.inc("dwarfstar_draft_tokens_total", drafted)
            self.metrics.inc("dwarfstar_accepted_draft_tokens_total", accepted)
            reason, session = reasons.get(job.id), job.lease.session
            try:
                if reason is None:
                    job.spec_pending = emit[-1]
                    continue
                if reason == "tool_calls" and len(session.tokens) < session.ctx:
                    job.spec.append(emit[-1])  # the DSML block's last token stays in the KV, as in plain decoding
                self._finish(job, reason)
            except Exception as exc:
                self._fail(job, exc)

    def _sample(self, jobs: list[Job]) -> list[tuple[Job, int]]:
        """The next token of every decoding request, drawn together: one host sync per step, not one each.

        If the batch raises, each request is drawn alone, and only those that raise again fail."""
        try:
            return list(zip(jobs, self._sample_rows(jobs), strict=True))
        except Exception:
            log.warning("batched sampling of %d requests failed; sampling each alone", len(jobs))
        drawn = []
        for job in jobs:
            try:
                drawn.append((job, self._sample_rows([job])[0]))
            except Exception as exc:
                self._fail(job, exc)
        return drawn

    def _sample_rows(self, jobs: list[Job]) -> list[int]:
        """Each request's next token: drawn by its last decode step, else (after a prefill, or a step
        stepped alone) now from its logits, all of those in one draw."""
        fresh = [job for job in jobs if job.drawn is None]
        new = iter(sample_next([job.lease.session for job in fresh], [job.sampler for job in fresh]))
        tokens = [job.drawn if job.drawn is not None else next(new) for job in jobs]
        for job in jobs:
            job.drawn = None
        return tokens

    def _step_alone(self, jobs: list[Job], tokens: list[int], lengths: list[int]) -> list[Job]:
        """After a failed batched step: each request's state rebuilt as it was before the step (a forward
        that raised midway may have written some layers' rows), then stepped alone. The requests that
        fail on their own fail; the others go on. Returns those."""
        kept = []
        for job, token, length in zip(jobs, tokens, lengths, strict=True):
            session = job.lease.session
            try:
                self._rebuild(session, length)  # from the nearest chunk checkpoint, which the step never touched
                decode_batch([session], [token])
            except Exception as exc:
                self._fail(job, exc)
                continue
            kept.append(job)
        return kept

    def _finish_reason(self, job: Job, token: int, length: int | None = None) -> str | None:
        """Why `token` ends the request, or None; `length`: the tokens before it (default: the session's)."""
        decoder, session = job.decoder, job.lease.session
        length = len(session.tokens) if length is None else length
        if token == self.tokenizer.eos_id or decoder.stop_sequence is not None:
            return "stop"
        if job.request.tools and decoder.tool_block_closed:
            return "tool_calls"
        if job.usage.completion_tokens >= job.request.max_tokens or length >= session.ctx:
            return "length"
        return None

    # -- ends of a job -----------------------------------------------------------------------------------
    def _finish(self, job: Job, reason: str) -> None:
        for event in job.decoder.finish(ended=reason == "stop"):
            job.emit(event)
        completion = job.decoder.completion
        tool_ids: list[str] = []
        if completion is not None and completion.tool_calls:
            tool_ids = job.decoder.tool_ids[: len(completion.tool_calls)]
            reason = "length" if reason == "length" else "tool_calls"
            self.tool_memory.remember(tool_ids, completion.raw_dsml, completion.reasoning)
            job.lease.live.tool_ids.update(tool_ids)
        job.usage.reasoning_tokens = job.decoder.reasoning_tokens
        self.metrics.inc("dwarfstar_finished_requests_total", reason=reason)
        self._write_trace(job, finish=reason, tool_ids=tool_ids)  # before the client can see the end
        self._release(job)
        job.emit(Finished(reason, job.usage, completion, job.decoder.text, tool_ids, job.decoder.stop_sequence))

    def _cancel(self, job: Job) -> None:
        self.metrics.inc("dwarfstar_cancelled_requests_total", phase=job.phase)
        self._write_trace(job, finish="cancelled")
        self._release(job)

    def _fail(self, job: Job, exc: Exception) -> None:
        log.exception("request %d failed", job.id, exc_info=exc)
        self.metrics.inc("dwarfstar_failed_requests_total")
        self._write_trace(job, finish="error", error=str(exc))
        if job.lease is not None:
            self.pool.discard(job.lease.live)  # the state may be half-updated
        if job in self._active:
            self._active.remove(job)
        job.phase = "done"
        job.emit(Failed(f"generation failed: {exc}", job.usage))

    def _release(self, job: Job) -> None:
        job.phase = "done"
        self._active.remove(job)
        self.pool.release(job.lease, prompt_len=job.usage.prompt_tokens)

    def _update_gauges(self) -> None:
        with self._cond:
            self.metrics.set("dwarfstar_queue_depth", len(self._waiting))
        self.metrics.set("dwarfstar_active_requests", len(self._active))
        self.metrics.set("dwarfstar_live_sessions", len(self.pool.live))
        self.metrics.set("dwarfstar_session_bytes", self.pool.nbytes())

    def _write_trace(self, job: Job, *, finish: str, **extra: Any) -> None:
        if self.trace is None:
            return
        request, lease, decoder = job.request, job.lease, job.decoder
        completion = decoder.completion if decoder is not None else None
        self.trace.write(
            {
                "job": job.id,
                "api": request.api,
                "request": request.trace_body,
                "prompt": request.prompt.text if request.prompt is not None else None,
                "cache": lease.source if lease is not None else None,
                "match": lease.plan.match if lease is not None else None,
                "prompt_tokens": job.usage.prompt_tokens,
                "cached_tokens": job.usage.cached_tokens,
                "prefilled_tokens": job.usage.prefilled_tokens,
                "completion_tokens": job.usage.completion_tokens,
                "draft_tokens": job.usage.draft_tokens,
                "accepted_draft_tokens": job.usage.accepted_draft_tokens,
                "finish": finish,
                "generated": decoder.text if decoder is not None else "",
                "dsml": completion.raw_dsml if completion is not None else None,
                "replayed_tool_ids": job.replayed,
                "problems": decoder.problems if decoder is not None else [],
                # the expert cache since the start (shared by every request in a batch)
                **({"experts": expert_summary(self.experts)} if self.experts is not None else {}),
                **extra,
            }
        )
