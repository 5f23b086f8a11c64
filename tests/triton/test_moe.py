"""MoE routing, expert sort and the grouped expert FFN against the reference MoE math."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.triton.kernels import moe_experts, moe_route, moe_sort
from dwarfstar.backends.triton.runtime import EXACT, FAST, ticket_counters
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


@pytest.mark.parametrize("tokens", [6, 40])  # prefill: GEMV tiles (few entries per expert), tensor-core tiles
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


# (gate/up, down, shared) block types: the q2 recipe with ds4's Q8_0 shared expert, the q4 recipe, and
# float types (the generic tile decoder); FAST runs the tensor-core form where a type has one
DECODE_CASES = [
    pytest.param((T.IQ2_XXS, T.Q2_K, T.Q8_0), EXACT, 1, id="q2-exact-1-token"),
    pytest.param((T.IQ2_XXS, T.Q2_K, T.Q8_0), EXACT, 3, id="q2-exact"),
    pytest.param((T.Q4_K, T.Q4_K, T.Q8_0), EXACT, 3, id="q4-exact"),
    pytest.param((T.F16, T.F32, T.BF16), EXACT, 2, id="float-exact"),
    pytest.param((T.IQ2_XXS, T.Q2_K, T.Q8_0), FAST, 3, id="q2-fast"),
    pytest.param((T.Q4_K, T.Q4_K, T.Q4_K), FAST, 3, id="q4-fast-shared-in-mma"),
]
# FAST rounds the activations (and the mid activations) to fp16: measured 2e-4 to 6e-4 of the
# largest output on these shapes, against 3e-7 for EXACT
FAST_TOLERANCE = 2e-3


@pytest.mark.parametrize("types,precision,tokens", DECODE_CASES)
def test_decode_ffn_matches_reference(types, precision, tokens, device, quant_blocks):
    gate_up, down_type, shared_type = types
    gen = torch.Generator().manual_seed(tokens)
    e, d, f, k = 8, 256, 256, 2
    x = torch.randn(tokens, d, generator=gen).to(device)
    gate = weight(gate_up, (e, f, d), device, quant_blocks, seed=2)
    up = weight(gate_up, (e, f, d), device, quant_blocks, seed=3)
    down = weight(down_type, (e, d, f), device, quant_blocks, seed=4)
    shared = [weight(shared_type, (1, f, d), device, quant_blocks, seed=5 + i) for i in range(2)]
    shared.append(weight(shared_type, (1, d, f), device, quant_blocks, seed=7))
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)]).int()
    if tokens > 1:
        ids[1, 1] = ids[0, 0]  # one expert chosen by two tokens, at different slots
    ids = ids.to(device)
    route_w = torch.rand(tokens, k, generator=gen).to(device)
    out = moe_experts.decode_ffn(x, ids, route_w, (gate, up, down), tuple(shared), 10.0, precision)
    want = moe_experts.reference(x, gate, up, down, ids, route_w, 10.0).sum(1)
    want += moe_experts.reference(x, *shared, None, None, 10.0)[:, 0]
    assert out.shape == (tokens, d)
    error = ((out - want).abs().max() / want.abs().max()).item()
    assert error < (FAST_TOLERANCE if precision.fast else 1e-5), error
    assert not ticket_counters(device, "experts", 1).any()  # back at 0: a replayed launch starts over
