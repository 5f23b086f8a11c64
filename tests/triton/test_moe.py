"""MoE routing, expert sort and the grouped expert FFN against the reference MoE math."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.triton.kernels import moe_experts, moe_route, moe_sort
from dwarfstar.backends.triton.weights import QWeight
from dwarfstar.gguf.constants import GGMLType as T
from dwarfstar.gguf.quantize import quantize


def weight(ggml_type, shape, device, quant_blocks, seed):
    rows, cols = int(torch.tensor(shape[:-1]).prod()), shape[-1]
    if ggml_type in (T.Q2_K, T.Q4_K, T.IQ2_XXS):
        raw = torch.from_numpy(quant_blocks(ggml_type, rows * cols // 256, seed))
    else:
        values = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) / cols**0.5
        raw = torch.from_numpy(quantize(values, ggml_type))
    return QWeight.from_bytes(raw, ggml_type, shape, device)


@pytest.mark.parametrize("hashed", [False, True])
def test_routing_matches_reference(hashed, device, quant_blocks):
    gen = torch.Generator().manual_seed(0)
    f = torch.randn(7, 256, generator=gen).to(device)
    router = weight(T.F16, (16, 256), device, quant_blocks, seed=1)
    bias = None if hashed else (0.5 * torch.randn(16, generator=gen)).to(device)
    tid2eid = torch.stack([torch.randperm(16, generator=gen)[:3] for _ in range(50)]).int().to(device)
    tokens = torch.randint(0, 50, (7,), generator=gen).to(device)
    args = (f, router, bias, tid2eid if hashed else None, tokens, 3, 1.5)
    ids, weights = moe_route.route(*args)
    want_ids, want_weights = moe_route.reference(*args)
    assert torch.equal(ids.long(), want_ids.long())
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights.sum(1), torch.full((7,), 1.5, device=device))


def test_sort_groups_entries_and_skips_empty_experts(device):
    ids = torch.tensor([[3, 0], [3, 5], [0, 3], [5, 3], [3, 0]], dtype=torch.int32, device=device)
    tiles = moe_sort.sort_by_expert(ids, n_experts=8, block_m=2)
    flat = ids.flatten().tolist()
    covered = []
    table = zip(tiles.tile_expert.tolist(), tiles.tile_start.tolist(), tiles.tile_rows.tolist(), strict=True)
    for e, start, rows in table:
        if e < 0:
            assert rows == 0
            continue
        assert 1 <= rows <= 2
        chunk = tiles.sorted_entries[start : start + rows].tolist()
        assert all(flat[j] == e for j in chunk)
        covered += chunk
    assert sorted(covered) == list(range(10))  # every entry once; experts 1, 2, 4, 6, 7 get no tile
    assert sorted({e for e in tiles.tile_expert.tolist() if e >= 0}) == [0, 3, 5]


@pytest.mark.parametrize("tokens", [1, 6, 40])  # decode (GEMV tiles) to prefill (tensor-core tiles)
def test_expert_ffn_matches_reference(tokens, device, quant_blocks):
    gen = torch.Generator().manual_seed(tokens)
    e, d, f, k = 8, 256, 256, 2
    x = torch.randn(tokens, d, generator=gen).to(device)
    gate = weight(T.IQ2_XXS, (e, f, d), device, quant_blocks, seed=2)
    up = weight(T.IQ2_XXS, (e, f, d), device, quant_blocks, seed=3)
    down = weight(T.Q2_K, (e, d, f), device, quant_blocks, seed=4)
    ids = torch.stack([torch.randperm(e - 1, generator=gen)[:k] for _ in range(tokens)]).int().to(device)  # 7 idle
    route_w = torch.rand(tokens, k, generator=gen).to(device)
    out = torch.full((tokens, k + 1, d), float("nan"), device=device)
    tiles = moe_sort.sort_by_expert(ids, e)
    moe_experts.expert_ffn(x, gate, up, down, tiles, route_w.flatten(), out, 0, 10.0)
    shared = [weight(T.Q8_0, (1, r, c), device, quant_blocks, seed=5 + i) for i, (r, c) in enumerate([(f, d)] * 2)]
    shared.append(weight(T.Q8_0, (1, d, f), device, quant_blocks, seed=7))
    moe_experts.expert_ffn(x, *shared, moe_sort.single_expert_tiles(tokens, device), None, out, k, 10.0)
    want = moe_experts.reference(x, gate, up, down, ids, route_w, 10.0)
    scale = want.abs().max()
    assert ((out[:, :k] - want).abs().max() / scale) < 1e-5
    want_shared = moe_experts.reference(x, *shared, None, None, 10.0)
    assert ((out[:, k:] - want_shared).abs().max() / want_shared.abs().max()) < 1e-5
