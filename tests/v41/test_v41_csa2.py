"""V4.1's CSA2 compressor against the note's §1 restated in numpy float64, and its split invariance."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from v41_restate import fp4_e4m3, fp4_ue8m0, report, rms_norm, rope

from dwarfstar.backends.reference import ops
from dwarfstar.backends.reference.v41 import csa2
from dwarfstar.model.config import ModelArgs, yarn_inv_freq

T, WIDTH, INDEX_DIM, ROPE = 7, 128, 64, 32  # v41-tiny: head_dim 128, rope 32, index head 64
EPS = 1e-20
ARGS = ModelArgs().with_(rope_dim=ROPE)
INV_FREQ = torch.tensor(yarn_inv_freq(ARGS, ARGS.layer(2)), dtype=torch.float64)  # compress_rope_theta, YaRN


def weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    kv, score = torch.randn(T, WIDTH, generator=g), torch.randn(T, WIDTH, generator=g) * 2
    norm, k_norm = torch.rand(WIDTH, generator=g) + 0.5, torch.rand(INDEX_DIM, generator=g) + 0.5
    w_k = torch.randn(INDEX_DIM, WIDTH, generator=g) / WIDTH**0.5
    return kv, score, norm, w_k, k_norm


def numpy_compressor(ratio, kv, score, norm, w_k, k_norm):
    """Every group the T tokens complete: (main rows, index keys), float64."""
    kv, score = np.asarray(kv, np.float64), np.asarray(score, np.float64)
    n = T // ratio
    if ratio == 1:
        latent = rms_norm(kv, norm, EPS)
    else:
        s = score[: 2 * n].reshape(n, 2, WIDTH)
        p = np.exp(s - s.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)  # softmax per channel over the group's 2 slots
        latent = rms_norm((p * kv[: 2 * n].reshape(n, 2, WIDTH)).sum(1), norm, EPS)
    positions = np.arange(n) * ratio  # the group's first token
    inv = INV_FREQ.numpy()
    keys = fp4_ue8m0(rope(rms_norm(latent @ np.asarray(w_k, np.float64).T, k_norm, EPS), positions, inv), 32)
    rows = fp4_e4m3(rope(latent, positions, inv), 16)
    return rows, keys


def run(ratio: int, split: list[int], kv, score, norm, w_k, k_norm):
    """The compressor over calls of the given lengths, rows and keys concatenated, and the last frontier."""
    frontier = csa2.new_frontier(WIDTH) if ratio == 2 else None
    rows, keys, start = [], [], 0
    for length in split:
        part = slice(start, start + length)
        out = csa2.compress(
            kv[part], None if ratio == 1 else score[part], frontier, norm, w_k, k_norm, INV_FREQ, start, EPS
        )
        assert out.first == start // ratio
        rows.append(out.rows)
        keys.append(out.index_keys)
        frontier, start = out.frontier, start + length
    return torch.cat(rows), torch.cat(keys), frontier


@pytest.mark.parametrize("ratio", [1, 2])
def test_compressor_matches_the_note(ratio):
    w = weights(ratio)
    rows, keys, _ = run(ratio, [T], *w)
    want_rows, want_keys = numpy_compressor(ratio, *(x.numpy() for x in w))
    assert rows.shape == (T // ratio, WIDTH) and keys.shape == (T // ratio, INDEX_DIM)
    assert report(f"csa2 ratio {ratio} main rows", rows.numpy(), want_rows) < 1e-5
    assert report(f"csa2 ratio {ratio} index keys", keys.numpy(), want_keys) < 1e-5


def compositions(n: int):
    """Every way to cut n tokens into calls, in order (2^(n-1) of them)."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        split, length = [], 1
        for cut in cuts:
            if cut:
                split.append(length)
                length = 1
            else:
                length += 1
        yield [*split, length]


@pytest.mark.parametrize("ratio", [1, 2])
def test_every_split_gives_the_rows_of_one_pass(ratio):
    w = weights(10 + ratio)
    one_rows, one_keys, one_front = run(ratio, [T], *w)
    for split in compositions(T):
        rows, keys, front = run(ratio, split, *w)
        assert torch.equal(rows, one_rows), split
        assert torch.equal(keys, one_keys), split
        if ratio == 2:
            assert torch.equal(front.kv, one_front.kv) and torch.equal(front.score, one_front.score)


def test_odd_token_waits_in_the_frontier():
    """After 7 tokens the 4th group has one token: slot 0 holds it, slot 1 is empty (score -inf)."""
    kv, score, norm, w_k, k_norm = weights(20)
    _, _, front = run(2, [T], kv, score, norm, w_k, k_norm)
    assert torch.equal(front.kv[0], kv[6]) and torch.equal(front.score[0], score[6])
    assert torch.all(front.score[1] == float("-inf"))
    out = csa2.compress(kv[:1], score[:1], front, norm, w_k, k_norm, INV_FREQ, T, EPS)
    assert out.first == 3 and out.rows.shape[0] == 1 and torch.all(out.frontier.score == float("-inf"))


def test_main_rows_hold_16_blocks_of_e2m1_times_an_e4m3_scale():
    kv, _, norm, w_k, k_norm = weights(30)
    out = csa2.compress(kv, None, None, norm, w_k, k_norm, INV_FREQ, 0, EPS)
    blocks = out.rows.view(T, -1, 16)
    scale = blocks.abs().amax(-1, keepdim=True) / 6  # the largest magnitude is 6 * scale when it rounds to 6
    assert torch.equal(scale, scale.to(torch.float8_e4m3fn).float())
    codes = (blocks / scale).abs()
    assert torch.isin(codes, torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])).all()


def test_shapes_are_checked():
    kv, score, norm, w_k, k_norm = weights(40)
    with pytest.raises(ValueError, match="kv"):
        csa2.compress(kv[:, :-1], None, None, norm, w_k, k_norm, INV_FREQ, 0, EPS)
    with pytest.raises(ValueError, match="frontier"):
        csa2.compress(kv, score, None, norm, w_k, k_norm, INV_FREQ, 0, EPS)
    with pytest.raises(ValueError, match="frontier"):
        csa2.compress(kv, None, csa2.new_frontier(WIDTH), norm, w_k, k_norm, INV_FREQ, 0, EPS)
    with pytest.raises(ValueError, match="W_k"):
        csa2.compress(kv, None, None, norm, w_k[:, :-1], k_norm, INV_FREQ, 0, EPS)


def test_row_fp4_matches_the_note_across_magnitudes():
    """The main rows' format over 10 decades, a zero block (amax floor 6 * 2^-9) and subnormal scales."""
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(50)) * torch.logspace(-7, 3, 10)[:, None]
    x[0, :16] = 0.0
    got = ops.fp4_round(x, 16, e4m3_scale=True)
    assert report("FP4 e2m1 / e4m3 scale per 16", got.numpy(), fp4_e4m3(x.numpy(), 16)) == 0.0
    assert torch.equal(got[0, :16], torch.zeros(16))
