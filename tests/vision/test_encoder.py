"""The vision encoder (model/vision.py) on every backend, against a plain numpy ViT and aligner written
here from the facts shared/spec/RELEASES_2026.md sources (not from any backend's code), in float64.

The oracle is the torch reference in float32 (`VisionEncoder(reference ops)`); MLX is held to it in
float32, the Triton backend's torch-bf16 steps (run here on the CPU) within bf16's precision. The grids
are not square and their sides not all multiples of 3, so a swapped row/column RoPE, an interleaved RoPE
pairing, a transposed patch or a wrong unfold order each move the result far past the tolerances.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from dwarfstar.backends.reference.vision import TorchVisionOps
from dwarfstar.backends.registry import backend_entry
from dwarfstar.backends.triton.vision import vision_ops as triton_vision_ops
from dwarfstar.model.vision import V41, VISION_TINY, PatchGrid, VisionArgs, VisionEncoder

# VISION_TINY has heads of 16 dims; the second shape has the real model's heads of 64 (2 of them) and
# V4.1's special vectors
WIDE_HEADS = VisionArgs(family=V41, n_layers=2, dim=128, n_heads=2, inter_dim=160, out_dim=96)
SHAPES = {"tiny": VISION_TINY, "wide-heads": WIDE_HEADS}
GRIDS = (PatchGrid(5, 7), PatchGrid(4, 3))
F32_TOLERANCE = 1e-5  # of the largest output value
BF16_TOLERANCE = 3e-2


def random_tensors(args: VisionArgs, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors in bf16, as the real ones are: matrices scaled by 1/sqrt(in) so the activations
    stay near 1 and the attention's scores spread (nothing saturates), norm weights near 1."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in args.tensor_shapes().items():
        t = torch.randn(shape, generator=gen)
        if len(shape) == 2:
            t = t / math.sqrt(shape[1])
        elif "norm" in name:
            t = 1 + 0.2 * t
        else:
            t = 0.1 * t
        tensors[name] = t.to(torch.bfloat16)
    return tensors


def random_pixels(grid: PatchGrid, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, size=(3, grid.rows * 14, grid.cols * 14)).astype(np.float32)


# ---- the numpy oracle, from the spec's facts ---------------------------------------------------------


def np_encode(args: VisionArgs, tensors: dict[str, torch.Tensor], pixels: np.ndarray, grid: PatchGrid) -> np.ndarray:
    w = {name: t.double().numpy() for name, t in tensors.items()}
    rows, cols, d, heads, hd = grid.rows, grid.cols, args.dim, args.n_heads, args.head_dim
    n = rows * cols

    def rms(x, weight):
        return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + args.norm_eps)

    # patch embedding: patch index py·cols + px, feature c·196 + y·14 + x
    patches = np.zeros((n, 3 * 14 * 14))
    for py in range(rows):
        for px in range(cols):
            for c in range(3):
                for y in range(14):
                    patches[py * cols + px, c * 196 + y * 14 : c * 196 + y * 14 + 14] = pixels[
                        c, py * 14 + y, px * 14 : px * 14 + 14
                    ]
    x = patches @ w["vision.patch_embed.proj.weight"].T + w["vision.patch_embed.proj.bias"]

    # 2-D RoPE: rotate-half pairs (i, i + hd/2); pair i < hd/4 by the row, pair hd/4 + j by the column
    quarter = hd // 4
    angle = np.zeros((n, hd // 2))
    for p in range(n):
        r, c = divmod(p, cols)
        for i in range(hd // 2):
            pos, j = (r, i) if i < quarter else (c, i - quarter)
            angle[p, i] = pos * args.rope_theta ** (-j / quarter)

    def rope(t):  # t [n, hd]
        out = np.empty_like(t)
        for i in range(hd // 2):
            a, b, cs, sn = t[:, i], t[:, i + hd // 2], np.cos(angle[:, i]), np.sin(angle[:, i])
            out[:, i] = a * cs - b * sn
            out[:, i + hd // 2] = b * cs + a * sn
        return out

    for il in range(args.n_layers):
        p = f"vision.blocks.{il}."
        h = rms(x, w[p + "norm1.weight"])
        qkv = h @ w[p + "attn.wqkv.weight"].T + w[p + "attn.wqkv.bias"]
        attn = np.zeros((n, d))
        for head in range(heads):
            s = slice(head * hd, (head + 1) * hd)
            q, k, v = rope(qkv[:, :d][:, s]), rope(qkv[:, d : 2 * d][:, s]), qkv[:, 2 * d :][:, s]
            scores = q @ k.T / math.sqrt(hd)
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            attn[:, s] = (probs / probs.sum(axis=1, keepdims=True)) @ v
        x = x + attn @ w[p + "attn.wo.weight"].T + w[p + "attn.wo.bias"]
        h = rms(x, w[p + "norm2.weight"]) @ w[p + "mlp.w1.weight"].T
        gate, up = h[:, : args.inter_dim], h[:, args.inter_dim :]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.w2.weight"].T
    x = rms(x, w["vision.norm.weight"])

    # aligner: zero-padded grid, 3x3 blocks in reading order, element c·9 + dy·3 + dx
    th, tw = -(-rows // 3), -(-cols // 3)
    blocks = np.zeros((th * tw, d * 9))
    for by in range(th):
        for bx in range(tw):
            for dy in range(3):
                for dx in range(3):
                    y, xx = 3 * by + dy, 3 * bx + dx
                    if y < rows and xx < cols:
                        blocks[by * tw + bx, dy * 3 + dx :: 9] = x[y * cols + xx]
    hidden = blocks @ w["aligner.w1.weight"].T + w["aligner.w1.bias"]
    hidden = 0.5 * hidden * (1 + np.vectorize(math.erf)(hidden / math.sqrt(2)))
    return hidden @ w["aligner.w2.weight"].T + w["aligner.w2.bias"]


# ---- the tests ---------------------------------------------------------------------------------------


def relative_error(got, want: np.ndarray) -> float:
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.fixture(scope="module", params=list(SHAPES))
def case(request):
    """(args, tensors, [(grid, pixels, reference output)]) for one shape."""
    args = SHAPES[request.param]
    tensors = random_tensors(args, seed=len(request.param))
    encoder = VisionEncoder(TorchVisionOps(args, tensors))
    images = []
    for i, grid in enumerate(GRIDS):
        pixels = random_pixels(grid, seed=i)
        images.append((grid, pixels, encoder.encode(pixels, grid).numpy()))
    return args, tensors, images


def test_the_reference_is_the_spec(case):
    args, tensors, images = case
    for grid, pixels, got in images:
        want = np_encode(args, tensors, pixels, grid)
        assert got.shape == (grid.tokens[0] * grid.tokens[1], args.out_dim)
        assert got.dtype == np.float32
        assert relative_error(got, want) < F32_TOLERANCE, grid


def test_the_reference_entry_gives_the_reference(case):
    args, tensors, images = case
    encoder = VisionEncoder(backend_entry("reference").vision_ops(args, tensors))
    for grid, pixels, want in images:
        assert torch.equal(encoder.encode(pixels, grid), torch.from_numpy(want))


def test_mlx_matches_the_reference(case):
    pytest.importorskip("mlx.core", reason="mlx does not import (pip install mlx[cpu])")
    args, tensors, images = case
    encoder = VisionEncoder(backend_entry("mlx").vision_ops(args, tensors))
    for grid, pixels, want in images:
        assert relative_error(encoder.encode(pixels, grid), want) < F32_TOLERANCE, grid


def test_triton_bf16_steps_match_the_reference(case):
    """The Triton backend's steps (bf16 products) on the CPU: within bf16's precision, yet not the
    float32 oracle's bits (the products did run in bf16)."""
    args, tensors, images = case
    encoder = VisionEncoder(triton_vision_ops(args, tensors, device="cpu"))
    for grid, pixels, want in images:
        got = encoder.encode(pixels, grid)
        assert got.dtype == torch.float32 and got.device.type == "cpu"
        assert 1e-4 < relative_error(got, want) < BF16_TOLERANCE, grid


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: the Triton backend's device is the CPU here")
def test_triton_on_its_device_matches_the_reference(case):
    args, tensors, images = case
    encoder = VisionEncoder(triton_vision_ops(args, tensors))
    for grid, pixels, want in images:
        got = encoder.encode(pixels, grid)
        assert got.device.type == "cuda"
        assert relative_error(got.cpu(), want) < BF16_TOLERANCE, grid


def test_a_wrong_tensor_or_grid_is_refused():
    tensors = random_tensors(VISION_TINY, seed=0)
    with pytest.raises(Exception, match="lacks"):
        TorchVisionOps(VISION_TINY, {k: v for k, v in tensors.items() if "aligner.w2" not in k})
    with pytest.raises(Exception, match="shape"):
        TorchVisionOps(replace(VISION_TINY, inter_dim=32), tensors)
    ops = TorchVisionOps(VISION_TINY, tensors)
    with pytest.raises(Exception, match="patch grid"):
        ops.patch_embed(random_pixels(PatchGrid(5, 7), seed=0), PatchGrid(7, 5))
