"""The Triton backend's batched sampling against the generic sampler, and the shared Philox draw."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dwarfstar.backends.triton import load_backend
from dwarfstar.model.loader import open_model
from dwarfstar.sampling import GREEDY, Sampler, SamplingParams, philox_uniform, sample_batch


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


def test_logprobs_come_with_the_kernels_draw_and_a_redraw(backend, device):
    """The logprobs of the rows that ask, read in the draw's sync: the generic sampler's, for kernel
    rows and for a flagged row redrawn over the whole vocabulary (min-p 0 at temperature 0.7)."""
    params = [
        SamplingParams(seed=3, top_k=20, logprobs=4),
        SamplingParams(seed=4, temperature=0.7, min_p=0.0, logprobs=2),  # flagged, redrawn
        SamplingParams(seed=6, temperature=1.5, top_p=0.9),  # asks for none
    ]
    on_device, generic = [Sampler(p) for p in params], [Sampler(p) for p in params]
    logits = 2.0 * torch.randn(len(params), 3000, generator=torch.Generator().manual_seed(1))
    assert backend.sample_batch(logits.to(device), on_device) == sample_batch(logits, generic)
    for got, want in zip(on_device, generic, strict=True):
        if want.logprobs is None:
            assert got.logprobs is None
            continue
        assert got.logprobs.token == want.logprobs.token
        assert got.logprobs.logprob == pytest.approx(want.logprobs.logprob, abs=1e-5)
        assert [a.token for a in got.logprobs.top] == [a.token for a in want.logprobs.top]
