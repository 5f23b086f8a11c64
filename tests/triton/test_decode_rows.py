"""A decode step's rows in one launch (query norm, KV ring row, both compressors) against the reference ops."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels import decode_rows as dr
from dwarfstar.backends.triton.runtime import PagedRows
from dwarfstar.model.config import ModelArgs, yarn_inv_freq
from dwarfstar.model.numerics import rope_angles
from dwarfstar.model.state import CompressorSpec

QL, DIM, ROPE, WINDOW, INDEX_DIM, CAPACITY = 32, 128, 32, 8, 64, 128


def rounded_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """QAT-rounded rows: equal to 1e-4 except the rare element whose rounding flipped by one step."""
    off = (a - b).abs() > 1e-4 * (1 + b.abs())
    return a.shape == b.shape and off.float().mean().item() < 0.02


def compressing(kind: str, ratio: int, dim: int, b: int, n_slots: int, qat: bool, gen, device) -> dr.Compressing:
    spec = CompressorSpec(kind, ratio, dim)
    width = spec.frontier_shape[1]
    both = torch.randn(b, 2 * width + 5, generator=gen)  # kv and gate as column slices of one wider buffer
    front = (n_slots, *spec.frontier_shape)
    frontier_gate = 2 * torch.randn(front, generator=gen)
    frontier_gate[0, :ratio] = float("-inf")  # slot 0: before its first window, as a new sequence has it
    exact = (dim - ROPE if kind == "attn" else dim) if qat else 0
    rows = PagedRows.scattered(torch.zeros(n_slots, CAPACITY, dim, device=device), seed=ratio, exact_dims=exact)
    tensors = (both[:, :width], both[:, width : 2 * width], 0.5 * torch.randn(ratio, width, generator=gen),
               1 + 0.1 * torch.randn(dim, generator=gen), torch.randn(front, generator=gen), frontier_gate)  # fmt: skip
    return dr.Compressing(*(t.to(device) for t in tensors), rows)


def paged_row(rows: PagedRows, slot: int, row: int) -> torch.Tensor:
    page = int(rows.table[slot, row // 64])
    pool = rows.pool if isinstance(rows.pool, torch.Tensor) else rows.pool.float()
    return pool[page, row % 64].float().cpu()


@pytest.mark.parametrize(
    "ratio,positions,qat",
    [
        (4, [7, 3, 43, 20], True),  # windows 1, 0 and 10 complete; 20 starts window 5; compact rows
        (128, [127, 300, 0, 255], True),  # the first row and the second; mid-window; the first token
        (4, [11, 6, 0, 3], False),  # float32 rows, no rounding
        (0, [5, 300, 9, 1], True),  # a window-only layer: the query and KV rows alone
    ],
)
def test_rows_match_the_reference_ops(ratio, positions, qat, device):
    """Four sequences at their own positions in shuffled slots of a block, one launch: some tokens
    complete a window and write a row into a page of a shuffled pool, the others only fill their
    frontier slot; every ring, frontier and row equals the reference's, the other slots untouched."""
    gen = torch.Generator().manual_seed(ratio + len(positions) + qat)
    b, n_slots, slots = len(positions), 5, [3, 0, 4, 1]
    args = ModelArgs.flash().with_(rope_dim=ROPE)
    inv = torch.tensor(yarn_inv_freq(args, args.layer(2 if ratio else 0)), dtype=torch.float64)
    q_a, kv = torch.randn(b, QL + 3, generator=gen)[:, :QL], torch.randn(b, DIM, generator=gen)
    q_norm, kv_norm = 1 + 0.1 * torch.randn(QL, generator=gen), 1 + 0.1 * torch.randn(DIM, generator=gen)
    rings = torch.randn(n_slots, WINDOW, DIM, generator=gen)
    attn = compressing("attn", ratio, DIM, b, n_slots, qat, gen, device) if ratio else None
    indexer = compressing("indexer", 4, INDEX_DIM, b, n_slots, qat, gen, device) if ratio == 4 else None
    before = {name: c.frontier_kv.clone() for name, c in (("attn", attn), ("indexer", indexer)) if c is not None}
    wanted = {}
    for name, comp in (("attn", attn), ("indexer", indexer)):
        if comp is not None:
            spec = CompressorSpec(name, ratio, comp.norm.shape[0])
            wanted[name] = dr.reference_compress(spec, comp, positions, slots, inv, ROPE, 1e-6, qat)
    pos, slot = (torch.tensor(v, dtype=torch.int32, device=device) for v in (positions, slots))
    dev = (q_a.to(device), q_norm.to(device), kv.to(device), kv_norm.to(device), rings.to(device))
    qr = dr.decode_rows(pos, slot, inv.to(device), *dev[:4], dev[4], ratio, ROPE, 1e-6, qat, attn, indexer)
    torch.testing.assert_close(qr.cpu(), ops.rms_norm(q_a, q_norm, 1e-6), rtol=1e-6, atol=1e-6)
    cos, sin = rope_angles(torch.tensor(positions), inv)
    want_kv = ops.apply_rope(ops.rms_norm(kv, kv_norm, 1e-6), cos, sin)
    want_kv = ops.fp8_round_nope(want_kv, ROPE) if qat else want_kv
    ring = dev[4].cpu()
    for i, (p, s) in enumerate(zip(positions, slots, strict=True)):
        assert rounded_close(ring[s, p % WINDOW], want_kv[i])
        others = [r for r in range(WINDOW) if r != p % WINDOW]
        assert torch.equal(ring[s, others], rings[s, others])  # the rest of the ring is kept
    assert torch.equal(ring[2], rings[2])  # a slot of the block outside the batch
    for name, comp in (("attn", attn), ("indexer", indexer)):
        if comp is None:
            continue
        rows, done, front_kv, front_gate = wanted[name]
        r = comp.ape.shape[0]
        assert done.tolist() == [(p + 1) % r == 0 for p in positions] and done.any()
        torch.testing.assert_close(comp.frontier_kv[slots].cpu(), front_kv, rtol=0, atol=0)
        torch.testing.assert_close(comp.frontier_gate[slots].cpu(), front_gate, rtol=0, atol=0)
        assert torch.equal(comp.frontier_kv[2].cpu(), before[name][2].cpu())
        for i, (p, s) in enumerate(zip(positions, slots, strict=True)):
            got = paged_row(comp.rows, s, p // r)
            if done[i]:
                assert rounded_close(got, rows[i]), (name, p)
                torch.testing.assert_close(got, rows[i], rtol=1e-3, atol=2e-2 if qat else 1e-5)
            else:
                assert not got.any()  # a row is written only when its window completes
