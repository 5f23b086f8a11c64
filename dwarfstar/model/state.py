"""The per-sequence KV state of DeepSeek V4: slots of a backend-owned cache, and handles on them.

What a sequence keeps (spec §3.2, DS4_SURFACE §4.1), per layer: the raw window of post-RoPE KV
rows; for compressed layers the emitted rows and the compressor frontier; for ratio-4 layers also
the indexer rows and frontier. Plus the position, the tokens and the next-token logits.

Frontier layout (as ds4 and the official code): ratio 4 keeps [8, 2*dim] rows of projected values
and gate logits (gate already includes the position bias); rows 0..3 hold the previous window,
whose first half feeds the next row (overlap), rows 4..7 the window in progress (row 4 + p mod 4).
Ratio 128 keeps [128, dim] rows, row p mod 128. Slots not yet written hold kv 0 and gate -inf, so
a softmax over them gives them weight 0.

Storage. `KVCache` holds each part of each layer for a block of sequences in one preallocated array,
`[slots, ...]`: the raw window is a ring of `window` rows (position p in row p mod window), the row
parts have a fixed capacity for the context (ctx // ratio, rounded up to `ROW_STEP`), the frontiers
their fixed shapes. A pipeline stage's cache holds only its layers (`layers`, a range of the
model's): parts are keyed by the global layer index, so a layer's arrays have one name on every
stage, and the other layers have no arrays at all. When every slot is taken a new block is added, so
the arrays of a live slot never move or grow: kernels write rows by index, and a captured decode
step keeps its addresses. The backend picks the arrays through `Storage` (torch on its device, or
MLX arrays), and their precision: the reference and MLX keep float32; a compact `TorchStorage`
(Triton with QAT rounding) keeps each row part's QAT-rounded dims, exactly representable in bf16, in
bf16 (`SplitRows` when the RoPE dims, which are not rounded, stay float32). Every reader gets the
float32 values, so payloads are the same bytes whichever layout held them.

Handle. `SequenceState` is a slot plus pos, tokens and logits; the slot returns to its cache when
the handle is dropped. A ratio-r layer has emitted pos // r rows, so no row counts are kept.
Snapshots copy the small fixed parts (raw ring, frontiers, logits) and share the rows, which are
append-only; `rewinds` remembers where the state was rewound to, so a snapshot taken further along,
whose rows may since have been overwritten, is refused instead of read.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from dwarfstar.errors import ContextOverflowError, DwarfStarError
from dwarfstar.model.config import ModelArgs

# Row capacities are multiples of 64: Triton specialises kernels on integer arguments divisible by
# 16, so every slot's row arrays share one compiled variant whatever the context.
ROW_STEP = 64
KINDS = ("attn", "indexer")  # the compressors: the attention's rows, and the indexer's (ratio-4 layers)


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

    def index_copy_(self, index: torch.Tensor, value: torch.Tensor) -> None:
        """Rows `value` [n, dim] into rows `index` of the flattened leading dims."""
        e = self.exact.shape[-1]
        self.exact.view(-1, e).index_copy_(0, index, value[:, :e].to(self.exact.dtype))
        self.rest.view(-1, self.rest.shape[-1]).index_copy_(0, index, value[:, e:])

    def zero_(self) -> SplitRows:
        self.exact.zero_()
        self.rest.zero_()
        return self

    def float(self) -> torch.Tensor:
        return torch.cat((self.exact.float(), self.rest), dim=-1)


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
        self.blocks: list[dict[int, dict[str, Any]]] = []  # block -> global layer -> part name -> [slots, ...]
        self.free: list[tuple[int, int]] = []
        self._serial = itertools.count()

    def capacity(self, ratio: int) -> int:
        """Rows a slot holds at `ratio`: every row of a full context, plus the row in progress, which a
        batched decode step writes (unseen) at pos // ratio whether or not its window completes."""
        return -(-(self.ctx // ratio + 1) // ROW_STEP) * ROW_STEP

    def _add_block(self) -> None:
        a, n, full = self.args, self.block_slots, self.storage.full
        block = {}
        for il in self.layers:
            # left undefined like the rows (and a reused slot holds its last owner's): a reader of
            # rows it has not written masks them itself (the reference decode step zeroes them)
            parts = {"raw": full((n, a.window, a.head_dim), None)}
            for kind, spec in self.compressors[il].items():
                parts[f"{kind}_rows"] = self.storage.rows((n, self.capacity(spec.ratio), spec.dim), spec.exact_dims)
                parts[f"{kind}_kv"] = full((n, *spec.frontier_shape), 0.0)
                parts[f"{kind}_gate"] = full((n, *spec.frontier_shape), float("-inf"))
            block[il] = parts
        self.blocks.append(block)
        b = len(self.blocks) - 1
        self.free.extend((b, i) for i in reversed(range(n)))

    def acquire(self) -> tuple[int, int]:
        """A free slot (block, index) with empty frontiers."""
        if not self.free:
            self._add_block()
        block, index = slot = self.free.pop()
        for il, layer in self.blocks[block].items():
            for kind in self.compressors[il]:
                layer[f"{kind}_kv"][index] = 0.0
                layer[f"{kind}_gate"][index] = float("-inf")
        return slot

    def release(self, slot: tuple[int, int]) -> None:
        self.free.append(slot)

    @property
    def slots_in_use(self) -> int:
        return len(self.blocks) * self.block_slots - len(self.free)

    def new_state(self) -> SequenceState:
        return SequenceState(self)


class SequenceState:
    """A sequence's slot in a `KVCache`, with its position, tokens and next-token logits."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.slot = cache.acquire()
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
        """This slot's array of a part: `raw` [window, head_dim] (a ring), `{kind}_rows` [capacity,
        dim], `{kind}_kv` / `{kind}_gate` (the frontier). Torch gives a view, written in place."""
        return self.parts(il)[name][self.index]

    def write(self, il: int, name: str, value: Any, lo: int = 0) -> None:
        """Store rows lo.. of a part (an assignment into the block, which MLX arrays need)."""
        self.parts(il)[name][self.index, lo : lo + value.shape[0]] = value

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
        """The compressed rows emitted by the tokens before position `end` (default: pos)."""
        spec = self.cache.compressors[il][kind]
        return self.part(il, f"{kind}_rows")[: (self.pos if end is None else end) // spec.ratio]

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
        The twin still restores this state's snapshots up to the fork, so a forked session keeps its
        checkpoints."""
        twin = SequenceState(self.cache)
        twin.rewinds, twin.ancestors = list(self.rewinds), {**self.ancestors, self.serial: self.pos}
        for il in self.cache.layers:
            twin.write(il, "raw", self.part(il, "raw"))
            for kind in self.cache.compressors[il]:
                for name in (f"{kind}_kv", f"{kind}_gate"):
                    twin.write(il, name, self.part(il, name))
                rows = self.rows(il, kind)
                if rows.shape[0]:
                    twin.write(il, f"{kind}_rows", rows)
        twin.pos, twin.tokens = self.pos, list(self.tokens)
        twin.logits = None if self.logits is None else self.logits.clone()
        return twin

    def nbytes(self) -> int:
        """Bytes the sequence uses (raw window, rows, frontiers, logits), not counting spare capacity."""
        storage = self.cache.storage
        total = 0 if self.logits is None else self.logits.numel() * self.logits.element_size()
        elements = self.n_raw * self.cache.args.head_dim * len(self.cache.layers)
        for il in self.cache.layers:
            for spec in self.cache.compressors[il].values():
                rows, cols = spec.frontier_shape
                elements += 2 * rows * cols
                total += (self.pos // spec.ratio) * storage.row_nbytes(spec.dim, spec.exact_dims)
        return total + elements * storage.element_size


@dataclass
class StateSnapshot:
    serial: int  # the state it was taken of
    pos: int
    tokens: list[int]
    logits: torch.Tensor | None
    layers: dict[int, dict[str, Any]] = field(repr=False)  # per held layer: raw ring and frontier copies
    epoch: int = 0  # how many rewinds the state had made when it was taken


def check_batch(
    token_lists: Sequence[Sequence[int] | torch.Tensor],
    states: Sequence[SequenceState],
    vocab_size: int,
    max_seq_len: int,
) -> list[torch.Tensor]:
    """Validate a batched forward before any state changes: each sequence's tokens as a 1-D long tensor.

    Every backend runs this, so a context overflow or an out-of-vocabulary id is the same clear error
    everywhere, and a failed batch leaves every state untouched.
    """
    chunks = [torch.as_tensor(t, dtype=torch.long).flatten() for t in token_lists]
    if len(chunks) != len(states):
        raise DwarfStarError(f"{len(chunks)} token lists for {len(states)} states")
    if len({id(s) for s in states}) != len(states):
        raise DwarfStarError("a sequence state appears twice in one batch")
    for tokens, state in zip(chunks, states, strict=True):
        limit = min(max_seq_len, state.cache.ctx)
        if state.pos + tokens.numel() > limit:
            raise ContextOverflowError(
                f"context overflow: {state.pos} + {tokens.numel()} tokens exceed the context of {limit}"
            )
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
        if bad.numel():
            raise DwarfStarError(f"token id {int(bad[0])} is outside the vocabulary (0..{vocab_size - 1})")
    return chunks
