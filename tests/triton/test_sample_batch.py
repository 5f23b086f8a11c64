"""The Triton backend's batched sampling against the generic sampler, and the shared Philox draw."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton import load_backend
from dwarfstar.model.loader import open_model
from dwarfstar.session.sampling import GREEDY, Sampler, SamplingParams, philox_uniform, sample_batch


@triton.jit
def _uniforms_kernel(out_ptr, seed, step, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, tl.rand(seed, step + i))


@pytest.mark.parametrize("seed", [0, 1, 987654, 2**31 - 1])
def test_host_philox_is_tritons_rand(seed, device):
    got = torch.empty(64, device=device)
    _uniforms_kernel[(1,)](got, seed, 5, N=64)
    assert got.cpu().tolist() == [philox_uniform(seed, 5 + i) for i in range(64)]


@pytest.fixture(scope="module")
def backend(tiny_model_file, device):
    return load_backend(open_model(tiny_model_file(0)), device=device)


PARAMS = [
    GREEDY,  # kernel
    SamplingParams(seed=3, top_k=20),  # kernel
    SamplingParams(seed=4, temperature=0.7, min_p=0.0),  # flagged, redrawn generic: all 3000 pass min-p
    SamplingParams(seed=5, top_k=50, top_p=0.8, min_p=0.02),  # kernel
    SamplingParams(seed=6, temperature=1.5, top_p=0.9),  # kernel, in rank order (top-p)
    SamplingParams(seed=7, temperature=1.0, min_p=0.05),  # kernel, in token-id order (min-p alone)
]


def test_kernel_and_generic_rows_give_the_generic_samplers_tokens(backend, device):
    """Same rules and same uniforms: the kernel rows and the generic rows of a batch both reproduce
    what the device-agnostic sampler draws for the same seeds and steps."""
    gen = torch.Generator().manual_seed(0)
    on_device, generic = [Sampler(p) for p in PARAMS], [Sampler(p) for p in PARAMS]
    for _ in range(6):
        logits = 2.0 * torch.randn(len(PARAMS), 3000, generator=gen)
        assert backend.sample_batch(logits.to(device), on_device) == sample_batch(logits, generic)
    assert [s.step for s in on_device] == [6] * len(PARAMS)
