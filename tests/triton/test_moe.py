"""MoE routing, expert sort and the grouped expert FFN against the reference MoE math."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.reference import ops
from dwarfstar.backends.triton.kernels import expert_int8, moe_experts, moe_route, moe_sort
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


# prefill: GEMV tiles (few entries per expert), tensor-core tiles; the q2 recipe's types and MXFP4
@pytest.mark.parametrize(
    ("tokens", "types"), [(6, (T.IQ2_XXS, T.Q2_K)), (40, (T.IQ2_XXS, T.Q2_K)), (40, (T.MXFP4, T.MXFP4))]
)
def test_expert_ffn_matches_reference(tokens, types, device, quant_blocks):
    gen = torch.Generator().manual_seed(tokens)
    e, d, f, k = 8, 256, 256, 2
    x = torch.randn(tokens, d, generator=gen).to(device)
    gate = weight(types[0], (e, f, d), device, quant_blocks, seed=2)
    up = weight(types[0], (e, f, d), device, quant_blocks, seed=3)
    down = weight(types[1], (e, d, f), device, quant_blocks, seed=4)
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
    pytest.param((T.MXFP4, T.MXFP4, T.Q8_0), EXACT, 2, id="mxfp4-exact"),
    pytest.param((T.MXFP4, T.MXFP4, T.Q8_0), FAST, 1, id="mxfp4-fast"),
    pytest.param((T.IQ2_XXS, T.Q2_K, T.Q8_0), FAST, 3, id="q2-fast"),
    pytest.param((T.Q4_K, T.Q4_K, T.Q4_K), FAST, 3, id="q4-fast-shared-in-mma"),
    # mixed 2-bit and 4-bit files: the 2-bit matrices take the fp16 tensor-core form (the int8 form needs both)
    pytest.param((T.IQ2_XXS, T.Q4_K, T.Q8_0), FAST, 1, id="iq2-q4-fast"),
    pytest.param((T.Q4_K, T.Q2_K, T.Q8_0), FAST, 1, id="q4-q2-fast"),
]
# FAST rounds the activations (and the mid activations) to fp16: measured 2e-4 to 6e-4 of the
# largest output on these shapes, against 3e-7 for EXACT
FAST_TOLERANCE = 2e-3
# except for the 2-bit recipe, whose fast form takes int8 activations (`expert_int8`): their rounding
# alone (torch, float weights) gives 1.1e-2 of the largest output here and 1.25e-2 at Flash shape
# (one token, 6 experts of 2048 x 4096) against 3.8e-4 for fp16; checked below against that rounding
INT8_TOLERANCE = 2.5e-2


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
    int8 = precision.fast and gate_up in (T.IQ2_XXS, T.Q2_K) and down_type in (T.IQ2_XXS, T.Q2_K)
    assert error < (INT8_TOLERANCE if int8 else FAST_TOLERANCE if precision.fast else 1e-5), error
    if int8:  # the kernel is the float product of the weights with the int8-rounded activations
        rounded = (
            _int8_reference(x, gate, up, down, ids, route_w) + moe_experts.reference(x, *shared, None, None, 10.0)[:, 0]
        )
        assert ((out - rounded).abs().max() / want.abs().max()).item() < 1e-3
        # x quantized before the call (by the routing launch in a decode step): the same bits
        xq = expert_int8.reference_rows(x)
        again = moe_experts.decode_ffn(x, ids, route_w, (gate, up, down), tuple(shared), 10.0, precision, xq=xq)
        assert torch.equal(again, out)
    assert not ticket_counters(device, "experts", 1).any()  # back at 0: a replayed launch starts over


def expert_weights(gate_up, down_type, e, d, f, device, quant_blocks):
    """Routed (gate, up, down) of e experts in the given types and a Q8_0 shared expert."""
    gate, up = (weight(gate_up, (e, f, d), device, quant_blocks, seed=s) for s in (2, 3))
    down = weight(down_type, (e, d, f), device, quant_blocks, seed=4)
    shared = [weight(T.Q8_0, (1, f, d), device, quant_blocks, seed=5 + i) for i in range(2)]
    shared.append(weight(T.Q8_0, (1, d, f), device, quant_blocks, seed=7))
    return (gate, up, down), shared


@pytest.mark.parametrize("tokens", [1, 3])
def test_decode_ffn_int8_two_super_blocks_a_pass(tokens, device, quant_blocks):
    # K = 512 (gate/up over D, down over F): the int8 loops take two super-blocks a pass (SBP = 2)
    gen = torch.Generator().manual_seed(11)
    e, d, f, k = 4, 512, 512, 2
    x = torch.randn(tokens, d, generator=gen).to(device)
    (gate, up, down), shared = expert_weights(T.IQ2_XXS, T.Q2_K, e, d, f, device, quant_blocks)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)]).int().to(device)
    route_w = torch.rand(tokens, k, generator=gen).to(device)
    out = moe_experts.decode_ffn(x, ids, route_w, (gate, up, down), tuple(shared), 10.0, FAST)
    want = _int8_reference(x, gate, up, down, ids, route_w) + moe_experts.reference(x, *shared, None, None, 10.0)[:, 0]
    assert ((out - want).abs().max() / want.abs().max()).item() < 1e-3


def _int8_rounded(v):
    rows = expert_int8.reference_rows(v.reshape(1, -1))
    return (rows.q.float().reshape(-1, 16) * rows.scale.reshape(-1, 1)).reshape(v.shape)


def _int8_reference(x, gate, up, down, ids, route_w):
    """The routed experts' sum [T, D] with x and the mid activations rounded as `expert_int8` rounds them."""
    g, u, dn = (w.dequantize().view(w.experts, w.expert_rows, w.cols) for w in (gate, up, down))
    out = torch.zeros(x.shape, device=x.device)
    for tok in range(x.shape[0]):
        xq = _int8_rounded(x[tok])
        for slot, e in enumerate(ids[tok].tolist()):
            mid = ops.swiglu_clamped(xq @ g[e].T, xq @ u[e].T, 10.0) * route_w[tok, slot]
            out[tok] += _int8_rounded(mid) @ dn[e].T
    return out


def test_quantize_rows_matches_torch(device):
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0)).to(device) * torch.arange(
        1, 513.0, device=device
    )
    x[1, :32] = 0.0  # an all-zero block: scale 0
    got, want = expert_int8.quantize_rows(x[:, ::1]), expert_int8.reference_rows(x)
    assert torch.equal(got.q, want.q)
    torch.testing.assert_close(got.scale, want.scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.sums, want.sums, rtol=1e-6, atol=1e-6)


def test_decode_ffn_exact_rows_do_not_depend_on_the_batch(device, quant_blocks):
    # issue 37: a token's row is the same bits alone and in a step of 3 tokens (its reduction order
    # over K depends on neither the number of tokens nor its place among them)
    gen = torch.Generator().manual_seed(5)
    e, d, f, k = 8, 256, 256, 2
    x = torch.randn(3, d, generator=gen).to(device)
    routed = tuple(weight(t, s, device, quant_blocks, seed=2 + i)
                   for i, (t, s) in enumerate([(T.IQ2_XXS, (e, f, d))] * 2 + [(T.Q2_K, (e, d, f))]))  # fmt: skip
    shared = tuple(
        weight(T.Q8_0, s, device, quant_blocks, seed=5 + i) for i, s in enumerate([(1, f, d)] * 2 + [(1, d, f)])
    )
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(3)]).int().to(device)
    route_w = torch.rand(3, k, generator=gen).to(device)
    batch = moe_experts.decode_ffn(x, ids, route_w, routed, shared, 10.0, EXACT)
    alone = moe_experts.decode_ffn(x[1:2], ids[1:2], route_w[1:2], routed, shared, 10.0, EXACT)
    assert torch.equal(batch[1], alone[0])


def test_decode_ffn_mxfp4_rows_ending_inside_a_step(device, quant_blocks):
    """MXFP4 rows of 96 and 160 columns: the fused loop's 256-column step reads 3 and 5 of its 8 blocks."""
    gen = torch.Generator().manual_seed(9)
    e, d, f, k = 4, 96, 160, 2
    x = torch.randn(2, d, generator=gen).to(device)
    (gate, up, down), shared = expert_weights(T.MXFP4, T.MXFP4, e, d, f, device, quant_blocks)
    ids = torch.tensor([[0, 3], [3, 1]], dtype=torch.int32, device=device)
    route_w = torch.rand(2, k, generator=gen).to(device)
    out = moe_experts.decode_ffn(x, ids, route_w, (gate, up, down), tuple(shared), 10.0)
    want = moe_experts.reference(x, gate, up, down, ids, route_w, 10.0).sum(1)
    want += moe_experts.reference(x, *shared, None, None, 10.0)[:, 0]
    assert ((out - want).abs().max() / want.abs().max()).item() < 1e-5
