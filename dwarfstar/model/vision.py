"""The vision encoder of DeepSeek V4 Flash Vision-Exp and V4.1 Flash, once, over the steps a backend
provides (issue 34; the facts, with their sources: the vLLM ports of DeepSeek's `inference/vision.py`
and ds4's encoder, agree on all of them).

A ViT with 14-pixel patches and an aligner:

- **patch embedding**: each patch, flattened channel, row, column (c·196 + y·14 + x), through a Linear
  588 → `dim` with bias; no class token, no absolute position embedding;
- **blocks** (pre-norm, residual): `x += wo(attention(norm1(x)))`, then `x += w2(silu(g) · u)` with
  `[g, u] = w1(norm2(x))` (gate rows first; no biases in the MLP). RMSNorm, weight only, eps
  `norm_eps`. Attention: one fused `wqkv` with bias (q, k, v contiguous, head-major), 2-D RoPE on q and
  k, full bidirectional attention over the image's patches, scale 1/sqrt(head_dim), `wo` with bias;
- **2-D RoPE**: a head's D dims (64) rotate in rotate-half pairs (i, i + D/2); pair i < D/4 by the
  patch's row times θ^(-i/(D/4)), pair D/4 + j by its column times θ^(-j/(D/4)) (row and column
  0-based; every dim rotates);
- a final RMSNorm;
- **aligner**: the [rows, cols, dim] grid zero-padded at the bottom and right to multiples of 3, each
  3×3 block unfolded channel-major (c·9 + dy·3 + dx) into 9·`dim` values, blocks in reading order,
  then Linear with bias, exact (erf) GELU, Linear with bias, to the language model's width.

`VisionArgs` holds the shapes and the image budget of one encoder; `VisionOps` is what a backend
computes; `encode` is the order, which no backend restates. Weight names are the checkpoint's
(`vision.blocks.{i}.attn.wqkv.weight` ...), which ds4's encoder GGUFs keep.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from dwarfstar.errors import DwarfStarError

A = TypeVar("A")  # the backend's array type

VISION_EXP, V41 = "vision-exp", "v4.1-flash"  # ds4's `checkpoint_variant` of each encoder
FAMILIES = (VISION_EXP, V41)
PREFIX = "deepseek4-vision"  # ds4's `general.architecture` for both encoders


@dataclass(frozen=True)
class VisionArgs:
    """One encoder's shapes and image budget (the GGUF metadata of ds4's encoder files)."""

    family: str = VISION_EXP  # VISION_EXP or V41: the token layout and the preprocessing budget
    n_layers: int = 32
    dim: int = 1024
    n_heads: int = 16
    inter_dim: int = 2816
    out_dim: int = 4096  # the language model's hidden size (the aligner's output)
    patch: int = 14
    downsample: int = 3  # the aligner's unfold
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_tokens: int = 384  # an image block's token budget
    min_pixels: int = 147456  # smaller images are scaled up to this area
    max_wh_ratio: int = 8  # wider images are planned as this ratio and stretched; 0: no limit
    image_token_id: int | None = None  # V4.1: the id every image-span position carries

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def check(self) -> None:
        if self.family not in FAMILIES:
            raise DwarfStarError(f"unknown vision encoder variant {self.family!r}; known: {', '.join(FAMILIES)}")
        if self.dim % self.n_heads or self.head_dim % 4:
            raise DwarfStarError(f"a vision width of {self.dim} does not split into {self.n_heads} heads for 2-D RoPE")

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the encoder, named as the checkpoint names it, with its [out, in] shape."""
        d, patch_in, cells = self.dim, 3 * self.patch * self.patch, self.downsample * self.downsample
        shapes: dict[str, tuple[int, ...]] = {
            "vision.patch_embed.proj.weight": (d, patch_in),
            "vision.patch_embed.proj.bias": (d,),
            "vision.norm.weight": (d,),
        }
        for il in range(self.n_layers):
            p = f"vision.blocks.{il}."
            shapes |= {
                p + "norm1.weight": (d,),
                p + "attn.wqkv.weight": (3 * d, d),
                p + "attn.wqkv.bias": (3 * d,),
                p + "attn.wo.weight": (d, d),
                p + "attn.wo.bias": (d,),
                p + "norm2.weight": (d,),
                p + "mlp.w1.weight": (2 * self.inter_dim, d),
                p + "mlp.w2.weight": (d, self.inter_dim),
            }
        o = self.out_dim
        shapes |= {
            "aligner.w1.weight": (o, cells * d),
            "aligner.w1.bias": (o,),
            "aligner.w2.weight": (o, o),
            "aligner.w2.bias": (o,),
        }
        for name in special_vectors(self.family):
            shapes[name] = (o,)
        return shapes


# the real encoders: Vision-Exp's (the defaults) and V4.1 Flash's (its budget, output width and image id)
VISION_EXP_FLASH = VisionArgs()
V41_FLASH = VisionArgs(
    family=V41, out_dim=5120, max_tokens=1024, min_pixels=295936, max_wh_ratio=0, image_token_id=129264
)
# the test-sized encoder of `dwarfstar synth --preset vision-tiny`: the real layout, two small blocks,
# its output the width of the `tiny` language model (model.synthetic.TINY)
VISION_TINY = VisionArgs(n_layers=2, dim=64, n_heads=4, inter_dim=96, out_dim=64)


def special_vectors(family: str) -> tuple[str, ...]:
    """The learned rows of an image block that are not image content (Vision-Exp has a pad row too)."""
    if family == VISION_EXP:
        return ("image_start", "image_pad", "image_newline", "image_end")
    return ("image_start", "image_newline", "image_end")


@dataclass(frozen=True)
class PatchGrid:
    """An image's patches: `rows` × `cols` of them, in reading order."""

    rows: int
    cols: int

    @property
    def tokens(self) -> tuple[int, int]:
        """The aligner's grid: ceil(rows / 3) × ceil(cols / 3) image tokens."""
        return -(-self.rows // 3), -(-self.cols // 3)


def patch_rows(pixels: Any, grid: PatchGrid, patch: int = 14) -> Any:
    """Normalised pixels [3, rows·patch, cols·patch] as the patch rows [rows·cols, 3·patch²] (host
    numpy float32): patches in reading order, each flattened channel, row, column (c·patch² + y·patch + x).
    The same on every backend, so done once here on the host."""
    import numpy as np  # deferred: naming the encoder's shapes costs no numpy

    x = np.asarray(pixels, dtype=np.float32)
    want = (3, grid.rows * patch, grid.cols * patch)
    if x.shape != want:
        raise DwarfStarError(f"pixels of shape {x.shape} do not make a {grid.rows}x{grid.cols} patch grid {want}")
    rows = x.reshape(3, grid.rows, patch, grid.cols, patch).transpose(1, 3, 0, 2, 4)
    return np.ascontiguousarray(rows.reshape(grid.rows * grid.cols, 3 * patch * patch))


def rope_angles(args: VisionArgs, grid: PatchGrid) -> Any:
    """The 2-D RoPE angles [rows·cols, head_dim/2] (host numpy float64) of each patch's rotate-half pairs
    (i, i + D/2): pair i < D/4 turns by the patch's row times θ^(-i/(D/4)), pair D/4 + j by its column
    times θ^(-j/(D/4)) (row and column 0-based)."""
    import numpy as np

    quarter = args.head_dim // 4
    freq = args.rope_theta ** (-np.arange(quarter, dtype=np.float64) / quarter)
    row, col = np.divmod(np.arange(grid.rows * grid.cols, dtype=np.float64), grid.cols)
    return np.concatenate((row[:, None] * freq, col[:, None] * freq), axis=1)


class VisionOps(Protocol[A]):
    """What a backend computes for the encoder; the reference does it plainly in torch float32."""

    args: VisionArgs

    def patch_embed(self, pixels: Any, grid: PatchGrid) -> A:
        """Normalised pixels [3, rows·14, cols·14] (host float32) to the patch rows [rows·cols, dim]."""
        ...

    def norm(self, name: str, x: A) -> A:
        """RMSNorm of x [N, dim] with the weight `name` (`vision.blocks.{i}.norm1.weight`...)."""
        ...

    def attend(self, il: int, x: A, grid: PatchGrid) -> A:
        """Block `il`'s attention over one image's normed rows x [N, dim]: wqkv, 2-D RoPE, softmax, wo."""
        ...

    def mlp(self, il: int, x: A) -> A:
        """Block `il`'s SwiGLU MLP of the normed rows x [N, dim]."""
        ...

    def align(self, x: A, grid: PatchGrid) -> A:
        """The aligner: final rows x [N, dim] to image-token rows [ceil(rows/3)·ceil(cols/3), out_dim]."""
        ...


class VisionEncoder(Generic[A]):
    """The encoder's order over a backend's `VisionOps`."""

    def __init__(self, ops: VisionOps[A]) -> None:
        self.ops = ops
        self.args = ops.args

    def encode(self, pixels: Any, grid: PatchGrid) -> A:
        """One image's token rows [ceil(rows/3)·ceil(cols/3), out_dim], in reading order."""
        ops = self.ops
        x = ops.patch_embed(pixels, grid)
        for il in range(self.args.n_layers):
            x = x + ops.attend(il, ops.norm(f"vision.blocks.{il}.norm1.weight", x), grid)
            x = x + ops.mlp(il, ops.norm(f"vision.blocks.{il}.norm2.weight", x))
        return ops.align(ops.norm("vision.norm.weight", x), grid)


def check_tensors(args: VisionArgs, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Every tensor `args` needs is there with its shape (`shapes`: name -> [out, in] shape), or a named error."""
    want = args.tensor_shapes()
    missing = [name for name in want if name not in shapes]
    if missing:
        raise DwarfStarError(f"the vision encoder lacks {len(missing)} tensors, first {missing[0]}")
    for name, shape in want.items():
        if tuple(shapes[name]) != shape:
            raise DwarfStarError(f"vision tensor {name} has shape {tuple(shapes[name])}, expected {shape}")
