"""When the disk KV cache saves a checkpoint, and which checkpoints it drops when space runs out.

Save points (ds4's, DS4_SURFACE §4.3; pure functions the server calls):

* cold: on a full miss with a prompt of min..cold_max tokens, save at the last `<｜User｜>` before the
  first `<｜Assistant｜>` (the stable system + tools prefix) when that is >= min tokens, else at
  `store_len` (the prompt minus a 32-token tail, rounded down to 2048, or the whole prompt when
  that would fall below min). The trim keeps BPE merges across the prompt end out of the key.
* continued: whenever the live sequence reaches a multiple of ceil(interval / align) * align above the
  last stored frontier (absolute multiples, so an early cold save does not shift the schedule), and
  not while a DSML tool call is being generated.
* evict (live state about to be replaced) and shutdown: the live state, if >= min tokens.

Eviction. ds4 evicts the lowest `(hits + 1) * tokens / size` (hits halved every 6 h) and protects the
file just stored. Under agent workloads that thrashes: every file carries a fixed overhead (24 MB for
Flash: raw windows, frontiers, logits), so the short shared prefix every conversation starts with
has the lowest density and goes first (ds4 #444); the store-then-evict pass can delete a file right
after writing it, or evict the prefix the next load needs (#157, #448); nested continued snapshots of
one prefill compete for space although the longest dominates every lookup (#174); and decayed hits
leave large one-off files a permanent floor above reused prefixes (#550). Here:

* score = tokens * weight / size, lowest evicted first, ties to the least recently used;
  weight = (base(reason) + hits) * 2^(-idle / 24 h) + branches.
  base is 4 for cold (and agent-system) anchors, which exist to be shared; 2 for evict, shutdown
  and agent-session files, each the only restart point of an interrupted conversation; 1 for
  continued and unknown. Hits and the base fade together with idle time, so a prefix reused daily
  keeps its lead over an idle one-off file instead of sinking below its floor.
* branches counts the leaf files whose key extends this key: conversations on disk that passed
  through this prefix. It does not decay while those files exist, so the shared system prompt
  outlives any number of long one-off conversations built on it.
* admission: a new file is stored only if the same pass would keep it (and its size + 1% fits the
  budget); otherwise nothing is written or evicted. So the file just written is never evicted, and
  a one-off file never pushes out something worth more.
* supersession: storing a file deletes the continued/evict/shutdown checkpoints of the same
  conversation that it extends when they are not fork points (no other branch) and were hit at most
  once (that hit is the resumption that led here): the longer file serves every lookup they would.
  Cold anchors are never superseded.
* a pass can be told to keep every file that is a prefix of an incoming prompt (the evict save
  before a disk lookup must not delete the file that lookup is about to load).

The score stays a price per byte on purpose: a 600-token prefix in a 32 MB Flash file must be reused
a few times to be worth a 30k-token conversation in 440 MB, and branches and hits are that evidence;
a 20k-token agent system prompt outranks such a conversation from the start. Unlike ds4, a file is
not deleted after loading when it exceeds cold_max ("consumed"): supersession removes it once the
conversation saves again, and until then it stays the restart point if the process dies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

USER_TOKEN = 128803  # <｜User｜>
ASSISTANT_TOKEN = 128804  # <｜Assistant｜>
MIB = 1 << 20


class SaveReason(IntEnum):
    UNKNOWN = 0
    COLD = 1
    CONTINUED = 2
    EVICT = 3
    SHUTDOWN = 4
    AGENT_SYSTEM = 5
    AGENT_SESSION = 6


_BASE_WEIGHT = {
    SaveReason.COLD: 4.0,
    SaveReason.AGENT_SYSTEM: 4.0,
    SaveReason.EVICT: 2.0,
    SaveReason.SHUTDOWN: 2.0,
    SaveReason.AGENT_SESSION: 2.0,
}
_SUPERSEDABLE = {SaveReason.UNKNOWN, SaveReason.CONTINUED, SaveReason.EVICT, SaveReason.SHUTDOWN}


@dataclass(frozen=True)
class KVCacheOptions:
    """ds4's flags and defaults (`--kv-cache-*`, `--kv-disk-space-mb`), DS4_SURFACE §1."""

    min_tokens: int = 512
    cold_max_tokens: int = 30000  # 0 disables cold saves
    continued_interval_tokens: int = 10000  # 0 disables continued saves
    boundary_trim_tokens: int = 32
    boundary_align_tokens: int = 2048  # 0: no alignment
    budget_bytes: int = 4096 * MIB
    strict_quant: bool = False  # --kv-cache-reject-different-quant
    idle_half_life_s: float = 24 * 3600.0

    def __post_init__(self) -> None:
        if self.cold_max_tokens and self.cold_max_tokens < self.min_tokens:
            raise ValueError(f"cold_max_tokens {self.cold_max_tokens} must be 0 or >= min_tokens {self.min_tokens}")
        if min(self.min_tokens, self.continued_interval_tokens, self.boundary_trim_tokens) < 0:
            raise ValueError("token counts must not be negative")
        if self.boundary_align_tokens < 0 or self.budget_bytes <= 0:
            raise ValueError("alignment must not be negative and the budget must be positive")

    @property
    def continued_step(self) -> int:
        """Spacing of continued saves: the interval rounded up to the alignment (10000 -> 10240)."""
        align = self.boundary_align_tokens
        if not self.continued_interval_tokens or not align:
            return self.continued_interval_tokens
        return math.ceil(self.continued_interval_tokens / align) * align


# -- save points ------------------------------------------------------------------------------------
def store_len(opts: KVCacheOptions, n_tokens: int) -> int:
    """Stable save length for a prompt: trim the tail and align down, unless that drops below min."""
    if n_tokens > opts.min_tokens + opts.boundary_trim_tokens:
        stable = n_tokens - opts.boundary_trim_tokens
        if opts.boundary_align_tokens:
            stable -= stable % opts.boundary_align_tokens
        if stable >= opts.min_tokens:
            return stable
    return n_tokens


def chat_anchor_pos(
    opts: KVCacheOptions, tokens: Sequence[int], user: int = USER_TOKEN, assistant: int = ASSISTANT_TOKEN
) -> int:
    """Position of the last `<｜User｜>` before the first `<｜Assistant｜>` if >= min tokens, else -1.

    Some clients put stable user-role scaffolding first, hence the last user marker, not the first.
    """
    last_user = -1
    for i, token in enumerate(tokens):
        if token == assistant:
            break
        if token == user:
            last_user = i
    return last_user if last_user >= opts.min_tokens else -1


def cold_save_point(opts: KVCacheOptions, prompt: Sequence[int], cached_tokens: int) -> int:
    """Where to stop a cold prefill to save (0: no cold save). Only on a full miss."""
    n = len(prompt)
    if cached_tokens or not opts.cold_max_tokens or not opts.min_tokens <= n <= opts.cold_max_tokens:
        return 0
    anchor = chat_anchor_pos(opts, prompt)
    point = anchor if anchor >= 0 else store_len(opts, n)
    return point if point >= opts.min_tokens else 0


@dataclass
class ContinuedSchedule:
    """Continued saves at absolute multiples of `continued_step`, each above the last stored frontier.

    A cold save that lands on a frontier calls `note_store` first, so the frontier is not saved twice
    (ds4 #157); if that save fails the caller puts `last_stored` back.
    """

    opts: KVCacheOptions
    last_stored: int = 0

    def target(self, live_tokens: int, in_dsml: bool = False) -> int:
        """live_tokens if a continued save is due now, else 0."""
        step = self.opts.continued_step
        if not step or in_dsml or live_tokens < self.opts.min_tokens:
            return 0
        return live_tokens if live_tokens % step == 0 and live_tokens > self.last_stored else 0

    def next_frontier(self, live_tokens: int) -> int:
        """The next position a prefill should stop at to save (0: none), for splitting long prompts."""
        step = self.opts.continued_step
        if not step:
            return 0
        frontier = (max(live_tokens, self.last_stored) // step + 1) * step
        while frontier < self.opts.min_tokens:
            frontier += step
        return frontier

    def note_store(self, tokens: int) -> None:
        self.last_stored = max(self.last_stored, tokens)


# -- eviction ---------------------------------------------------------------------------------------
class CachedFile(Protocol):
    """What the policy needs to know about a file on disk."""

    key: bytes
    tokens: int
    size: int
    hits: int
    last_used: int  # unix seconds
    reason: int


@dataclass
class EvictionPlan:
    victims: list = field(default_factory=list)  # CachedFile, lowest score first
    admit: bool = True  # whether the incoming file should be written at all


def branches(files: Sequence[CachedFile]) -> list[int]:
    """For each file, how many leaf files (no file extends them) have a key extending its key."""
    extends = [[j for j, g in enumerate(files) if j != i and _extends(g.key, f.key)] for i, f in enumerate(files)]
    leaves = {i for i, ds in enumerate(extends) if not ds}
    return [sum(1 for j in ds if j in leaves) for ds in extends]


def eviction_scores(files: Sequence[CachedFile], now: float, opts: KVCacheOptions) -> list[float]:
    scores = []
    for f, n_branches in zip(files, branches(files), strict=True):
        idle = max(0.0, now - f.last_used)
        fresh = _BASE_WEIGHT.get(f.reason, 1.0) + f.hits
        weight = fresh * 2.0 ** (-idle / opts.idle_half_life_s) + n_branches
        scores.append(f.tokens * weight / max(1, f.size))
    return scores


def plan_eviction(
    files: Sequence[CachedFile],
    now: float,
    opts: KVCacheOptions,
    incoming: CachedFile | None = None,
    keep: Iterable[CachedFile] = (),
) -> EvictionPlan:
    """Victims that bring the total under budget, and whether `incoming` is worth storing.

    Files in `keep` are never victims. If the pass would evict `incoming` itself, it is not admitted
    and the plan only restores the budget for the files already there.
    """
    if incoming is not None and incoming.size + math.ceil(incoming.size / 100) > opts.budget_bytes:
        return EvictionPlan(_victims(list(files), now, opts, keep), admit=False)
    pool = [*files, incoming] if incoming is not None else list(files)
    victims = _victims(pool, now, opts, keep)
    if incoming is not None and any(v is incoming for v in victims):
        return EvictionPlan(_victims(list(files), now, opts, keep), admit=False)
    return EvictionPlan(victims)


def _victims(pool: list, now: float, opts: KVCacheOptions, keep: Iterable[CachedFile]) -> list:
    protected = {id(f) for f in keep}
    total = sum(f.size for f in pool)
    victims = []
    while total > opts.budget_bytes:
        # scores change as files go (a prefix loses branches), so rank again after each removal
        scores = eviction_scores(pool, now, opts)
        order = sorted(
            (i for i, f in enumerate(pool) if id(f) not in protected), key=lambda i: (scores[i], pool[i].last_used)
        )
        if not order:
            break
        victim = pool.pop(order[0])
        victims.append(victim)
        total -= victim.size
    return victims


def superseded(files: Sequence[CachedFile], new: CachedFile) -> list:
    """Checkpoints of the same conversation that `new` makes redundant (see the module docstring)."""
    chain = [f for f in files if _extends(new.key, f.key)]
    out = []
    for f in chain:
        if f.reason not in _SUPERSEDABLE or f.hits > 1:
            continue
        # a fork point has a descendant off new's chain; it serves lookups new cannot
        if all(g is f or not _extends(g.key, f.key) or _extends(new.key, g.key) for g in files):
            out.append(f)
    return out


def _extends(longer: bytes, prefix: bytes) -> bool:
    return len(longer) > len(prefix) and longer.startswith(prefix)
