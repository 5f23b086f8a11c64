"""Batch invariance of the Triton kernels' exact form (issue 37): a decode row's output has the same
bits whether it runs alone or beside other rows, as the reference backend's (tests/test_batch_invariance.py).

The GEMV with the GPU's plans (the interpreter runs them: the vector path and the split-K tickets),
sized for one multiprocessor so that the split of a small weight is what would change with the rows;
the decode attention with 4 interpreter multiprocessors, where a batch of four used to take fewer
splits of its key blocks than one sequence alone. The whole model's batched steps are compared with
sequences decoded alone in tests/triton/test_model.py.
"""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.triton.kernels import attention as at
from dwarfstar.backends.triton.kernels import qmatmul as qm
from dwarfstar.backends.triton.runtime import PagedRows
from dwarfstar.backends.triton.weights import QWeight
from dwarfstar.gguf.constants import GGMLType as T
from dwarfstar.gguf.quantize import quantize


@pytest.mark.parametrize(("ggml_type", "n", "k"), [(T.F16, 12, 4096), (T.Q8_0, 24, 2048)])
def test_gemv_rows_do_not_depend_on_their_company(ggml_type, n, k, device, monkeypatch):
    monkeypatch.setattr(qm, "interpreting", lambda: False)  # the GPU's plans, run by the interpreter
    monkeypatch.setattr(qm, "warp_size", lambda: 32)
    g = torch.Generator().manual_seed(37)
    values = torch.randn(n, k, generator=g) / k**0.5
    w = QWeight.from_bytes(torch.from_numpy(quantize(values, ggml_type)), ggml_type, (n, k), device)
    x = torch.randn(8, k, generator=g).to(device)
    plans = {m: qm.gemv_plan(m, n, k, ggml_type, sms=1) for m in (1, 3, 8)}
    alone = torch.cat([qm.gemv(x[i : i + 1], [w], plans=[plans[1]]) for i in range(8)])
    for m in (3, 8):
        assert torch.equal(qm.gemv(x[:m], [w], plans=[plans[m]]), alone[:m]), m


def test_decode_attention_rows_do_not_depend_on_their_company(device):
    """Sequence 0 (ratio-128 rows, 300 positions in) alone, beside three others at other positions
    whose visible rows reach further, and through the chunk form of one decode token."""
    g = torch.Generator().manual_seed(4)
    heads, d, rope, window, ratio, slots = 4, 64, 16, 16, 128, 4
    pos = torch.tensor([300, 40, 2000, 1100], dtype=torch.int32, device=device)
    q = torch.randn(slots, heads, d, generator=g).to(device)
    rings = torch.randn(slots, window, d, generator=g).to(device)
    comp = PagedRows.scattered(torch.randn(slots, 64, d, generator=g).to(device), seed=1)
    sinks, inv = torch.randn(heads, generator=g).to(device), torch.rand(rope // 2, dtype=torch.float64).to(device)
    order = torch.arange(slots, dtype=torch.int32, device=device)

    def batch(b: int) -> torch.Tensor:
        bound = max(16, max(int(p) + 1 for p in pos[:b]) // ratio)
        out = at.attention_batch(q[:b], rings, sinks, inv, rope, pos[:b], order[:b], comp, bound, ratio)
        return out[0]

    alone = batch(1)
    assert torch.equal(batch(4), alone)
    p = int(pos[0])
    window_rows = rings[0][torch.arange(p - window + 1, p + 1) % window]  # oldest first, then the token's own
    own = PagedRows(comp.pool, comp.table[0])
    chunk = at.attention(q[:1], window_rows, window - 1, window, sinks, inv, rope, pos[:1], own, ratio, split=None,
                         comp_bound=16)  # fmt: skip
    assert torch.equal(chunk[0], alone)
