"""One Engram table row as ds4's V4.1 GGUFs store it (issue 33): 256 FP8 E4M3 values, then 8 E8M0
scales, one per block of 32 values, 264 bytes in all (`blk.L.engram_embd.weight`, I8 `(264, rows)`).

A value is its FP8 E4M3 number (the `fn` variant: bias 7, no infinities, 0x7F and 0xFF are NaN) times
its block's scale 2^(e - 127); the E8M0 byte 0xFF is NaN. `dequantize` turns rows into float32 values
with one table lookup per byte; `quantize` is the inverse a synthetic table is written with (the scale
the smallest power of two that keeps the block's largest magnitude within FP8's 448).
"""

from __future__ import annotations

import numpy as np
import torch

ROW_VALUES = 256
SCALE_BLOCK = 32  # values per E8M0 scale
ROW_SCALES = ROW_VALUES // SCALE_BLOCK
ROW_BYTES = ROW_VALUES + ROW_SCALES  # 264
FP8_MAX = 448.0
E8M0_BIAS = 127

# every FP8 E4M3 byte's value, as torch reads the type
FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def dequantize(raw: np.ndarray) -> np.ndarray:
    """Rows `[n, 264]` (uint8) as float32 values `[n, 256]`."""
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1, ROW_BYTES)
    exponent = raw[:, ROW_VALUES:].astype(np.int32)
    scales = np.ldexp(np.float32(1), np.minimum(exponent, 254) - E8M0_BIAS)
    scales[exponent == 255] = np.nan
    values = FP8_VALUES[raw[:, :ROW_VALUES]].reshape(-1, ROW_SCALES, SCALE_BLOCK)
    return (values * scales[:, :, None].astype(np.float32)).reshape(-1, ROW_VALUES)


def quantize(values: np.ndarray) -> np.ndarray:
    """Float rows `[n, 256]` as stored rows `[n, 264]` (uint8): per block of 32, the scale's exponent and
    each value over the scale rounded to FP8 E4M3."""
    blocks = np.asarray(values, dtype=np.float32).reshape(-1, ROW_SCALES, SCALE_BLOCK)
    peak = np.abs(blocks).max(axis=2)
    exponent = np.ceil(np.log2(np.maximum(peak, np.float32(1e-30)) / FP8_MAX)).astype(np.int32)
    exponent = np.clip(exponent, -E8M0_BIAS, 127)
    scaled = blocks / np.ldexp(np.float32(1), exponent)[:, :, None]
    fp8 = torch.from_numpy(np.ascontiguousarray(scaled)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    out = np.empty((blocks.shape[0], ROW_BYTES), dtype=np.uint8)
    out[:, :ROW_VALUES] = fp8.reshape(-1, ROW_VALUES)
    out[:, ROW_VALUES:] = (exponent + E8M0_BIAS).astype(np.uint8)
    return out
