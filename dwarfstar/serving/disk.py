"""The disk KV cache (`--kv-disk-dir`) as the server uses it: ds4's save points around live sessions.

Saves (DS4_SURFACE §4.3, policy in `kvcache/kvpolicy.py`):
* cold: a request that found nothing to reuse stops its prefill at the stable system + tools prefix
  (or its aligned length) and saves there, so the next conversation with that prefix starts warm;
* continued: at every multiple of the continued interval, in prefill and in decode (not inside a
  tool call, whose bytes the client will send back re-rendered);
* evict: a live session about to be overwritten by another conversation, or dropped for the memory
  budget;
* shutdown: every live session when the server stops.
A request that finds no useful prefix in memory looks here (longest rendered-text prefix) before
prefilling cold. Each file carries the tool-call ids of its conversation with their sampled DSML,
and a request replaying a tool call the memory no longer knows (after a restart) finds it here.

Saves are written by a writer thread from a copy of the state taken when the save is asked for, so
the engine thread never waits for the disk; a lookup that finds its best checkpoint still queued
rebuilds the state from that copy. Restores run on a reader thread (`restore_async`): it reads,
checks and decodes the file, and the engine thread only installs the state, so the other streams
go on decoding while a long checkpoint loads. The store is used from the engine worker, the writer,
the reader and request threads, so every use of its index holds one lock (the file writes
themselves run outside it).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dwarfstar.engine.load import Engine
from dwarfstar.kvcache import kvfile
from dwarfstar.kvcache.kvfile import KVFileError, ModelIdentity
from dwarfstar.kvcache.kvpolicy import MIB, ContinuedSchedule, KVCacheOptions, SaveReason, cold_save_point
from dwarfstar.kvcache.kvstore import KVStore, StateImage, tokens_key
from dwarfstar.kvcache.payloads import AnyState
from dwarfstar.prompt.render import Prompt
from dwarfstar.serving.pool import LiveSession
from dwarfstar.serving.replay import ToolMemory

log = logging.getLogger(__name__)


@dataclass(eq=False)
class QueuedSave:
    image: StateImage
    reason: SaveReason
    tool_map: dict[str, str]


class DiskCache:
    def __init__(self, store: KVStore, tool_memory: ToolMemory) -> None:
        self.store, self.options, self.tool_memory = store, store.options, tool_memory
        self._lock = threading.Lock()  # the store: its directory index, evictions, lookups
        self._schedules: weakref.WeakKeyDictionary[LiveSession, ContinuedSchedule] = weakref.WeakKeyDictionary()
        self._writes: queue.Queue[QueuedSave | None] = queue.Queue()
        self._queued: list[QueuedSave] = []  # not yet on disk, in order; a lookup may serve one
        self._queued_lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="dwarfstar-kv-writer", daemon=True)
        self._writer.start()
        # one reader: restores are rare and each reads the disk flat out
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dwarfstar-kv-reader")

    @classmethod
    def open(
        cls,
        directory: Path,
        *,
        space_mb: int,
        min_tokens: int,
        engine: Engine,
        ctx: int,
        chunk: int,
        memory: ToolMemory,
    ) -> DiskCache:
        options = KVCacheOptions(
            min_tokens=min_tokens, cold_max_tokens=max(min_tokens, 30000), budget_bytes=space_mb * MIB
        )
        store = KVStore(
            directory,
            engine.backend.args,
            ModelIdentity.of(engine.model),
            ctx,
            chunk,
            render_key=functools.partial(tokens_key, engine.tokenizer.decode_bytes, engine.tokenizer.vocab_size),
            options=options,
            new_state=engine.backend.new_state,
        )
        return cls(store, memory)

    def _schedule(self, live: LiveSession) -> ContinuedSchedule:
        return self._schedules.setdefault(live, ContinuedSchedule(self.options))

    # -- saving ----------------------------------------------------------------------------------------
    def save(self, live: LiveSession, reason: SaveReason) -> None:
        session = live.session
        if len(session.tokens) < self.options.min_tokens or live.steering is not None:
            return  # files are keyed by text alone: they hold only unsteered states
        blocks = {call_id: dsml for call_id in live.tool_ids if (dsml := self.tool_memory.get(call_id)) is not None}
        # The engine thread only copies the state (memory speed); choosing the file, evicting,
        # writing and fsyncing run on the writer thread, so the other streams go on meanwhile.
        image = self.store.freeze(session.state)
        if reason is SaveReason.EVICT:
            self._schedules.pop(live, None)  # the session is about to hold another conversation, or none
        elif image is not None:
            self._schedule(live).note_store(len(session.tokens))
        if image is None:
            return
        save = QueuedSave(image, reason, blocks)
        with self._queued_lock:
            self._queued.append(save)
        self._writes.put(save)

    def _write_loop(self) -> None:
        while (save := self._writes.get()) is not None:
            try:
                with self._lock:
                    planned = self.store.plan_save(save.image, save.reason, tool_map=save.tool_map)
                if planned is not None:
                    self.store.write(planned)  # outside the lock: lookups go on during a long write
            except Exception:  # a save is an optimisation: its failure must not stop the next ones
                log.exception("kv cache save of %d tokens failed", len(save.image.tokens))
            finally:
                with self._queued_lock:
                    self._queued.remove(save)
                self._writes.task_done()
        self._writes.task_done()

    def flush(self) -> None:
        """Wait until every save asked for so far is on disk (or refused)."""
        self._writes.join()

    def close(self) -> None:
        """Finish the queued saves and restores and stop their threads (server shutdown)."""
        self._reader.shutdown(wait=True)
        self._writes.put(None)
        self._writer.join()

    def prefill_stops(self, live: LiveSession, prompt_ids: list[int], cached: int) -> list[tuple[int, SaveReason]]:
        """Positions inside this prefill where the session should be saved, in order."""
        stops: dict[int, SaveReason] = {}
        session = live.session
        frontier = self._schedule(live).next_frontier(len(session.tokens))
        while 0 < frontier < len(prompt_ids):
            stops[frontier] = SaveReason.CONTINUED
            frontier += self.options.continued_step
        cold = cold_save_point(self.options, prompt_ids, cached)
        if cold > len(session.tokens):
            stops[cold] = SaveReason.COLD  # a cold save on a frontier stands for both
        return sorted(stops.items())

    def continued_due(self, live: LiveSession, in_tool_call: bool) -> bool:
        return bool(self._schedule(live).target(len(live.session.tokens), in_tool_call))

    # -- loading ---------------------------------------------------------------------------------------
    def key(self, prompt: Prompt, ids: list[int]) -> bytes:
        """What a request's prompt matches files by: its rendered text, or, where it holds image blocks,
        its ids' key (`tokens_key`: the text with each image id written out)."""
        if max(ids, default=0) < self.store.args.vocab_size:
            return prompt.text.encode("utf-8")
        return self.store.render_key(ids)

    def restore_async(self, key: bytes, better_than: int) -> Future[AnyState | None]:
        """`restore` on the reader thread."""
        return self._reader.submit(self.restore, key, better_than)

    def restore(self, key: bytes, better_than: int) -> AnyState | None:
        """The longest checkpoint whose key is a prefix of the request's `key` (`key`), if it holds more
        than `better_than` tokens."""
        with self._queued_lock:
            queued = [save for save in self._queued if len(save.image.tokens) > better_than]
        queued = [save for save in queued if key.startswith(self.store.key_of(save.image))]
        best_queued = max(queued, key=lambda save: len(save.image.tokens), default=None)
        if best_queued is not None:
            better_than = len(best_queued.image.tokens)
        with self._lock:
            longer = [e for e in self.store.entries() if e.tokens > better_than and key.startswith(e.key)]
            hit = self.store.lookup(key) if any(e.refusal is None for e in longer) else None
        if hit is None:
            # a checkpoint still waiting for the writer is served from its copy in memory
            return None if best_queued is None else self.store.thaw(best_queued.image)
        for call_id, dsml in hit.tool_map.items():
            self.tool_memory.remember([call_id], dsml)
        return hit.state

    def recall_tool_calls(self, ids: Iterable[str]) -> None:
        """Load the sampled DSML of tool-call ids the tool memory does not know from the files' maps."""
        wanted = {call_id for call_id in ids if call_id and self.tool_memory.get(call_id) is None}
        if not wanted:
            return
        with self._lock:
            for entry in self.store.entries():
                if not wanted or not entry.header.ext_flags & kvfile.EXT_TOOL_MAP:
                    continue
                try:
                    tool_map = kvfile.read_tool_map(entry.path)
                except (KVFileError, OSError):
                    continue
                for call_id in wanted & tool_map.keys():
                    self.tool_memory.remember([call_id], tool_map[call_id])
                    wanted.discard(call_id)
