"""The per-sequence KV state of DeepSeek V4, in the layout ds4 saves (spec §3.2, DS4_SURFACE §4.1).

Per layer: the raw window of post-RoPE KV rows; for compressed layers the emitted rows and the
compressor frontier; for ratio-4 layers also the indexer rows and frontier. Plus the position, the
tokens and the next-token logits. Backends keep these tensors on their device; the session layer
snapshots, restores, saves and loads them without knowing which backend made them.

Frontier layout (as ds4 and the official code): ratio 4 keeps [8, 2*dim] rows of projected values
and gate logits (gate already includes the position bias); rows 0..3 hold the previous window,
whose first half feeds the next row (overlap), rows 4..7 the window in progress (row 4 + p mod 4).
Ratio 128 keeps [128, dim] rows, row p mod 128. Slots not yet written hold kv 0 and gate -inf, so
a softmax over them gives them weight 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dwarfstar.errors import ContextOverflowError, DwarfStarError
from dwarfstar.model.config import ModelArgs


class RowBuffer:
    """Append-only rows in a geometrically grown buffer.

    Snapshots record only the row count, so they share the buffer. Rewinding to a snapshot and
    appending overwrites the rows past it, which invalidates snapshots taken further along; `rewinds`
    remembers every rewind so such a stale snapshot is refused instead of silently reading new rows.
    """

    def __init__(self, dim: int, device: torch.device | str = "cpu", capacity: int = 16) -> None:
        self.data = torch.empty(capacity, dim, device=device)
        self.n = 0
        self.rewinds: list[int] = []

    @property
    def rows(self) -> torch.Tensor:
        return self.data[: self.n]

    def append(self, rows: torch.Tensor) -> None:
        need = self.n + rows.shape[0]
        if need > self.data.shape[0]:
            grown = torch.empty(max(need, 2 * self.data.shape[0]), self.data.shape[1], device=self.data.device)
            grown[: self.n] = self.data[: self.n]
            self.data = grown
        self.data[self.n : need] = rows
        self.n = need

    def mark(self) -> tuple[int, int]:
        return self.n, len(self.rewinds)

    def is_valid(self, mark: tuple[int, int]) -> bool:
        """A mark stays valid unless a later rewind went below it (its rows may since be overwritten)."""
        n, epoch = mark
        return all(r >= n for r in self.rewinds[epoch:])

    def rewind(self, mark: tuple[int, int]) -> None:
        if not self.is_valid(mark):
            raise ValueError("snapshot is no longer valid: the state was rewound before it and overwritten")
        n = mark[0]
        if n < self.n:
            self.rewinds.append(n)
        self.n = n

    def nbytes(self) -> int:
        return self.n * self.data.shape[1] * self.data.element_size()


@dataclass
class CompressorState:
    ratio: int
    dim: int  # width of an emitted row
    frontier_kv: torch.Tensor
    frontier_gate: torch.Tensor
    rows: RowBuffer

    @classmethod
    def empty(cls, ratio: int, dim: int, device: torch.device | str = "cpu") -> CompressorState:
        coff = 2 if ratio == 4 else 1
        return cls(
            ratio=ratio,
            dim=dim,
            frontier_kv=torch.zeros(coff * ratio, coff * dim, device=device),
            frontier_gate=torch.full((coff * ratio, coff * dim), float("-inf"), device=device),
            rows=RowBuffer(dim, device),
        )

    @property
    def overlap(self) -> bool:
        return self.ratio == 4

    @property
    def current_offset(self) -> int:
        """First frontier row of the window in progress (after the previous window for ratio 4)."""
        return self.ratio if self.overlap else 0


@dataclass
class LayerState:
    raw_kv: torch.Tensor  # [<= window, head_dim], oldest first
    compressor: CompressorState | None
    indexer: CompressorState | None


@dataclass
class SequenceState:
    layers: list[LayerState]
    pos: int = 0
    tokens: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # next-token logits after the last token

    @classmethod
    def empty(cls, args: ModelArgs, device: torch.device | str = "cpu") -> SequenceState:
        layers = []
        for layer in args.layers:
            r = layer.compress_ratio
            layers.append(
                LayerState(
                    raw_kv=torch.empty(0, args.head_dim, device=device),
                    compressor=CompressorState.empty(r, args.head_dim, device) if r else None,
                    indexer=CompressorState.empty(r, args.index_head_dim, device) if layer.has_indexer else None,
                )
            )
        return cls(layers=layers)

    def snapshot(self) -> StateSnapshot:
        """Copy the small fixed-size parts; the growing row buffers are shared by row count."""
        layers = []
        for layer in self.layers:
            parts = [layer.raw_kv.clone()]
            for comp in (layer.compressor, layer.indexer):
                parts.append(
                    None if comp is None else (comp.frontier_kv.clone(), comp.frontier_gate.clone(), comp.rows.mark())
                )
            layers.append(tuple(parts))
        logits = None if self.logits is None else self.logits.clone()
        return StateSnapshot(pos=self.pos, tokens=list(self.tokens), logits=logits, layers=layers)

    def can_restore(self, snap: StateSnapshot) -> bool:
        return all(
            comp.rows.is_valid(saved[2])
            for layer, (_raw, *comps) in zip(self.layers, snap.layers, strict=True)
            for comp, saved in zip((layer.compressor, layer.indexer), comps, strict=True)
            if comp is not None
        )

    def restore(self, snap: StateSnapshot) -> None:
        """Return to the snapshot; snapshots of this state taken after a rewound point are refused."""
        if not self.can_restore(snap):
            raise ValueError("snapshot is no longer valid: the state was rewound before it and overwritten")
        for layer, (raw, *comps) in zip(self.layers, snap.layers, strict=True):
            layer.raw_kv = raw.clone()
            for comp, saved in zip((layer.compressor, layer.indexer), comps, strict=True):
                if comp is not None:
                    comp.rows.rewind(saved[2])
                    comp.frontier_kv, comp.frontier_gate = saved[0].clone(), saved[1].clone()
        self.pos = snap.pos
        self.tokens = list(snap.tokens)
        self.logits = None if snap.logits is None else snap.logits.clone()

    def nbytes(self) -> int:
        """Bytes held by the KV state (raw windows, rows, frontiers, logits), not counting spare capacity."""
        total = 0 if self.logits is None else self.logits.numel() * self.logits.element_size()
        for layer in self.layers:
            total += layer.raw_kv.numel() * layer.raw_kv.element_size()
            for comp in (layer.compressor, layer.indexer):
                if comp is not None:
                    total += comp.rows.nbytes() + 2 * comp.frontier_kv.numel() * comp.frontier_kv.element_size()
        return total


@dataclass
class StateSnapshot:
    pos: int
    tokens: list[int]
    logits: torch.Tensor | None
    layers: list[tuple]


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
        if state.pos + tokens.numel() > max_seq_len:
            raise ContextOverflowError(
                f"context overflow: {state.pos} + {tokens.numel()} tokens exceed the context of {max_seq_len}"
            )
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
        if bad.numel():
            raise DwarfStarError(f"token id {int(bad[0])} is outside the vocabulary (0..{vocab_size - 1})")
    return chunks
