"""The vision encoder's steps (`model.vision.VisionOps`) in MLX built-in ops, float32.

The same semantics as the torch oracle (backends/reference/vision.py), which tests/vision checks them
against; only built-in ops, so this runs wherever MLX does (Linux CPU included). MLX records lazily: the
image's rows are computed when the caller evaluates `encode`'s result.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import mlx.core as mx
import numpy as np
import torch

from dwarfstar.model.vision import PatchGrid, VisionArgs, check_tensors, patch_rows, rope_angles


class MLXVisionOps:
    """`VisionOps` over MLX arrays; `tensors` are the checkpoint's (names of `VisionArgs.tensor_shapes()`,
    torch tensors of any float dtype), converted once to float32."""

    def __init__(self, args: VisionArgs, tensors: Mapping[str, torch.Tensor]) -> None:
        args.check()
        check_tensors(args, {name: tuple(t.shape) for name, t in tensors.items()})
        self.args = args
        self.weights = {
            name: mx.array(tensors[name].detach().to("cpu", torch.float32).numpy()) for name in args.tensor_shapes()
        }
        self._rope: tuple[PatchGrid, mx.array, mx.array] | None = None  # the last grid's cos, sin

    def _linear(self, x: mx.array, weight: str, bias: str | None = None) -> mx.array:
        y = x @ self.weights[weight].T
        return y if bias is None else y + self.weights[bias]

    def _rope_tables(self, grid: PatchGrid) -> tuple[mx.array, mx.array]:
        """cos, sin [N, 1, head_dim/2] float32 of the grid's angles (formed on the host in float64)."""
        if self._rope is None or self._rope[0] != grid:
            angles = rope_angles(self.args, grid)[:, None, :]
            self._rope = grid, mx.array(np.cos(angles).astype(np.float32)), mx.array(np.sin(angles).astype(np.float32))
        return self._rope[1], self._rope[2]

    def patch_embed(self, pixels, grid: PatchGrid) -> mx.array:
        rows = mx.array(patch_rows(pixels, grid, self.args.patch))
        return self._linear(rows, "vision.patch_embed.proj.weight", "vision.patch_embed.proj.bias")

    def norm(self, name: str, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weights[name], self.args.norm_eps)

    def attend(self, il: int, x: mx.array, grid: PatchGrid) -> mx.array:
        args, p = self.args, f"vision.blocks.{il}.attn."
        n, heads, hd = x.shape[0], args.n_heads, args.head_dim
        qkv = self._linear(x, p + "wqkv.weight", p + "wqkv.bias").reshape(n, 3, heads, hd)
        cos, sin = self._rope_tables(grid)

        def rotate(t: mx.array) -> mx.array:  # rotate-half pairs (i, i + hd/2)
            a, b = t[..., : hd // 2], t[..., hd // 2 :]
            return mx.concatenate((a * cos - b * sin, b * cos + a * sin), axis=-1)

        q, k, v = (t.transpose(1, 0, 2)[None] for t in (rotate(qkv[:, 0]), rotate(qkv[:, 1]), qkv[:, 2]))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=hd**-0.5)  # [1, heads, N, hd]
        return self._linear(out[0].transpose(1, 0, 2).reshape(n, args.dim), p + "wo.weight", p + "wo.bias")

    def mlp(self, il: int, x: mx.array) -> mx.array:
        p = f"vision.blocks.{il}.mlp."
        gate, up = mx.split(self._linear(x, p + "w1.weight"), 2, axis=-1)
        return self._linear(gate * mx.sigmoid(gate) * up, p + "w2.weight")

    def align(self, x: mx.array, grid: PatchGrid) -> mx.array:
        (h, w), r, d = grid.tokens, self.args.downsample, self.args.dim
        padded = mx.pad(x.reshape(grid.rows, grid.cols, d), [(0, h * r - grid.rows), (0, w * r - grid.cols), (0, 0)])
        # [h, r, w, r, d] -> per block (by, bx): channel, then dy, then dx
        blocks = padded.reshape(h, r, w, r, d).transpose(0, 2, 4, 1, 3).reshape(h * w, d * r * r)
        hidden = self._linear(blocks, "aligner.w1.weight", "aligner.w1.bias")
        hidden = 0.5 * hidden * (1 + mx.erf(hidden / math.sqrt(2)))  # exact GELU
        return self._linear(hidden, "aligner.w2.weight", "aligner.w2.bias")
