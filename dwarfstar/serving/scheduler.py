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
The event loop never runs model code: handlers submit a `Job` (`jobs.py`) and read its events from an
asyncio queue the worker fills. The waiting queue is bounded; `submit` refuses beyond it (HTTP 429).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from dwarfstar.engine.images import ImageEncoder
from dwarfstar.experts.store import ExpertStore
from dwarfstar.experts.telemetry import summary as expert_summary
from dwarfstar.kvcache.kvpolicy import SaveReason
from dwarfstar.model.image_spans import ImageSpan, cut_outside
from dwarfstar.prompt.dsml_guard import ToolGuard
from dwarfstar.sampling import Sampler
from dwarfstar.serving.disk import DiskCache
from dwarfstar.serving.generation import Failed, Finished, GenerationRequest, Started, Usage
from dwarfstar.serving.jobs import KV, Decoding, DiskRead, Drafting, Job, Phase
from dwarfstar.serving.logprobs import event_of
from dwarfstar.serving.metrics import Metric, Metrics
from dwarfstar.serving.output import OutputDecoder
from dwarfstar.serving.pool import Lease, SessionPool
from dwarfstar.serving.replay import ToolMemory
from dwarfstar.serving.request_trace import Trace
from dwarfstar.session.loopguard import Repetition
from dwarfstar.session.session import decode_batch, prefill_batch, sample_next
from dwarfstar.speculative.decode import MTPSpeculation, step_batch
from dwarfstar.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

BUSY_PREFILL_SLICE = 512  # prompt tokens per loop turn while other requests are decoding


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    pass


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
        images: ImageEncoder | None = None,
    ) -> None:
        self.pool, self.tokenizer, self.metrics, self.speculation = pool, tokenizer, metrics, speculation
        self.images = images  # the vision encoder (serve --vision), run here: it shares the device
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
            self.metrics.set(Metric.QUEUE_DEPTH, len(self._waiting))
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
            for job in dropped:
                job.end()
            if dropped:
                self.metrics.inc(Metric.CANCELLED_REQUESTS_TOTAL, len(dropped), phase=Phase.QUEUED.value)
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
            job.end()
            job.emit(Failed("server shutting down", job.usage))
        self.pool.save_all()

    @contextmanager
    def _failing(self, job: Job) -> Iterator[None]:
        """Runs one request's part of a step: what it raises fails that request alone."""
        try:
            yield
        except Exception as exc:
            self._fail(job, exc)

    def _admissible(self) -> bool:
        """A queued request can be looked at now: there is one, and it waits for no disk read."""
        if not self._waiting:
            return False
        read = self._waiting[0].disk_read
        return read is None or read.future.done()

    def _wake(self, _: Future) -> None:
        with self._cond:
            self._cond.notify()

    def _start_disk_read(self, job: Job) -> None:
        """Hand the head request's disk-cache lookup to the reader thread, when its admission would make one."""
        request = job.request
        better_than = self.pool.disk_lookup_due(request.prompt, request.prompt_ids, request.steering)
        if better_than is not None:
            key = self.disk.key(request.prompt, request.prompt_ids)
            job.disk_read = DiskRead(better_than, self.disk.restore_async(key, better_than))
            job.disk_read.future.add_done_callback(self._wake)

    def _admit(self) -> None:
        while True:
            with self._cond:
                if not self._waiting:
                    return
                job = self._waiting[0]  # only this thread removes jobs, so it stays the head
            request = job.request
            try:
                if self.disk is not None and job.disk_read is None:
                    self._start_disk_read(job)
                if job.disk_read is not None and not job.disk_read.future.done():
                    return  # the file is being read; the running requests go on meanwhile
                looked_up = job.disk_read.lookup() if job.disk_read is not None else None
                if job.images is None:
                    job.images = self._encode(request)
                lease = self.pool.acquire(request.prompt, request.prompt_ids, request.steering, looked_up, job.images)
            except Exception as exc:
                with self._cond:
                    self._waiting.popleft()
                self._fail(job, exc)
                continue
            if lease is None:
                return
            with self._cond:
                self._waiting.popleft()
            with self._failing(job):
                self._start(job, lease)

    def _encode(self, request: GenerationRequest) -> list[ImageSpan]:
        """The rows of each image block of the request: the encoder's, or its cache's (by the image's digest)."""
        if not request.images:
            return []
        encoded = self.images.encoded
        spans = [self.images.span(image) for image in request.images]
        self.metrics.inc(Metric.IMAGES_TOTAL, len(spans))
        self.metrics.inc(Metric.IMAGES_ENCODED_TOTAL, self.images.encoded - encoded)
        return spans

    def _start(self, job: Job, lease: Lease) -> None:
        keep = lease.plan.keep
        job.admit(KV(lease, lease.plan.suffix, lease.plan.images))
        job.usage.cached_tokens = keep
        lease.live.tool_ids.update(job.replayed)
        if self.disk is not None:
            stops = self.disk.prefill_stops(lease.live, job.request.prompt_ids, keep)
            # a pass never stops inside an image block, so neither does a save
            job.kv.save_stops = [stop for stop in stops if cut_outside(job.images, stop[0]) == stop[0]]
        self._active.append(job)
        self.metrics.inc(Metric.CACHE_LOOKUPS_TOTAL, source=lease.source)
        self.metrics.inc(Metric.PROMPT_TOKENS_TOTAL, job.usage.prompt_tokens)
        self.metrics.inc(Metric.CACHED_TOKENS_TOTAL, job.usage.cached_tokens)
        job.emit(Started(Usage(**vars(job.usage))))
        if not job.kv.pending:
            self._start_decode(job)

    def _start_decode(self, job: Job) -> None:
        sampling = job.request.sampling
        decoding = Decoding(Sampler(sampling), OutputDecoder(self.tokenizer, job.request))
        # an accepted draft has no draw of its own, so a request that asks for logprobs is not speculated
        # (the prompt, its image blocks included, is in the KV: the draft follows from its end)
        speculate = self.speculation is not None and sampling.logprobs is None
        drafting = Drafting(self.speculation.start(job.session)) if speculate else None
        if job.request.loop_guard is not None:
            decoding.repetition = Repetition(job.request.loop_guard)
        if job.request.tool_grammar is not None:
            decoding.guard = ToolGuard(job.request.tool_grammar, self.tokenizer, thinking=job.request.thinking)
        job.start_decoding(decoding, drafting)
        if job.request.halted:  # the loop guard stops a repeated tool call before the turn is generated
            self._finish(job, "repetition")

    def _prefill_step(self) -> None:
        """One pass over the waiting prompts: a budget of tokens (a chunk; a slice while others decode,
        so their next token is not held up long) shared out in turn, every piece in one batched call."""
        prefilling = [job for job in self._active if job.phase is Phase.PREFILL]
        if not prefilling:
            return
        busy = any(job.phase is Phase.DECODE for job in self._active)
        budget = BUSY_PREFILL_SLICE if busy else prefilling[0].session.chunk
        first = self._turn % len(prefilling)
        self._turn += 1
        jobs, pieces, images = [], [], []
        for job in prefilling[first:] + prefilling[:first]:
            piece, blocks = job.kv.take(budget)  # up to its next chunk end
            if not piece:
                break
            jobs.append(job)
            pieces.append(piece)
            images.append(blocks)
            budget -= len(piece)
        lengths = [len(job.session.tokens) for job in jobs]
        start = time.perf_counter()
        try:
            prefill_batch([job.session for job in jobs], pieces, images)
        except Exception as exc:
            if len(jobs) == 1:
                self._fail(jobs[0], exc)
                return
            log.warning("batched prefill of %d requests failed (%s); prefilling each alone", len(jobs), exc)
            jobs, pieces = self._prefill_alone(jobs, pieces, images, lengths)
        seconds = time.perf_counter() - start
        tokens = sum(map(len, pieces))
        self.metrics.inc(Metric.PREFILL_TOKENS_TOTAL, tokens)
        self.metrics.inc(Metric.PREFILL_SECONDS_TOTAL, seconds)
        self.metrics.set(Metric.PREFILL_TOKENS_PER_SECOND, tokens / max(seconds, 1e-9))
        for job in jobs:
            with self._failing(job):
                kv = job.kv
                if kv.save_stops and len(job.session.tokens) == kv.save_stops[0][0]:
                    self.disk.save(kv.lease.live, kv.save_stops.pop(0)[1])
                if not kv.pending:
                    self._start_decode(job)

    def _prefill_alone(
        self, jobs: list[Job], pieces: list[list[int]], images: list[list[ImageSpan]], lengths: list[int]
    ) -> tuple[list[Job], list[list[int]]]:
        """After a failed batched prefill: each request rebuilt as it was before the call, then given
        its piece (and its image blocks) alone; those that fail on their own fail. Returns the others
        and their pieces."""
        kept: tuple[list[Job], list[list[int]]] = ([], [])
        for job, piece, blocks, length in zip(jobs, pieces, images, lengths, strict=True):
            try:
                job.session.rebuild(length)
                prefill_batch([job.session], [piece], [blocks])
            except Exception as exc:
                self._fail(job, exc)
                continue
            kept[0].append(job)
            kept[1].append(piece)
        return kept

    def _decode_step(self) -> None:
        """One token for every plain-decoding request, one draft-verify round for every speculating one."""
        decoding = [job for job in self._active if job.phase is Phase.DECODE]
        plain = [job for job in decoding if not job.speculating]
        speculating = [job for job in decoding if job.speculating]
        if speculating:
            self._speculative_step(speculating)
        if plain:
            self._plain_step(plain)

    def _plain_step(self, jobs: list[Job]) -> None:
        """Each request's next token emitted, and run in one batched forward (which draws the one after)."""
        stepping: list[Job] = []
        tokens: list[int] = []
        closing: list[tuple[Job, str]] = []  # finished, but their last token still goes into the KV
        for job, token in self._sample(jobs):
            with self._failing(job):
                reason = self._emit_token(job, token)
                if reason is None and job.drafting is not None:
                    job.drafting.pending = token  # speculation runs it, with its drafts, from the next turn
                elif reason is None or self._keeps_last(job, reason):
                    stepping.append(job)
                    tokens.append(token)
                    if reason is not None:
                        closing.append((job, reason))
                else:
                    self._finish(job, reason)
        if not stepping:
            return
        start = time.perf_counter()
        lengths = [len(job.session.tokens) for job in stepping]
        try:
            # the step draws each request's next token with it (inside the captured step on a GPU)
            drawn = decode_batch([job.session for job in stepping], tokens, [job.decoding.sampler for job in stepping])
            for job, token in zip(stepping, drawn, strict=True):
                job.decoding.drawn = token
        except Exception as exc:
            log.warning("batched decode of %d requests failed (%s); stepping each alone", len(stepping), exc)
            stepping = self._step_alone(stepping, tokens, lengths)
            closing = [(job, reason) for job, reason in closing if job in stepping]
        self._count_step(len(stepping), len(stepping), time.perf_counter() - start)
        for job, reason in closing:
            with self._failing(job):
                self._finish(job, reason)
        if self.disk is not None:
            for job in stepping:
                live = job.kv.lease.live
                if job.phase is Phase.DECODE and self.disk.continued_due(live, job.decoding.decoder.in_tool_call):
                    self.disk.save(live, SaveReason.CONTINUED)

    def _speculative_step(self, jobs: list[Job]) -> None:
        """One draft-verify round for every speculating request, their target passes batched: each
        emits its accepted drafts and one more token, pushed one by one as plain decoding pushes its
        sampled token, and cut at the first that ends the request."""
        reasons: dict[int, str | None] = {}

        def ends_for(job: Job) -> Callable[[int], bool]:
            length = len(job.session.tokens)  # before the pass: the pending token not yet in

            def ends(token: int) -> bool:
                nonlocal length
                length += 1  # the tokens before this one, as plain decoding would hold them
                reasons[job.id] = self._emit_token(job, token, length)
                return reasons[job.id] is not None

            return ends

        rooms = [
            min(job.request.max_tokens - job.usage.completion_tokens, job.session.ctx - len(job.session.tokens))
            for job in jobs
        ]
        before = [job.drafting.counts() for job in jobs]
        start = time.perf_counter()
        try:
            emitted = step_batch(
                [job.drafting.speculator for job in jobs],
                [job.drafting.pending for job in jobs],
                [job.decoding.sampler for job in jobs],
                rooms,
                [ends_for(job) for job in jobs],
                [job.decoding.guard for job in jobs],
            )
        except Exception as exc:  # a pass that raised may have written some layers: these states are gone
            for job in jobs:
                self._fail(job, exc)
            return
        self._count_step(len(jobs), sum(map(len, emitted)), time.perf_counter() - start)
        self.metrics.inc(Metric.SPECULATIVE_STEPS_TOTAL, len(jobs))
        for job, emit, (drafted, accepted) in zip(jobs, emitted, before, strict=True):
            now_drafted, now_accepted = job.drafting.counts()
            drafted, accepted = now_drafted - drafted, now_accepted - accepted
            job.usage.draft_tokens += drafted
            job.usage.accepted_draft_tokens += accepted
            self.metrics.inc(Metric.DRAFT_TOKENS_TOTAL, drafted)
            self.metrics.inc(Metric.ACCEPTED_DRAFT_TOKENS_TOTAL, accepted)
            reason = reasons.get(job.id)
            with self._failing(job):
                if reason is None:
                    job.drafting.pending = emit[-1]
                    continue
                if self._keeps_last(job, reason):
                    job.drafting.speculator.append(emit[-1])  # into the KV, as plain decoding runs it
                self._finish(job, reason)

    def _emit_token(self, job: Job, token: int, length: int | None = None) -> str | None:
        """A generated token: counted, its text sent to the client, and why it ends the request (None:
        it does not). `length`: the tokens before it (default: the session's)."""
        job.usage.completion_tokens += 1
        self.metrics.inc(Metric.GENERATED_TOKENS_TOTAL)
        decoder, session = job.decoding.decoder, job.session
        if job.decoding.guard is not None:
            job.decoding.guard.push(token)
        if token != self.tokenizer.eos_id:
            drawn = job.decoding.sampler.logprobs  # the draw of this token (a request that asks)
            if drawn is not None:
                entry = event_of(self.tokenizer, drawn)
                job.decoding.logprobs.append(entry)
                job.emit(entry)
            for event in decoder.push(token):
                job.emit(event)
        length = len(session.tokens) if length is None else length
        if token == self.tokenizer.eos_id or decoder.stop_sequence is not None:
            return "stop"
        if job.request.tools and decoder.tool_block_closed:
            return "tool_calls"
        if job.decoding.repetition is not None and job.decoding.repetition.push(token):
            return "repetition"
        if job.usage.completion_tokens >= job.request.max_tokens or length >= session.ctx:
            return "length"
        return None

    @staticmethod
    def _keeps_last(job: Job, reason: str) -> bool:
        """A tool-call turn's last token is run too when there is room, so the live KV, and a disk file
        saved from it, hold the whole DSML block the client sends back (with its id, for exact replay)."""
        return reason == "tool_calls" and len(job.session.tokens) < job.session.ctx

    def _count_step(self, requests: int, tokens: int, seconds: float) -> None:
        """A decode step's figures: `requests` advanced together, `tokens` emitted in all."""
        self.metrics.inc(Metric.DECODE_SECONDS_TOTAL, seconds)
        self.metrics.inc(Metric.DECODE_STEPS_TOTAL)
        self.metrics.set(Metric.DECODE_TOKENS_PER_SECOND, tokens / max(seconds, 1e-9))
        self.metrics.raise_to(Metric.DECODE_BATCH_MAX, requests)
        if requests > 1:
            self.metrics.inc(Metric.BATCHED_DECODE_STEPS_TOTAL)

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
        fresh = [job for job in jobs if job.decoding.drawn is None]
        new = iter(sample_next([job.session for job in fresh], [job.decoding.sampler for job in fresh]))
        tokens = [job.decoding.drawn if job.decoding.drawn is not None else next(new) for job in jobs]
        for n, job in enumerate(jobs):
            job.decoding.drawn = None
            if job.decoding.guard is not None:
                tokens[n] = job.decoding.guard.choose(tokens[n], job.session.logits, job.decoding.sampler)
        return tokens

    def _step_alone(self, jobs: list[Job], tokens: list[int], lengths: list[int]) -> list[Job]:
        """After a failed batched step: each request's state rebuilt as it was before the step (a forward
        that raised midway may have written some layers' rows), then stepped alone. The requests that
        fail on their own fail; the others go on. Returns those."""
        kept = []
        for job, token, length in zip(jobs, tokens, lengths, strict=True):
            try:
                job.session.rebuild(length)  # from the nearest chunk checkpoint, which the step never touched
                decode_batch([job.session], [token])
            except Exception as exc:
                self._fail(job, exc)
                continue
            kept.append(job)
        return kept

    # -- ends of a job -----------------------------------------------------------------------------------
    def _finish(self, job: Job, reason: str) -> None:
        decoder = job.decoding.decoder
        for event in decoder.finish(ended=reason == "stop"):
            job.emit(event)
        completion = decoder.completion
        tool_ids: list[str] = []
        if completion is not None and completion.tool_calls:
            tool_ids = decoder.tool_ids[: len(completion.tool_calls)]
            reason = "length" if reason == "length" else "tool_calls"
            self.tool_memory.remember(tool_ids, completion.raw_dsml, completion.reasoning)
            job.kv.lease.live.tool_ids.update(tool_ids)
        elif completion is not None and completion.invalid_dsml is not None:  # shown as text (output.py)
            self.metrics.inc(Metric.INVALID_TOOL_CALLS_TOTAL)
        job.usage.reasoning_tokens = decoder.reasoning_tokens
        self.metrics.inc(Metric.FINISHED_REQUESTS_TOTAL, reason=reason)
        if reason == "repetition":
            self.metrics.inc(Metric.LOOP_GUARD_TOTAL, kind="tool_stop" if job.request.halted else "repetition")
        self._write_trace(job, finish=reason, tool_ids=tool_ids)  # before the client can see the end
        self._release(job)
        logprobs = job.decoding.logprobs if job.request.sampling.logprobs is not None else None
        job.emit(Finished(reason, job.usage, completion, decoder.text, tool_ids, decoder.stop_sequence, logprobs))

    def _cancel(self, job: Job) -> None:
        self.metrics.inc(Metric.CANCELLED_REQUESTS_TOTAL, phase=job.phase.value)
        self._write_trace(job, finish="cancelled")
        self._release(job)

    def _fail(self, job: Job, exc: Exception) -> None:
        log.exception("request %d failed", job.id, exc_info=exc)
        self.metrics.inc(Metric.FAILED_REQUESTS_TOTAL)
        self._write_trace(job, finish="error", error=str(exc))
        if job.kv is not None:
            self.pool.discard(job.kv.lease.live)  # the state may be half-updated
        if job in self._active:
            self._active.remove(job)
        job.end()
        job.emit(Failed(f"generation failed: {exc}", job.usage))

    def _release(self, job: Job) -> None:
        self._active.remove(job)
        self.pool.release(job.kv.lease, prompt_len=job.usage.prompt_tokens)
        job.end()

    def _update_gauges(self) -> None:
        with self._cond:
            self.metrics.set(Metric.QUEUE_DEPTH, len(self._waiting))
        self.metrics.set(Metric.ACTIVE_REQUESTS, len(self._active))
        self.metrics.set(Metric.LIVE_SESSIONS, len(self.pool.live))
        self.metrics.set(Metric.SESSION_BYTES, self.pool.nbytes())

    def _write_trace(self, job: Job, *, finish: str, **extra: Any) -> None:
        if self.trace is None:
            return
        record = job.trace_record(finish)
        if self.experts is not None:  # the expert cache since the start (shared by every request in a batch)
            record["experts"] = expert_summary(self.experts)
        self.trace.write(record | extra)
