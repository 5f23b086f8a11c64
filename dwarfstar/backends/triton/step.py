"""The record of one call as `TritonOps` runs it (`TritonOps.prepare`, or `record` for a captured decode
step): its device inputs, and what its steps of a layer hand on to later ones (`Ops.prepare`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dwarfstar.backends.triton.kernels import decode_rows
from dwarfstar.backends.triton.kernels.expert_int8 import Q8Rows
from dwarfstar.backends.triton.runtime import Precision


@dataclass(frozen=True, slots=True)
class DecodeInputs:
    """The device inputs of a batch-native decode step (`model.decode_batch`), its only ones besides the
    tokens: every attention-side kernel serves all its sequences in one launch and forms its RoPE
    angles from `pos` (no tables). A captured step presets them to its graph's buffers."""

    pos: torch.Tensor  # int32 [B]: each sequence's position
    slots: torch.Tensor  # int32 [B]: each sequence's slot in the cache block
    # ratio -> the compressed rows the grids cover (`row_bound`), fixed by a captured step for every
    # replay; None: the widest of the sequences' own
    row_bound: dict[int, int] | None = None


@dataclass(slots=True)
class PendingRows:
    """A batch-native decode step's inputs to one layer's rows launches, waiting for them (`TritonOps._decode_rows`)."""

    # the raw KV row as projected: `write_window` leaves it, the low-rank query's launch finishes it into the ring
    kv: torch.Tensor | None = None
    # compressor kind -> its inputs: `compress` leaves them, the low-rank query's launch advances them
    compressing: dict[str, decode_rows.Compressing] = field(default_factory=dict)
    # (the query heads as projected, their output): `norm_rope` of the query leaves them in a ratio-4
    # layer, that of the indexer query fills both in one launch
    query: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def waiting(self) -> bool:
        return self.kv is not None or bool(self.compressing) or self.query is not None


@dataclass(frozen=True, slots=True)
class TritonStep:
    """One call as `TritonOps` runs it (`TritonOps.prepare`, or `record` for a captured step), and what its steps
    of a layer hand on."""

    # int32 [N]: every row's id for the tables looked up by id (the embedding, hash-routed layers'
    # experts), on the device; 0 at image-span positions, whose ids are past the tables
    tok: torch.Tensor
    precision: Precision  # the matrices': bf16 tensor-core operands pay off only for prefill-sized calls
    # one token per sequence, at most TICKET_SLOTS: the mHC steps and the routing run one launch each
    # (a prefill chunk keeps their GEMV and kernel, and their numerics)
    fused: bool
    # a batch-native decode step's inputs; None: attention, the compressors and the indexer run per sequence
    decode: DecodeInputs | None
    # per sequence (without `decode`): its first position, int32 [1] on the device
    starts: list[torch.Tensor] = field(default_factory=list)
    # the call's image-span rows, int64 [n] on the device (`embed` puts the spans' rows there, `route`
    # routes them by the image bias), or None in a call without spans
    image: torch.Tensor | None = None
    # sequence's index in the batch -> its queries' window rows (`image_spans.window_reach`), int32
    # [T, 2] on the device, for each sequence with a bidirectional image span (the others' are causal)
    reach: dict[int, torch.Tensor] = field(default_factory=dict)
    # without `decode`: RoPE cos/sin at every row's position per (rope_theta, yarn), for `norm_rope`
    angles: dict[tuple[float, bool], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # layer -> per sequence (without `decode`) its window rows [n_prev + T], oldest first:
    # `write_window` leaves them, `sparse_attention` takes them
    window: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    # layer -> inputs waiting for the layer's rows launches (with `decode`): `write_window`, `compress`
    # and `norm_rope` leave them, `norm_rope` takes them, `sparse_attention` checks none is left
    pending: dict[int, PendingRows] = field(default_factory=dict)
    # layer -> `route`'s input and the int8 rows its launch quantized it to, for a fused step whose
    # experts read int8: `route` leaves them, `moe` takes them
    routed: dict[int, tuple[torch.Tensor, Q8Rows]] = field(default_factory=dict)
