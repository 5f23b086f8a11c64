"""The experts of a layer's MoE on the kernels, shared by V4 (`model.TritonOps.moe`) and V4.1
(`v41.ops.TritonOps41.moe`): each row's k routed experts (weighted) plus the shared expert, summed.

A `--cpu-moe` layer's routed experts run on the host's CPU kernels instead (`host_ffn`), beside the
shared expert on the device.

Two forms: the decode form (`moe_experts.decode_ffn`: gate+up, then down with the sum, two launches
per DECODE_TOKENS rows) and the prefill form (rows sorted by expert into tiles, `moe_sort`, then the
routed slots and the shared expert written as k + 1 parts and summed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dwarfstar.backends.triton.kernels import moe_experts, moe_sort
from dwarfstar.backends.triton.kernels.expert_int8 import Q8Rows
from dwarfstar.backends.triton.runtime import Precision
from dwarfstar.backends.triton.weights import QWeight

if TYPE_CHECKING:
    from dwarfstar.backends.cpu.experts import HostExperts

Experts = tuple[QWeight, QWeight, QWeight]  # gate, up, down


def experts_ffn(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    routed: Experts,
    shared: Experts,
    limit: float,
    precision: Precision,
    decode: Precision | None,
    xq: Q8Rows | None = None,
) -> torch.Tensor:
    """[T, D]: rows x [T, D] through their routed experts (slots int32 [T, k] into `routed`, route
    weights [T, k]) and the shared expert, the clamped SwiGLU at `limit`. `decode`: the decode form's
    precision (None: the prefill form, in `precision`); `xq` the decode form's int8 rows of x where
    the routing launch wrote them."""
    t, k = slots.shape
    if decode is not None:
        n = moe_experts.DECODE_TOKENS
        parts = [
            moe_experts.decode_ffn(x[r], slots[r], weights[r], routed, shared, limit, decode, xq=xq)
            for r in (slice(i, i + n) for i in range(0, t, n))
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    gate, up, down = routed
    dim = down.expert_rows
    tiles = moe_sort.sort_by_expert(slots, gate.experts, moe_sort.tile_rows_for(t * k, gate.experts, _tile(precision)))
    # k routed slots and the shared expert, summed once all are written
    out = torch.empty(t, k + 1, dim, device=x.device)
    moe_experts.expert_ffn(x, gate, up, down, tiles, weights.view(-1), out, 0, limit, precision)
    _shared_into(out, k, x, shared, limit, precision)
    return out.sum(1)


def host_ffn(
    host: HostExperts,
    il: int,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    shared: Experts,
    limit: float,
    precision: Precision,
) -> torch.Tensor:
    """[T, D]: layer il's routed experts of rows x (ids [T, k], route weights [T, k]) on the host's CPU
    kernels, plus the shared expert on the device. The inputs leave first, so the device computes the
    shared expert while the host computes the routed ones."""
    sent = host.send(x, ids, weights)
    part = torch.empty(x.shape[0], 1, x.shape[1], device=x.device)
    _shared_into(part, 0, x, shared, limit, precision)
    return part[:, 0] + host.receive(il, sent)


def _tile(precision: Precision) -> int:
    """Rows a tile of the prefill form: fp32 operands take twice the registers and shared memory."""
    return 64 if precision.fast else 32


def _shared_into(
    out: torch.Tensor, column: int, x: torch.Tensor, shared: Experts, limit: float, precision: Precision
) -> None:
    """The shared expert of rows x [T, D] written into out[:, column] (out [T, parts, D])."""
    t = x.shape[0]
    tiles = moe_sort.single_expert_tiles(t, x.device, moe_sort.tile_rows_for(t, 1, _tile(precision)))
    moe_experts.expert_ffn(x, *shared, tiles, None, out, column, limit, precision)
