"""The vision encoder's steps (`model.vision.VisionOps`) in torch: the oracle in float32 on the CPU, and
the Triton backend's encoder with `dtype` bfloat16 on its GPU (backends/triton/vision.py).

The encoder's matrices are held in `dtype`, the operand type of its products (which accumulate in
float32); the activations between steps, the biases, the norms, RoPE, SiLU and GELU are float32. The
attention's q, k and v enter `scaled_dot_product_attention` in `dtype` too: its softmax is float32 either
way, and on a GPU it is a fused kernel that never holds the [N, N] scores of a large image.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from dwarfstar.backends.reference import ops
from dwarfstar.model.vision import PatchGrid, VisionArgs, check_tensors, patch_rows, rope_angles


class TorchVisionOps:
    """`VisionOps` over torch tensors on `device`, products in `dtype`; `tensors` are the checkpoint's
    (names of `VisionArgs.tensor_shapes()`, any float dtype, on any device), converted once."""

    def __init__(
        self,
        args: VisionArgs,
        tensors: Mapping[str, torch.Tensor],
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        args.check()
        check_tensors(args, {name: tuple(t.shape) for name, t in tensors.items()})
        self.args, self.device, self.dtype = args, torch.device(device), dtype
        self.weights = {
            name: tensors[name].detach().to(self.device, dtype if len(shape) == 2 else torch.float32).contiguous()
            for name, shape in args.tensor_shapes().items()
        }
        self._rope: tuple[PatchGrid, torch.Tensor, torch.Tensor] | None = None  # the last grid's cos, sin

    def _linear(self, x: torch.Tensor, weight: str, bias: str | None = None) -> torch.Tensor:
        y = (x.to(self.dtype) @ self.weights[weight].T).float()
        return y if bias is None else y + self.weights[bias]

    def _rope_tables(self, grid: PatchGrid) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, head_dim/2] float32 of the grid's angles, kept for the next block's call."""
        if self._rope is None or self._rope[0] != grid:
            angles = torch.from_numpy(rope_angles(self.args, grid))[:, None, :]
            cos, sin = (f(angles).float().to(self.device) for f in (torch.cos, torch.sin))
            self._rope = grid, cos, sin
        return self._rope[1], self._rope[2]

    def patch_embed(self, pixels, grid: PatchGrid) -> torch.Tensor:
        rows = torch.from_numpy(patch_rows(pixels, grid, self.args.patch)).to(self.device)
        return self._linear(rows, "vision.patch_embed.proj.weight", "vision.patch_embed.proj.bias")

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weights[name], self.args.norm_eps)

    def attend(self, il: int, x: torch.Tensor, grid: PatchGrid) -> torch.Tensor:
        args, p = self.args, f"vision.blocks.{il}.attn."
        n, heads, hd = x.shape[0], args.n_heads, args.head_dim
        q, k, v = self._linear(x, p + "wqkv.weight", p + "wqkv.bias").view(n, 3, heads, hd).unbind(1)
        cos, sin = self._rope_tables(grid)

        def rotate(t: torch.Tensor) -> torch.Tensor:  # rotate-half pairs (i, i + hd/2)
            a, b = t[..., : hd // 2], t[..., hd // 2 :]
            return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

        q, k, v = (t.transpose(0, 1).to(self.dtype) for t in (rotate(q), rotate(k), v))  # [heads, N, hd]
        out = F.scaled_dot_product_attention(q, k, v, scale=hd**-0.5)
        return self._linear(out.float().transpose(0, 1).reshape(n, args.dim), p + "wo.weight", p + "wo.bias")

    def mlp(self, il: int, x: torch.Tensor) -> torch.Tensor:
        p = f"vision.blocks.{il}.mlp."
        gate, up = self._linear(x, p + "w1.weight").split(self.args.inter_dim, dim=-1)
        return self._linear(F.silu(gate) * up, p + "w2.weight")

    def align(self, x: torch.Tensor, grid: PatchGrid) -> torch.Tensor:
        (h, w), r, d = grid.tokens, self.args.downsample, self.args.dim
        padded = F.pad(x.view(grid.rows, grid.cols, d), (0, 0, 0, w * r - grid.cols, 0, h * r - grid.rows))
        # [h, r, w, r, d] -> per block (by, bx): channel, then dy, then dx
        blocks = padded.view(h, r, w, r, d).permute(0, 2, 4, 1, 3).reshape(h * w, d * r * r)
        hidden = F.gelu(self._linear(blocks, "aligner.w1.weight", "aligner.w1.bias"))  # exact (erf)
        return self._linear(hidden, "aligner.w2.weight", "aligner.w2.bias")
