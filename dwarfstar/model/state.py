"""The per-sequence KV state of DeepSeek V4: slots of a backend-owned cache, and handles on them.

What a sequence keeps (spec §3.2, DS4_SURFACE §4.1), per layer: the raw window of post-RoPE KV
rows; for compressed layers the emitted rows and the compressor frontier; for ratio-4 layers also
the indexer rows and frontier. Plus the position, the tokens and the next-token logits.

Frontier layout (as ds4 and the official code): ratio 4 keeps [8, 2*dim] rows of projected values
and gate logits (gate already includes the position bias); rows 0..3 hold the previous window,
whose first half feeds the next row (overlap), rows 4..7 the window in progress (row 4 + p mod 4).
Ratio 128 keeps [128, dim] rows, row p mod 128. Slots not yet written hold kv 0 and gate -inf, so
a softmax over them gives them weight 0.

Storage. `KVCache` holds each part of each layer for a block of sequences in preallocated arrays:
the raw window is a ring of `window` rows per slot (position p in row p mod window), the frontiers
have their fixed shapes per slot, `[slots, ...]`. The compressed rows live in the pages of a pool
that the block's slots share, `[pages, PAGE_ROWS, dim]`, each slot finding its rows through a page
table per ratio (`pages.py`) that reaches a whole context (ctx // ratio rows, rounded up to
`ROW_STEP`); a fork shares its parent's pages instead of copying them. A pipeline stage's cache
holds only its layers (`layers`, a range of the model's): parts are keyed by the global layer index,
so a layer's arrays have one name on every stage, and the other layers have no arrays at all. When
every slot is taken a new block is added, so the arrays of a live slot never move or grow: kernels
write rows by index, and a captured decode step keeps its addresses. The backend picks the arrays
through `Storage` (torch on its device, or MLX arrays), and their precision: the reference and MLX
keep float32; a compact `TorchStorage` (Triton with QAT rounding) keeps each row part's QAT-rounded
dims, exactly representable in bf16, in bf16 (`SplitRows` when the RoPE dims, which are not
rounded, stay float32). Every reader gets the float32 values, so payloads are the same bytes
whichever layout held them.

Handle. `SequenceState` is a slot plus pos, tokens and logits; the slot returns to its cache when
the handle is dropped, with its row pages. A ratio-r layer has emitted pos // r rows, so no row
counts are kept. Before a forward pass writes rows, `reserve` gives the state pages of its own under
them (copying a page it shares first), so a write never reaches another state's rows. Snapshots
copy the small fixed parts (raw ring, frontiers, logits) and share the rows, which are append-only;
`rewinds` remembers where the state was rewound to, so a snapshot taken further along, whose rows
may since have been overwritten, is refused instead of read.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from dwarfstar.errors import ContextOverflowError, DwarfStarError
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.image_spans import ImageSpan, check_ids
from dwarfstar.model.pages import PAGE_ROWS, RowPages

# Row capacities are multiples of 64: Triton specialises kernels on integer arguments divisible by
# 16, so every slot's row arrays share one compiled variant whatever the context.
ROW_STEP = 64


class Storage(Protocol):
    """How a backend allocates the cache's arrays and moves them to and from the host.

    Arrays are indexed and assigned with Python indexing (`a[i]`, `a[i, lo:hi] = v`), which torch
    tensors and MLX arrays share."""

    def full(self, shape: tuple[int, ...], value: float | None) -> Any:
        """A new array; `None` leaves the contents undefined (parts read only where written)."""
        ...

    def rows(self, shape: tuple[int, ...], exact_dims: int) -> Any:
        """A row part's array (contents undefined): its rows' first `exact_dims` values are exactly
        representable in bf16 (QAT-rounded), which a backend may use to store them compactly."""
        ...

    def row_nbytes(self, dim: int, exact_dims: int) -> int:
        """Bytes a row of `rows(..., exact_dims)` takes."""
        ...

    def table(self, shape: tuple[int, ...]) -> Any:
        """A zeroed int32 array: a page table, read by kernels where the rows are."""
        ...

    def take_rows(self, pool: Any, pages: np.ndarray, offsets: np.ndarray) -> Any:
        """Rows of a row pool [pages, PAGE_ROWS, dim]: row offsets[i] of page pages[i], [n, dim]."""
        ...

    def put_rows(self, pool: Any, pages: np.ndarray, offsets: np.ndarray, value: Any) -> None:
        """Float32 rows `value` [n, dim] into row offsets[i] of page pages[i], in the pool's layout."""
        ...

    def copy(self, a: Any) -> Any: ...

    def cat(self, parts: Sequence[Any]) -> Any: ...

    def to_numpy(self, a: Any) -> np.ndarray:
        """float32 on the host."""
        ...

    def from_numpy(self, a: np.ndarray) -> Any: ...

    element_size: int
    device: torch.device | str  # where the backend's torch tensors (the logits) live


@dataclass
class SplitRows:
    """Rows stored as their bf16-exact leading dims (`exact` [..., e], bf16) and the rest (`rest`
    [..., dim - e], float32): the KV rows' FP8-rounded nope dims and their RoPE dims, which are not
    rounded. Indexed on the leading dims like a tensor; assigning float32 rows splits them (the cast
    to bf16 is exact on QAT-rounded values), so the cache reads and writes them as one array."""

    exact: torch.Tensor
    rest: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.exact.shape[:-1], self.exact.shape[-1] + self.rest.shape[-1])

    def __len__(self) -> int:
        return self.exact.shape[0]

    def __getitem__(self, key: Any) -> SplitRows:
        return SplitRows(self.exact[key], self.rest[key])

    def __setitem__(self, key: Any, value: SplitRows | torch.Tensor) -> None:
        if not isinstance(value, SplitRows):
            value = SplitRows(value[..., : self.exact.shape[-1]], value[..., self.exact.shape[-1] :])
        self.exact[key] = value.exact
        self.rest[key] = value.rest

    def index_copy_(self, index: torch.Tensor, value: SplitRows | torch.Tensor) -> None:
        """Rows `value` [n, dim] (float32, or split) into rows `index` of the flattened leading dims."""
        e = self.exact.shape[-1]
        exact, rest = (value.exact, value.rest) if isinstance(value, SplitRows) else (value[:, :e], value[:, e:])
        self.exact.view(-1, e).index_copy_(0, index, exact.to(self.exact.dtype))
        self.rest.view(-1, self.rest.shape[-1]).index_copy_(0, index, rest)

    def zero_(self) -> SplitRows:
        self.exact.zero_()
        self.rest.zero_()
        return self

    def float(self) -> torch.Tensor:
        return torch.cat((self.exact.float(), self.rest), dim=-1)


def index_copy_rows(rows: torch.Tensor | SplitRows, index: torch.Tensor, value: torch.Tensor) -> None:
    """Float32 rows `value` [n, dim] into rows `index` (int64, on the rows' device) of the flattened
    leading dims of a row array, in its layout (float32, bf16, or split)."""
    if isinstance(rows, SplitRows):
        rows.index_copy_(index, value)
    else:
        rows.view(-1, rows.shape[-1]).index_copy_(0, index, value.to(rows.dtype))


@dataclass(frozen=True)
class TorchStorage:
    """Arrays as torch tensors on `device`. `compact` keeps row parts' bf16-exact dims in bf16 (a
    backend that rounds with QAT, on a device where KV memory is the context limit): 1,152 bytes
    for a 512-wide KV row with 64 RoPE dims instead of 2,048, and 256 for a 128-wide indexer row."""

    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.float32
    compact: bool = False

    def full(self, shape: tuple[int, ...], value: float | None, dtype: torch.dtype | None = None) -> torch.Tensor:
        # a normal tensor even when the first state is made under inference mode, so that training,
        # outside it, can still write into the cache
        dtype = self.dtype if dtype is None else dtype
        with torch.inference_mode(False):
            if value is None:
                return torch.empty(shape, device=self.device, dtype=dtype)
            return torch.full(shape, value, device=self.device, dtype=dtype)

    def rows(self, shape: tuple[int, ...], exact_dims: int) -> torch.Tensor | SplitRows:
        if not self.compact or exact_dims == 0:
            return self.full(shape, None)
        exact = self.full((*shape[:-1], exact_dims), None, torch.bfloat16)
        if exact_dims == shape[-1]:
            return exact
        return SplitRows(exact, self.full((*shape[:-1], shape[-1] - exact_dims), None))

    def row_nbytes(self, dim: int, exact_dims: int) -> int:
        if not self.compact:
            return dim * self.element_size
        return 2 * exact_dims + (dim - exact_dims) * self.element_size

    def table(self, shape: tuple[int, ...]) -> torch.Tensor:
        return self.full(shape, 0, torch.int32)

    def take_rows(self, pool: torch.Tensor | SplitRows, pages: np.ndarray, offsets: np.ndarray) -> Any:
        return pool[self._index(pages), self._index(offsets)]

    def put_rows(self, pool: torch.Tensor | SplitRows, pages: np.ndarray, offsets: np.ndarray, value: Any) -> None:
        index_copy_rows(pool, self._index(pages * pool.shape[1] + offsets), value)

    def _index(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)

    def copy(self, a: torch.Tensor) -> torch.Tensor:
        return a.clone()

    def cat(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(parts))

    def to_numpy(self, a: torch.Tensor | SplitRows) -> np.ndarray:
        return a.float().detach().to("cpu", torch.float32).numpy()

    def from_numpy(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(self.device, self.dtype)

    @property
    def element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()


@dataclass(frozen=True)
class CompressorSpec:
    kind: str  # "attn" or "indexer"
    ratio: int
    dim: int  # width of an emitted row
    # leading dims that QAT rounds, so exactly representable in bf16: the attention rows' nope dims
    # (FP8 e4m3 with a power-of-two scale), the whole indexer row (FP4 e2m1, likewise)
    exact_dims: int = 0

    @property
    def overlap(self) -> bool:
        return self.ratio == 4

    @property
    def current_offset(self) -> int:
        """First frontier row of the window in progress (after the previous window for ratio 4)."""
        return self.ratio if self.overlap else 0

    @property
    def frontier_shape(self) -> tuple[int, int]:
        coff = 2 if self.overlap else 1
        return coff * self.ratio, coff * self.dim


def layer_compressors(args: ModelArgs) -> list[dict[str, CompressorSpec]]:
    """Per layer, its compressors by kind."""
    out = []
    for layer in args.layers:
        r, specs = layer.compress_ratio, {}
        if r:
            specs["attn"] = CompressorSpec("attn", r, args.head_dim, args.head_dim - args.rope_dim)
        if layer.has_indexer:
            specs["indexer"] = CompressorSpec("indexer", r, args.index_head_dim, args.index_head_dim)
        out.append(specs)
    return out


class KVCache:
    """Preallocated KV slots, `block_slots` sequences of at most `ctx` tokens per block."""

    def __init__(
        self, args: ModelArgs, ctx: int, storage: Storage, block_slots: int = 1, layers: range | None = None
    ) -> None:
        """`layers`: the layers it holds arrays for (a pipeline stage's slice); default every layer."""
        if block_slots < 1:
            raise DwarfStarError(f"a KV cache block needs at least one slot, got {block_slots}")
        self.layers = range(args.n_layers) if layers is None else layers
        if not 0 <= self.layers.start < self.layers.stop <= args.n_layers or self.layers.step != 1:
            raise DwarfStarError(f"a KV cache of layers {self.layers} is not a slice of the {args.n_layers} layers")
        self.args, self.ctx, self.storage, self.block_slots = args, ctx, storage, block_slots
        # every layer's specs, held or not: a route's coordinator names its workers' parts by them
        self.compressors = layer_compressors(args)
        self.blocks: list[dict[int, dict[str, Any]]] = []  # block -> global layer -> part name -> array
        self.pages: list[dict[int, RowPages]] = []  # block -> ratio -> its page tables
        self.free: list[tuple[int, int]] = []
        self._serial = itertools.count()
        # slots and pages are taken and given back from more than one thread: the engine's, the disk
        # cache's reader (a restored state) and writer (a saved state's frozen copy, released there);
        # reentrant, as a state dropped while it is held (a collection) gives its slot back
        self.lock = threading.RLock()
        # the held layers' compressors by ratio: one page table serves them all
        self.ratios: dict[int, list[tuple[int, str]]] = {}
        for il in self.layers:
            for kind, spec in self.compressors[il].items():
                self.ratios.setdefault(spec.ratio, []).append((il, kind))

    def capacity(self, ratio: int) -> int:
        """Rows a slot holds at `ratio`: every row of a full context, plus the row in progress, which a
        batched decode step writes (unseen) at pos // ratio whether or not its window completes."""
        return -(-(self.ctx // ratio + 1) // ROW_STEP) * ROW_STEP

    def _add_block(self) -> None:
        a, n, full = self.args, self.block_slots, self.storage.full
        tables = {r: (n, self.capacity(r) // PAGE_ROWS) for r in self.ratios}  # [slots, pages a slot can hold]
        pages = {r: RowPages(*shape, self.storage.table(shape)) for r, shape in tables.items()}
        block = {}
        for il in self.layers:
            # left undefined like the rows (and a reused slot holds its last owner's): a reader of
            # rows it has not written masks them itself (the reference decode step zeroes them)
            parts = {"raw": full((n, a.window, a.head_dim), None)}
            for kind, spec in self.compressors[il].items():
                pool = (len(pages[spec.ratio].holders), PAGE_ROWS, spec.dim)
                parts[f"{kind}_rows"] = self.storage.rows(pool, spec.exact_dims)
                parts[f"{kind}_kv"] = full((n, *spec.frontier_shape), 0.0)
                parts[f"{kind}_gate"] = full((n, *spec.frontier_shape), float("-inf"))
            block[il] = parts
        self.blocks.append(block)
        self.pages.append(pages)
        b = len(self.blocks) - 1
        self.free.extend((b, i) for i in reversed(range(n)))

    def acquire(self, near: int | None = None) -> tuple[int, int]:
        """A free slot (block, index) with empty frontiers: one of block `near` when it has one (a
        fork there shares its parent's row pages)."""
        with self.lock:
            if not self.free:
                self._add_block()
            mine = [i for i, slot in enumerate(self.free) if slot[0] == near]
            block, index = slot = self.free.pop(mine[-1] if mine else -1)
        for il, layer in self.blocks[block].items():
            for kind in self.compressors[il]:
                layer[f"{kind}_kv"][index] = 0.0
                layer[f"{kind}_gate"][index] = float("-inf")
        return slot

    def release(self, slot: tuple[int, int]) -> None:
        with self.lock:
            for pages in self.pages[slot[0]].values():
                pages.release(slot[1])
            self.free.append(slot)

    def pages_in_use(self) -> int:
        """Row pages held by some sequence, over every block and ratio."""
        return sum(pages.pages_in_use for block in self.pages for pages in block.values())

    @property
    def slots_in_use(self) -> int:
        return len(self.blocks) * self.block_slots - len(self.free)

    def new_state(self) -> SequenceState:
        return SequenceState(self)


class SequenceState:
    """A sequence's slot in a `KVCache`, with its position, tokens and next-token logits."""

    def __init__(self, cache: KVCache, near: int | None = None) -> None:
        """`near`: a cache block to take the slot in when it has one free."""
        self.cache = cache
        self.slot = cache.acquire(near)
        self.serial = next(cache._serial)  # tells snapshots of this state from those of a slot's earlier owner
        self.pos = 0
        self.tokens: list[int] = []
        self.logits: torch.Tensor | None = None  # next-token logits after the last token
        self.rewinds: list[int] = []
        self.ancestors: dict[int, int] = {}  # serial of a state this one was forked from -> the fork's pos
        weakref.finalize(self, cache.release, self.slot)

    # -- the slot's arrays -----------------------------------------------------------------------------
    def parts(self, il: int) -> dict[str, Any]:
        """Layer il's arrays for every slot of this state's block (index them with `index`)."""
        try:
            return self.cache.blocks[self.slot[0]][il]
        except KeyError:
            held = self.cache.layers
            raise DwarfStarError(
                f"layer {il} has no KV arrays here: this cache holds layers {held.start}..{held.stop - 1}"
            ) from None

    @property
    def index(self) -> int:
        return self.slot[1]

    @property
    def block(self) -> tuple[KVCache, int]:
        """The cache block holding the slot: states of one block can share a batched launch."""
        return self.cache, self.slot[0]

    def part(self, il: int, name: str) -> Any:
        """This slot's array of a part: `raw` [window, head_dim] (a ring), `{kind}_kv` /
        `{kind}_gate` (the frontier). Torch gives a view, written in place. The compressed rows
        are paged: read them with `rows`, find them with `row_pages`."""
        if name.endswith("_rows"):
            raise DwarfStarError(f"{name} are paged: read them with rows(), address them through row_pages()")
        return self.parts(il)[name][self.index]

    def write(self, il: int, name: str, value: Any, lo: int = 0) -> None:
        """Store rows lo.. of a part (an assignment into the block, which MLX arrays need)."""
        if name.endswith("_rows"):
            self._write_rows(il, name.removesuffix("_rows"), value, lo)
        else:
            self.parts(il)[name][self.index, lo : lo + value.shape[0]] = value

    def row_pages(self, ratio: int) -> RowPages:
        """The page tables of the state's block for the rows of `ratio` (index them with `index`)."""
        return self.cache.pages[self.slot[0]][ratio]

    def reserve(self, start: int, end: int) -> None:
        """Pages of the state's own under every row tokens start..end-1 write: the rows they
        complete and the row in progress, which a batched decode step writes unseen. A page shared
        with another state (a fork) is copied first, in every layer of its ratio."""
        with self.cache.lock:  # until the copies are made: a shared page is freed once its last holder goes
            for ratio, compressors in self.cache.ratios.items():
                copies = self.row_pages(ratio).make_writable(self.index, start // ratio, (end - 1) // ratio + 1)
                if copies:
                    parts = self.cache.blocks[self.slot[0]]
                    for il, kind in compressors:
                        pool = parts[il][f"{kind}_rows"]
                        for shared, own in copies:
                            pool[own] = pool[shared]

    def _write_rows(self, il: int, kind: str, value: Any, lo: int) -> None:
        spec = self.cache.compressors[il][kind]
        hi = lo + value.shape[0]
        if hi == lo:
            return
        self.reserve(lo * spec.ratio, hi * spec.ratio)
        pages, offsets = self.row_pages(spec.ratio).locate(self.index, np.arange(lo, hi))
        self.cache.storage.put_rows(self.parts(il)[f"{kind}_rows"], pages, offsets, value)

    def compressor(self, il: int, kind: str) -> CompressorSpec | None:
        return self.cache.compressors[il].get(kind)

    @property
    def n_raw(self) -> int:
        return min(self.pos, self.cache.args.window)

    def raw_window(self, il: int, end: int | None = None) -> Any:
        """The raw rows before position `end` (default: pos) still in the window, oldest first."""
        end = self.pos if end is None else end
        window, ring = self.cache.args.window, self.part(il, "raw")
        if end <= window:
            return ring[:end]
        cut = end % window
        return ring if cut == 0 else self.cache.storage.cat((ring[cut:], ring[:cut]))

    def store_window(self, il: int, rows: Any, end: int) -> None:
        """Put the rows of the positions just before `end` (oldest first; only the last `window`
        are kept) into the ring, where position p lives in row p mod window."""
        window = self.cache.args.window
        rows = rows[-window:]
        lo = (end - rows.shape[0]) % window
        first = min(rows.shape[0], window - lo)
        self.write(il, "raw", rows[:first], lo)
        if first < rows.shape[0]:
            self.write(il, "raw", rows[first:], 0)

    def rows(self, il: int, kind: str, end: int | None = None) -> Any:
        """The compressed rows emitted by the tokens before position `end` (default: pos), gathered
        from their pages [n, dim]."""
        spec = self.cache.compressors[il][kind]
        n = (self.pos if end is None else end) // spec.ratio
        pages, offsets = self.row_pages(spec.ratio).locate(self.index, np.arange(n))
        return self.cache.storage.take_rows(self.parts(il)[f"{kind}_rows"], pages, offsets)

    def host_parts(self, il: int) -> dict[str, np.ndarray]:
        """Layer il's live contents on the host, float32: `raw` oldest first, each compressor's rows
        and frontier (for comparing states across backends)."""
        to_numpy = self.cache.storage.to_numpy
        out = {"raw": to_numpy(self.raw_window(il))}
        for kind in self.cache.compressors[il]:
            out[f"{kind}_rows"] = to_numpy(self.rows(il, kind))
            out[f"{kind}_kv"], out[f"{kind}_gate"] = (
                to_numpy(self.part(il, f"{kind}_kv")),
                to_numpy(self.part(il, f"{kind}_gate")),
            )
        return out

    # -- snapshots ---------------------------------------------------------------------------------------
    def snapshot(self) -> StateSnapshot:
        """Copy the small fixed-size parts; the append-only rows are shared by position."""
        copy = self.cache.storage.copy
        layers = {
            il: {name: copy(self.part(il, name)) for name in parts if not name.endswith("_rows")}
            for il, parts in self.cache.blocks[self.slot[0]].items()
        }
        logits = None if self.logits is None else self.logits.clone()
        return StateSnapshot(self.serial, self.pos, list(self.tokens), logits, layers, len(self.rewinds))

    def can_restore(self, snap: StateSnapshot) -> bool:
        """The snapshot is of this state (or of the one it was forked from, up to the fork) and no
        later rewind went below a row it reads."""
        if snap.serial != self.serial and snap.pos > self.ancestors.get(snap.serial, -1):
            return False
        ratios = {spec.ratio for il in self.cache.layers for spec in self.cache.compressors[il].values()}
        return all(p // r >= snap.pos // r for p in self.rewinds[snap.epoch :] for r in ratios)

    def restore(self, snap: StateSnapshot) -> None:
        """Return to the snapshot; snapshots of this state taken after a rewound point are refused."""
        if not self.can_restore(snap):
            raise ValueError(
                "snapshot is no longer valid: it is of another state, or this one was rewound before it and overwritten"
            )
        for il, parts in snap.layers.items():
            for name, a in parts.items():
                self.write(il, name, a)
        if snap.pos < self.pos:
            self.rewinds.append(snap.pos)
        self.pos = snap.pos
        self.tokens = list(snap.tokens)
        self.logits = None if snap.logits is None else snap.logits.clone()

    def __deepcopy__(self, memo: dict) -> SequenceState:
        """A fork: a new slot of the same cache holding the same sequence (the cache is not copied).
        Its compressed rows are its parent's pages, shared until one of them writes there (a twin
        the cache had to put in another block, whose pool is another array, gets copies). The twin
        still restores this state's snapshots up to the fork, so a forked session keeps its
        checkpoints."""
        twin = SequenceState(self.cache, near=self.slot[0])
        self.fork_into(twin)
        return twin

    def fork_into(self, twin: SequenceState) -> None:
        """Make the fresh state `twin` (a slot of this cache) hold this state's sequence."""
        twin.rewinds, twin.ancestors = list(self.rewinds), {**self.ancestors, self.serial: self.pos}
        for il in self.cache.layers:
            SequenceState.write(twin, il, "raw", SequenceState.part(self, il, "raw"))
            for kind in self.cache.compressors[il]:
                for name in (f"{kind}_kv", f"{kind}_gate"):
                    SequenceState.write(twin, il, name, SequenceState.part(self, il, name))
        for ratio, compressors in self.cache.ratios.items():
            if twin.slot[0] == self.slot[0]:
                with self.cache.lock:
                    self.row_pages(ratio).share(self.index, twin.index, self.pos // ratio)
                continue
            for il, kind in compressors:
                rows = SequenceState.rows(self, il, kind)
                if rows.shape[0]:
                    SequenceState.write(twin, il, f"{kind}_rows", rows)
        twin.pos, twin.tokens = self.pos, list(self.tokens)
        twin.logits = None if self.logits is None else self.logits.clone()

    def nbytes(self) -> int:
        """Bytes the sequence uses: raw window, frontiers, logits, and its row pages, a page shared
        with other states counted as its share (so the states of a cache sum to the pages in use)."""
        storage = self.cache.storage
        total = 0 if self.logits is None else self.logits.numel() * self.logits.element_size()
        elements = self.n_raw * self.cache.args.head_dim * len(self.cache.layers)
        for il in self.cache.layers:
            for spec in self.cache.compressors[il].values():
                rows, cols = spec.frontier_shape
                elements += 2 * rows * cols
        for ratio, compressors in self.cache.ratios.items():
            specs = (self.cache.compressors[il][kind] for il, kind in compressors)
            row = sum(storage.row_nbytes(spec.dim, spec.exact_dims) for spec in specs)
            total += round(self.row_pages(ratio).share_of(self.index) * PAGE_ROWS * row)
        return total + elements * storage.element_size


@dataclass
class StateSnapshot:
    serial: int  # the state it was taken of
    pos: int
    tokens: list[int]
    logits: torch.Tensor | None
    layers: dict[int, dict[str, Any]] = field(repr=False)  # per held layer: raw ring and frontier copies
    epoch: int = 0  # how many rewinds the state had made when it was taken

    def nbytes(self) -> int:
        """Bytes of its own copies (raw rings, frontiers, logits); the rows it reads are the state's."""
        own = sum(int(a.nbytes) for parts in self.layers.values() for a in parts.values())
        return own + (0 if self.logits is None else int(self.logits.nbytes))


def check_batch(
    token_lists: Sequence[Sequence[int] | torch.Tensor],
    states: Sequence[SequenceState],
    vocab_size: int,
    max_seq_len: int,
    images: Sequence[tuple[ImageSpan, ...]] | None = None,
) -> list[torch.Tensor]:
    """Validate a batched forward before any state changes: each sequence's tokens as a 1-D long tensor.

    Every backend runs this, so a context overflow or an out-of-vocabulary id is the same clear error
    everywhere, and a failed batch leaves every state untouched. `images`: each sequence's image spans
    (`dwarfstar.model.image_spans`), whose positions hold image ids (past the vocabulary: `content_ids`),
    allowed there only; each span lies wholly inside its call.
    """
    chunks = [torch.as_tensor(t, dtype=torch.long).flatten() for t in token_lists]
    if len(chunks) != len(states):
        raise DwarfStarError(f"{len(chunks)} token lists for {len(states)} states")
    images = [()] * len(chunks) if images is None else list(images)
    if len(images) != len(chunks):
        raise DwarfStarError(f"{len(images)} image span lists for {len(chunks)} token lists")
    if len({id(s) for s in states}) != len(states):
        raise DwarfStarError("a sequence state appears twice in one batch")
    for tokens, state, spans in zip(chunks, states, images, strict=True):
        limit = min(max_seq_len, state.cache.ctx)
        if state.pos + tokens.numel() > limit:
            raise ContextOverflowError(
                f"context overflow: {state.pos} + {tokens.numel()} tokens exceed the context of {limit}"
            )
        check_ids(tokens, tuple(spans), vocab_size)
    return chunks
