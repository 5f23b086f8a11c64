"""V4.1's lagged mHC against the note's §2 pseudocode restated in numpy float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from v41_restate import report, rms_norm

from dwarfstar.backends.reference import ops
from dwarfstar.backends.reference.v41.mhc import HcConfig, HcWeights, collapse, first_pre, mix, run_lagged

T, N, D, BLOCKS = 3, 4, 8, 3
CONFIG = HcConfig(sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-20)


def numpy_mix(h, fn, scale, base):
    """The note's mix of one token's streams [n, D]: 24 values -> pre, post, Sinkhorn comb."""
    v = np.asarray(h, np.float64).reshape(-1)  # copy-major
    m = (np.asarray(fn, np.float64) @ v) / np.sqrt(np.mean(v**2) + 1e-20)
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    pre = sig(m[:N] * scale[0] + base[:N]) + 1e-6
    post = 2 * sig(m[N : 2 * N] * scale[1] + base[N : 2 * N])
    logits = (m[2 * N :] * scale[2] + base[2 * N :]).reshape(N, N)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    comb = e / e.sum(-1, keepdims=True) + 1e-6  # softmax over the last axis + eps
    comb = comb / (comb.sum(0, keepdims=True) + 1e-6)  # then columns, and (rows, columns) 19 times
    for _ in range(19):
        comb = comb / (comb.sum(1, keepdims=True) + 1e-6)
        comb = comb / (comb.sum(0, keepdims=True) + 1e-6)
    return pre, post, comb


def numpy_stack(h0, weights, mats):
    """The note's loop for one token: p_prev = (1,0,0,0); o = f(collapse(H, p_prev)); H = post(H, o)."""
    h, p_prev = np.asarray(h0, np.float64), np.eye(N)[0]
    for (fn, scale, base), w in zip(weights, mats, strict=True):
        pre, post, comb = numpy_mix(h, fn, scale, base)
        o = np.tanh(w @ rms_norm(p_prev @ h, None, 1e-20))
        h = post[:, None] * o[None, :] + comb.T @ h  # stream k: post_k o + sum_j comb[j, k] H_j
        p_prev = pre
    return p_prev @ h, h


def stack(seed: int):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, N, D, generator=g)
    weights = [
        HcWeights(
            torch.randn((2 + N) * N, N * D, generator=g) * 0.1,
            torch.rand(3, generator=g) + 0.5,
            torch.randn((2 + N) * N, generator=g) * 0.5,
        )
        for _ in range(2 * BLOCKS)
    ]
    mats = [torch.randn(D, D, generator=g) / D**0.5 for _ in range(2 * BLOCKS)]
    return h, weights, mats


def sublayer(w):
    return lambda x: torch.tanh(ops.linear(ops.rms_norm(x, None, 1e-20), w))


def test_mix_matches_the_note():
    h, weights, _ = stack(0)
    got = mix(h, weights[0], CONFIG)
    for t in range(T):
        want = numpy_mix(h[t].numpy(), *(x.numpy() for x in weights[0]))
        for name, a, b in zip(("pre", "post", "comb"), got, want, strict=True):
            assert report(f"mhc mix {name} (token {t})", a[t].numpy(), b) < 1e-5


def test_lagged_stack_matches_the_note():
    h, weights, mats = stack(1)
    y, final = run_lagged(h, list(zip(weights, (sublayer(w) for w in mats), strict=True)), CONFIG)
    np_w = [tuple(x.numpy() for x in w) for w in weights]
    for t in range(T):
        want_y, want_h = numpy_stack(h[t].numpy(), np_w, [m.numpy() for m in mats])
        assert report(f"mhc lagged stack output (token {t})", y[t].numpy(), want_y) < 1e-5
        assert report(f"mhc lagged stack streams (token {t})", final[t].numpy(), want_h) < 1e-5


def test_first_sublayer_reads_copy_zero_and_each_later_one_the_previous_pre():
    h, weights, mats = stack(2)
    seen = []

    def record(x):
        seen.append(x)
        return x

    run_lagged(h, [(weights[0], record), (weights[1], record)], CONFIG)
    assert torch.equal(seen[0], h[:, 0])
    pre0, post0, comb0 = mix(h, weights[0], CONFIG)
    h1 = ops.hc_post(seen[0], h, post0, comb0)
    assert torch.equal(seen[1], collapse(h1, pre0))  # not collapse(h1, its own pre), V4's order
    assert not torch.allclose(seen[1], collapse(h1, mix(h1, weights[1], CONFIG)[0]))


def test_first_pre_and_shapes():
    assert first_pre(2, 4).tolist() == [[1.0, 0.0, 0.0, 0.0]] * 2
    h, weights, _ = stack(3)
    with pytest.raises(ValueError, match="mHC weights"):
        mix(h[:, :3], weights[0], CONFIG)
    with pytest.raises(ValueError, match="collapse"):
        collapse(h, torch.ones(T, N + 1))
