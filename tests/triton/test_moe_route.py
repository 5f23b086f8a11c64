"""MoE routing in one launch (router GEMV tiles, the last program of a token block routes) and in
its prefill form, against the reference routing."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.triton.kernels import expert_int8, moe_route
from dwarfstar.backends.triton.runtime import ticket_counters
from dwarfstar.backends.triton.weights import QWeight
from dwarfstar.gguf.constants import GGMLType as T
from dwarfstar.gguf.quantize import quantize

EXPERTS, DIM, K = 20, 256, 3  # 20 experts: the last row tile is partial


def route_args(tokens, hashed, device, ggml_type=T.F16):
    gen = torch.Generator().manual_seed(tokens)
    f = torch.randn(tokens, DIM, generator=gen).to(device)
    values = torch.randn(EXPERTS, DIM, generator=gen) / DIM**0.5
    router = QWeight.from_bytes(torch.from_numpy(quantize(values, ggml_type)), ggml_type, (EXPERTS, DIM), device)
    bias = None if hashed else (0.5 * torch.randn(EXPERTS, generator=gen)).to(device)
    tid2eid = torch.stack([torch.randperm(EXPERTS, generator=gen)[:K] for _ in range(50)]).int().to(device)
    tokens = torch.randint(0, 50, (tokens,), generator=gen).int().to(device)
    return f, router, bias, tid2eid if hashed else None, tokens, K, 1.5


# (tokens, (router rows, columns) per program, tokens per program, hash routed) in one launch; then the prefill form
@pytest.mark.parametrize(
    "tokens,fused,tile,block,hashed",
    [(1, True, (4, 64), 1, False), (2, True, (8, 128), 1, True), (3, True, (16, 32), 2, False),
     (4, True, None, None, True), (9, False, None, None, False)],
)  # fmt: skip
def test_routing_matches_reference(tokens, fused, tile, block, hashed, device):
    args = route_args(tokens, hashed, device)
    want_ids, want_weights = moe_route.reference(*args)
    runs = [moe_route.route(*args, fused=fused, tile=tile, block_tokens=block) for _ in range(2)]
    assert not ticket_counters(device, "route", 1).any()  # reset by each launch's last programs
    ids, weights = runs[0]
    assert torch.equal(ids.long(), want_ids.long())
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights.sum(1), torch.full((tokens,), 1.5, device=device))
    assert torch.equal(runs[1][0], ids) and torch.equal(runs[1][1], weights)  # the same bits again


def test_routing_reads_a_bf16_router(device):
    args = route_args(2, False, device, T.BF16)
    ids, weights = moe_route.route(*args, fused=True, tile=(8, 64))
    want_ids, want_weights = moe_route.reference(*args)
    assert torch.equal(ids.long(), want_ids.long())
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens,tile,block", [(1, (8, 64), 1), (3, None, None)])
def test_routing_launch_quantizes_its_input(tokens, tile, block, device):
    # the routed experts' int8 form reads x as int8 rows, stored by the routing launch: the same
    # values as expert_int8's own quantizer, the routing unchanged
    args = route_args(tokens, False, device)
    q8 = expert_int8.Q8Rows.empty(tokens, DIM, device)
    ids, weights = moe_route.route(*args, fused=True, tile=tile, block_tokens=block, q8=q8)
    want_ids, want_weights = moe_route.reference(*args)
    assert torch.equal(ids.long(), want_ids.long())
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
    want = expert_int8.reference_rows(args[0])
    assert torch.equal(q8.q, want.q)
    torch.testing.assert_close(q8.scale, want.scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(q8.sums, want.sums, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="one-launch"):
        moe_route.route(*args, fused=False, q8=q8)
