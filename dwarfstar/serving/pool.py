"""Live KV sessions: several conversations kept in memory at once, each request routed to the right one.

ds4 keeps one live KV, so an agent and its subagents evict each other on every turn (ds4 #209). Here
up to `max_sessions` sessions live within a byte budget. A request takes, in order:
1. the idle session whose last prompt it extends (the same conversation, one turn later);
2. the disk cache's longest checkpoint of its rendered text, when that beats what memory offers;
3. a copy of the idle session sharing the longest prefix, when that prefix is at least one prefill
   chunk (the copy replays at most a chunk from its checkpoint, so it beats a cold prefill);
4. a new empty session.
Without room for another session, the least recently used idle one is given up first (taken over
instead, when it is the one sharing the prefix). Other conversations are never touched while there
is room. A session given up, here or for the memory budget, is saved to the disk cache first when
there is one.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dwarfstar.backends.protocol import Backend
from dwarfstar.kvcache.kvpolicy import SaveReason
from dwarfstar.kvcache.payloads import AnyState
from dwarfstar.model.image_spans import ImageSpan
from dwarfstar.prompt.render import Prompt
from dwarfstar.session.prefix import ReusePlan, checkpoint_marks, common_prefix_len, image_reuse, plan_reuse
from dwarfstar.session.session import Session
from dwarfstar.steering.apply import steering_of
from dwarfstar.steering.direction import SteeringScale
from dwarfstar.tokenizer.tokenizer import Tokenizer


class DiskCache(Protocol):
    """What the pool needs from a disk KV cache (disk.py)."""

    def save(self, live: LiveSession, reason: SaveReason) -> None: ...

    def key(self, prompt: Prompt, ids: list[int]) -> bytes: ...

    def restore(self, key: bytes, better_than: int) -> AnyState | None: ...


@dataclass(frozen=True)
class DiskLookup:
    """A disk-cache lookup made ahead of `acquire` (off the engine thread), and what it found."""

    better_than: int
    state: AnyState | None


@dataclass(eq=False)
class LiveSession:
    session: Session
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)
    prompt_len: int = 0  # tokens of the last prompt run here: a request extending it continues this conversation
    tool_ids: set[str] = field(default_factory=set)  # tool calls of this conversation (kept with its KV files)
    # the steering its KV was computed with, part of the cache key (None: none; the disk cache holds only those)
    steering: SteeringScale | None = None

    def continued_by(self, shared: int) -> bool:
        # A thinking prompt ends in `<think>`, which the next turn renders as `</think>` once the
        # reasoning is dropped; everything before that last token is still the same conversation.
        return self.prompt_len > 0 and shared >= self.prompt_len - 1


@dataclass
class Lease:
    live: LiveSession
    plan: ReusePlan
    source: str  # memory | fork | disk | cold
    replayed: int = 0  # tokens recomputed from a checkpoint to cut the session back to the shared prefix

    @property
    def session(self) -> Session:
        return self.live.session


class SessionPool:
    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        *,
        ctx: int,
        chunk: int,
        max_sessions: int,
        memory_bytes: int = 0,
        disk: DiskCache | None = None,
    ) -> None:
        self.backend, self.tokenizer = backend, tokenizer
        self.ctx, self.chunk = ctx, chunk
        self.max_sessions, self.memory_bytes, self.disk = max_sessions, memory_bytes, disk
        self.live: list[LiveSession] = []

    def nbytes(self) -> int:
        return sum(live.session.nbytes() for live in self.live)

    def _has_room(self) -> bool:
        if len(self.live) >= self.max_sessions:
            return False
        return self.memory_bytes <= 0 or self.nbytes() < self.memory_bytes

    def _best_idle(
        self, ids: list[int], steering: SteeringScale | None
    ) -> tuple[list[LiveSession], LiveSession | None, int]:
        """The idle sessions, the one sharing the longest prefix with `ids` (same steering), and that length."""
        idle = [live for live in self.live if not live.busy]
        alike = [live for live in idle if live.steering == steering]  # a KV steered otherwise is no prefix
        shared = {id(live): common_prefix_len(live.session.tokens, ids) for live in alike}
        best = max(alike, key=lambda live: (shared[id(live)], live.last_used), default=None)
        return idle, best, shared[id(best)] if best is not None else 0

    def _useful(self, shared: int) -> int:
        # A shared prefix shorter than a chunk is not worth keeping: cutting a session back may replay
        # up to a chunk from its last checkpoint, which costs as much as prefilling that prefix cold.
        return shared if shared >= self.chunk else 0

    def disk_lookup_due(
        self, prompt: Prompt | None, ids: list[int], steering: SteeringScale | None = None
    ) -> int | None:
        """The `better_than` of the disk lookup `acquire` would make now; None when it would make none
        (memory continues the conversation, nothing is free, or no disk cache applies)."""
        if self.disk is None or prompt is None or steering is not None:
            return None
        idle, best, best_shared = self._best_idle(ids, steering)
        if (best is not None and best.continued_by(best_shared)) or (not self._has_room() and not idle):
            return None
        return self._useful(best_shared)

    def acquire(
        self,
        prompt: Prompt | None,
        ids: list[int],
        steering: SteeringScale | None = None,
        looked_up: DiskLookup | None = None,
        images: Sequence[ImageSpan] = (),
    ) -> Lease | None:
        """A session brought to the state after `ids`' longest cached prefix computed with the same
        `steering`; None while all are busy. `looked_up`: the disk lookup already made for this
        request (else it is made here, when due). `images`: the prompt's image blocks (offsets into
        `ids`), whose rows a session holding their ids without them (one read from the disk cache)
        learns, so that cutting it back replays them."""
        idle, best, best_shared = self._best_idle(ids, steering)
        if best is not None and best.continued_by(best_shared):
            return self._lease(best, prompt, ids, "memory", images)
        # another conversation, or one that left memory
        useful = self._useful(best_shared)
        if not self._has_room() and not idle:
            return None
        on_disk = self.disk is not None and prompt is not None and steering is None
        if looked_up is not None:  # made earlier: memory may have gained a longer prefix since
            state = looked_up.state if looked_up.state is not None and len(looked_up.state.tokens) > useful else None
        else:
            state = self.disk.restore(self.disk.key(prompt, ids), better_than=useful) if on_disk else None
        if not self._has_room():
            victim = min(idle, key=lambda live: live.last_used)
            self._save(victim)
            if victim is best and useful and state is None:
                return self._lease(best, prompt, ids, "memory", images)  # taken over, cut back to the shared prefix
            self.live.remove(victim)
        if state is not None:
            live, source = self._new(steering), "disk"
            live.session.state = state
        elif useful:
            live, source = self._fork(best), "fork"
        else:
            live, source = self._new(steering), "cold"
        return self._lease(live, prompt, ids, source, images)

    def _lease(
        self, live: LiveSession, prompt: Prompt | None, ids: list[int], source: str, images: Sequence[ImageSpan]
    ) -> Lease:
        plan = self._plan(live.session, prompt, ids, images)
        live.busy = True
        try:
            computed = live.session.stats.computed
            live.session.adopt(images, ids)
            live.session.truncate(plan.keep)
        except BaseException:
            self.discard(live)
            raise
        live.session.mark(checkpoint_marks(plan, self.tokenizer))
        return Lease(live, plan, source, replayed=live.session.stats.computed - computed)

    def release(self, lease: Lease, prompt_len: int) -> None:
        lease.live.busy = False
        lease.live.last_used = time.monotonic()
        lease.live.prompt_len = prompt_len
        self._enforce_budget(keep=lease.live)

    def discard(self, live: LiveSession) -> None:
        """Drop a session whose state can no longer be trusted (a failure in the middle of a step)."""
        if live in self.live:
            self.live.remove(live)

    def _plan(self, session: Session, prompt: Prompt | None, ids: list[int], images: Sequence[ImageSpan]) -> ReusePlan:
        if images:  # the token match only (a prompt's image ids have no text), never inside a block
            keep, later = image_reuse(session.tokens, ids, images)
            return ReusePlan(keep, ids[keep:], "tokens" if keep else "none", later)
        keep = common_prefix_len(session.tokens, ids)
        if keep == len(session.tokens) or prompt is None:
            return ReusePlan(keep, ids[keep:], "tokens" if keep else "none")
        # the cached tokens may spell the prompt's text with other token boundaries (sampled text)
        return plan_reuse(session.tokens, prompt, self.tokenizer)

    def _new(self, steering: SteeringScale | None) -> LiveSession:
        live = LiveSession(Session(self.backend, ctx=self.ctx, chunk=self.chunk), steering=steering)
        self._steer(live)
        self.live.append(live)
        return live

    def _steer(self, live: LiveSession) -> None:
        steered = steering_of(self.backend)
        if steered is not None:
            steered.assign(live.session, live.steering or SteeringScale())

    def _fork(self, source: LiveSession) -> LiveSession:
        # A deep copy keeps the state and its chunk checkpoints consistent with each other; the
        # backend (weights) is shared, not copied.
        session = copy.deepcopy(source.session, memo={id(self.backend): self.backend})
        live = LiveSession(session, tool_ids=set(source.tool_ids), steering=source.steering)
        self._steer(live)
        self.live.append(live)
        return live

    def _save(self, live: LiveSession) -> None:
        if self.disk is not None:
            self.disk.save(live, SaveReason.EVICT)
        live.tool_ids.clear()

    def save_all(self) -> None:
        """Shutdown: every live conversation to the disk cache."""
        if self.disk is not None:
            for live in self.live:
                self.disk.save(live, SaveReason.SHUTDOWN)

    def _enforce_budget(self, keep: LiveSession) -> None:
        if self.memory_bytes <= 0:
            return
        while self.nbytes() > self.memory_bytes:
            idle = [live for live in self.live if not live.busy and live is not keep]
            if not idle:
                return
            victim = min(idle, key=lambda live: live.last_used)
            self._save(victim)
            self.live.remove(victim)
