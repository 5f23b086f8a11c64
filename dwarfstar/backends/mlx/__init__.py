"""MLX backend for Apple silicon, with custom Metal kernels and a portable built-in-ops path.

`mlx_available()` is True wherever `mlx.core` imports (the portable path runs on Linux CPU too);
`metal_available()` only on Apple silicon with Metal, where `engine.pick_backend("auto")` prefers
MLX. The weight packing (`weights.PACKINGS`) defaults to GGUF blocks read by the Metal kernels when
Metal is present and to the exact repack otherwise; `DWARFSTAR_MLX_PACKING` overrides it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dwarfstar.backends.mlx.model import MLXModel
    from dwarfstar.model.loader import ModelFile

PACKING_ENV = "DWARFSTAR_MLX_PACKING"


def mlx_available() -> bool:
    try:
        import mlx.core  # noqa: F401
    except ImportError:
        return False
    return True


def metal_available() -> bool:
    if not mlx_available():
        return False
    import mlx.core as mx

    return mx.metal.is_available()


def default_packing() -> str:
    return os.environ.get(PACKING_ENV) or ("blocks" if metal_available() else "exact")


def load_backend(
    model: ModelFile,
    qat: bool = True,
    packing: str | None = None,
    max_seq_len: int | None = None,
    stream_experts: bool = False,
    kv_slots: int = 1,
) -> MLXModel:
    """With `stream_experts` the routed experts are not loaded (`experts.attach` streams them);
    `kv_slots` sequences to a KV-cache block (forks in a block share their row pages)."""
    from dwarfstar.backends.mlx.model import MLXModel

    return MLXModel(
        model, qat=qat, packing=packing or default_packing(), max_seq_len=max_seq_len,
        routed_experts=not stream_experts, kv_slots=kv_slots,
    )  # fmt: skip
