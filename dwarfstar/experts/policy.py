"""Which cached expert leaves when a miss needs a slot.

Keys are `layout.key(layer, expert)`. The store tells the policy about every use (hit or miss) and
asks it for a victim among the resident experts, never one of the `pinned` (in use by the MoE call
now). `protected` are the experts the current token has used in earlier layers: a policy takes
one of them only when every other resident expert is pinned too (ds4 protects the current token's
experts; with a budget below n_layers x k a token cannot keep all of them).

* `FrequencyPolicy` is ds4's: use counts, halved every `halve_every` uses so that old popularity
  fades, the smallest count leaves, ties go to the least recently used; seeded from a hot-expert
  profile. `lfu` is the same without the protection: a rarely used expert the current token just
  read leaves before a popular one it did not (admission by frequency). Our forward pass copies
  or dequantizes each expert before its slot can be reused, so it does not need the protection;
  on the nano model's real routing `lfu` hits 0.27 where ds4 hits 0.16 at a 25% budget.
* `LRUPolicy`: the least recently used leaves.
* `BeladyPolicy`: the expert used farthest in the future leaves, protected or not; it needs the
  whole access sequence in advance, so it is the offline optimum a trace replay compares the
  others against.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Protocol

import numpy as np

HALVE_EVERY = 4096  # uses between halvings: about 16 Flash tokens (43 layers x 6 experts)


class Policy(Protocol):
    name: str
    protects: bool  # takes a protected expert only when nothing else can go

    def seed(self, counts: np.ndarray) -> None:
        """Start from a hot-expert profile: a use count per key."""
        ...

    def used(self, key: int) -> None:
        """One use of `key`, resident or being loaded."""
        ...

    def preloaded(self, key: int) -> None:
        """`key` entered the cache without a use (seeding from a profile)."""
        ...

    def victim(self, resident: Collection[int], pinned: Collection[int], protected: Collection[int]) -> int:
        """A resident key to evict (never a pinned one)."""
        ...

    def evicted(self, key: int) -> None:
        """`key` left the cache."""
        ...


def _no_victim() -> RuntimeError:
    # the store checks the capacity against one call's experts, so this is a bug, not input
    return RuntimeError("every resident expert is pinned: the cache is smaller than one call's experts")


class FrequencyPolicy:
    """ds4's policy: decayed use counts, ties broken by recency."""

    def __init__(self, n_keys: int, halve_every: int = HALVE_EVERY, protect: bool = True) -> None:
        self.name, self.protects = ("ds4" if protect else "lfu"), protect
        self.counts = np.zeros(n_keys, dtype=np.int64)
        self.last = np.full(n_keys, -1, dtype=np.int64)  # clock of the last use
        self.clock = 0
        self.halve_every = halve_every
        self._resident: set[int] = set()
        self._heap: list[tuple[int, int, int]] = []  # (count, last use, key); stale entries skipped

    def seed(self, counts: np.ndarray) -> None:
        self.counts[:] = counts
        self._rebuild()

    def used(self, key: int) -> None:
        self.clock += 1
        self.counts[key] += 1
        self.last[key] = self.clock
        self._resident.add(key)
        heapq.heappush(self._heap, (int(self.counts[key]), self.clock, key))
        if self.clock % self.halve_every == 0:
            self.counts //= 2
            self._rebuild()

    def preloaded(self, key: int) -> None:
        self._resident.add(key)
        heapq.heappush(self._heap, (int(self.counts[key]), int(self.last[key]), key))

    def _rebuild(self) -> None:
        self._heap = [(int(self.counts[k]), int(self.last[k]), k) for k in self._resident]
        heapq.heapify(self._heap)

    def _current(self, entry: tuple[int, int, int]) -> bool:
        count, last, key = entry
        return key in self._resident and count == self.counts[key] and last == self.last[key]

    def victim(self, resident: Collection[int], pinned: Collection[int], protected: Collection[int]) -> int:
        held: list[tuple[int, int, int]] = []
        fallback = None
        try:
            while self._heap:
                entry = heapq.heappop(self._heap)
                if not self._current(entry):
                    continue
                held.append(entry)
                key = entry[2]
                if key not in resident or key in pinned:  # not resident: the key being loaded now
                    continue
                if self.protects and key in protected:
                    fallback = key if fallback is None else fallback
                    continue
                return key
            if fallback is None:
                raise _no_victim()
            return fallback
        finally:
            for entry in held:
                heapq.heappush(self._heap, entry)

    def evicted(self, key: int) -> None:
        self._resident.discard(key)


class LRUPolicy:
    name, protects = "lru", True

    def __init__(self) -> None:
        self.order: OrderedDict[int, None] = OrderedDict()

    def seed(self, counts: np.ndarray) -> None:
        """Recency has no profile; the seeded experts are simply the oldest."""

    def used(self, key: int) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def preloaded(self, key: int) -> None:
        self.order[key] = None
        self.order.move_to_end(key, last=False)

    def victim(self, resident: Collection[int], pinned: Collection[int], protected: Collection[int]) -> int:
        fallback = None
        for key in self.order:
            if key in resident and key not in pinned:
                if key not in protected:
                    return key
                fallback = key if fallback is None else fallback
        if fallback is None:
            raise _no_victim()
        return fallback

    def evicted(self, key: int) -> None:
        self.order.pop(key, None)


class BeladyPolicy:
    """Evict the expert whose next use is farthest away: the fewest misses any policy can have
    for this access sequence (uses must come in exactly this order)."""

    name, protects = "belady", False

    def __init__(self, accesses: Sequence[int]) -> None:
        seq = np.asarray(accesses, dtype=np.int64)
        self.accesses = seq
        never = len(seq)
        self.next_use = np.full(len(seq), never, dtype=np.int64)
        seen: dict[int, int] = {}
        for t in range(len(seq) - 1, -1, -1):
            key = int(seq[t])
            self.next_use[t] = seen.get(key, never)
            seen[key] = t
        self.position = 0
        self.upcoming: dict[int, int] = {}  # resident key -> position of its next use
        self._heap: list[tuple[int, int]] = []  # (-next use, key); stale entries skipped

    def seed(self, counts: np.ndarray) -> None:
        """The future is known; a profile adds nothing."""

    def used(self, key: int) -> None:
        if self.position >= len(self.accesses) or int(self.accesses[self.position]) != key:
            raise ValueError(f"Belady replay out of step at use {self.position}: got key {key}")
        upcoming = int(self.next_use[self.position])
        self.position += 1
        self.upcoming[key] = upcoming
        heapq.heappush(self._heap, (-upcoming, key))

    def preloaded(self, key: int) -> None:
        later = np.nonzero(self.accesses[self.position :] == key)[0]
        self.upcoming[key] = self.position + int(later[0]) if len(later) else len(self.accesses)
        heapq.heappush(self._heap, (-self.upcoming[key], key))

    def victim(self, resident: Collection[int], pinned: Collection[int], protected: Collection[int]) -> int:
        held: list[tuple[int, int]] = []
        try:
            while self._heap:
                entry = heapq.heappop(self._heap)
                upcoming, key = -entry[0], entry[1]
                if self.upcoming.get(key) != upcoming:
                    continue
                held.append(entry)
                if key not in resident or key in pinned:  # not resident: the key being loaded now
                    continue
                return key
            raise _no_victim()
        finally:
            for entry in held:
                heapq.heappush(self._heap, entry)

    def evicted(self, key: int) -> None:
        self.upcoming.pop(key, None)


POLICIES = ("ds4", "lfu", "lru", "belady")


def make_policy(name: str, n_keys: int, accesses: Sequence[int] | None = None) -> Policy:
    if name in ("ds4", "lfu"):
        return FrequencyPolicy(n_keys, protect=name == "ds4")
    if name == "lru":
        return LRUPolicy()
    if name == "belady":
        if accesses is None:
            raise ValueError("Belady's policy needs the access sequence in advance (a trace replay)")
        return BeladyPolicy(accesses)
    raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
