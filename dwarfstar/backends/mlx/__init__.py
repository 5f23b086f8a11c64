"""MLX backend for Apple silicon, with custom Metal kernels and a portable built-in-ops path.

`mlx_available()` is True wherever `mlx.core` imports (the portable path runs on Linux CPU too);
`metal_available()` only on Apple silicon with Metal, where `auto` prefers
MLX. The weight packing (`weights.PACKINGS`) defaults to GGUF blocks read by the Metal kernels when
Metal is present and to the exact repack otherwise; `DWARFSTAR_MLX_PACKING` overrides it.
"""

from __future__ import annotations

import os

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
