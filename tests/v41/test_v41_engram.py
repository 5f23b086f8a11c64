"""V4.1 Engram output and gate against the note's §3 pseudocode restated in numpy float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from v41_restate import bf16, fp8_pow2, report

from dwarfstar.backends.reference.v41.engram import engram
from dwarfstar.engram.rows import dequantize, quantize

T, N, D, C, DE = 5, 4, 16, 24, 32  # tokens, hc copies, dim, columns (3 n-grams x 8 heads), head_dim
EPS = 1e-20


def numpy_engram(h, rows, w_kv, q_w, k_w, image):
    """The note's loop, per token and copy, in float64 (the rows' bf16 and FP8 roundings first)."""
    e = fp8_pow2(bf16(rows.reshape(T, C * DE)), 32)
    out = np.array(h, np.float64)
    for t in range(T):
        kv = np.asarray(w_kv, np.float64) @ e[t]
        key, value = kv[: N * D].reshape(N, D), kv[N * D :]
        w = np.asarray(q_w, np.float64) * k_w
        for k in range(N):
            hk = np.asarray(h[t, k], np.float64)
            r = 1 / np.sqrt(np.mean(hk**2) + EPS) / np.sqrt(np.mean(key[k] ** 2) + EPS)
            dot = np.sum(hk * w[k] * key[k]) * r / np.sqrt(D)
            g = 1 / (1 + np.exp(-np.sign(dot) * np.sqrt(max(abs(dot), 1e-6))))
            if image[t]:
                g = 0.0
            out[t, k] += g * value
    return out


def inputs(seed: int, on_grid: bool):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, N, D, generator=g)
    raw = torch.randn(T, C, DE, generator=g) * 0.1
    if on_grid:  # rows as the table stores them: e4m3 values with an E8M0 scale per 32
        raw = torch.from_numpy(dequantize(quantize(raw.reshape(-1, 256).numpy()))).reshape(T, C, DE)
    w_kv = torch.randn((N + 1) * D, C * DE, generator=g) * 0.05
    q_w, k_w = torch.rand(N, D, generator=g) + 0.5, torch.rand(N, D, generator=g) + 0.5
    image = torch.tensor([False, True, False, False, True])
    return h, raw, w_kv, q_w, k_w, image


@pytest.mark.parametrize("on_grid", [True, False])
def test_engram_matches_the_note(on_grid):
    args = inputs(0, on_grid)
    got = engram(*args, eps=EPS)
    want = numpy_engram(*(a.numpy() for a in args))
    assert report(f"engram (rows on the e4m3 grid: {on_grid})", got.numpy(), want) < 1e-5
    assert not np.allclose(want, args[0].numpy())  # the text rows did change


def test_image_rows_pass_unchanged_and_text_rows_get_one_value_per_token():
    h, rows, w_kv, q_w, k_w, image = inputs(1, True)
    got = engram(h, rows, w_kv, q_w, k_w, image, EPS)
    assert torch.equal(got[image], h[image])
    delta = (got - h)[~image]  # g_k * value: the same direction in every copy
    ratio = delta / delta[:, :1]
    assert torch.allclose(ratio, ratio[..., :1].expand_as(ratio), rtol=1e-4)


def test_zero_dot_gives_gate_one_half():
    """q_weight 0 makes every dot 0: sign(0) = 0, so g = sigmoid(0) = 1/2 and H_k += value / 2."""
    h, rows, w_kv, _, k_w, _ = inputs(2, True)
    none = torch.zeros(T, dtype=torch.bool)
    half = engram(h, rows, w_kv, torch.zeros(N, D), k_w, none, EPS)
    e = fp8_pow2(bf16(rows.numpy().reshape(T, C * DE)), 32)
    value = e @ w_kv.numpy().astype(np.float64)[N * D :].T
    np.testing.assert_allclose(half.numpy(), h.numpy() + 0.5 * value[:, None, :], rtol=1e-5, atol=1e-6)


def test_rows_are_rounded_to_bf16_before_the_projection():
    h, rows, w_kv, q_w, k_w, image = inputs(3, False)
    rounded = rows.to(torch.bfloat16).float()
    assert not torch.equal(rows, rounded)
    assert torch.equal(engram(h, rows, w_kv, q_w, k_w, image, EPS), engram(h, rounded, w_kv, q_w, k_w, image, EPS))


@pytest.mark.parametrize(
    ("part", "shape", "message"),
    [
        ("rows", (T, C * DE), "rows"),
        ("w_kv", (N * D, C * DE), "W_kv"),
        ("q_w", (N, D + 1), "q_weight"),
        ("image", (T + 1,), "image"),
    ],
)
def test_shapes_are_checked(part, shape, message):
    h, rows, w_kv, q_w, k_w, image = inputs(4, True)
    named = {"rows": rows, "w_kv": w_kv, "q_w": q_w, "image": image}
    named[part] = torch.zeros(shape, dtype=named[part].dtype)
    with pytest.raises(ValueError, match=message):
        engram(h, named["rows"], named["w_kv"], named["q_w"], k_w, named["image"], EPS)
