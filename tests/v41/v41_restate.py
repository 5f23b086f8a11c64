"""Numpy restatements of V4.1's number formats, written from its reference's text (not from the code under
test): bf16 and e4m3 rounding to nearest-even by brute force over the format's values, the
power-of-two-scaled FP8 block rounding, FP4 e2m1 rounding, interleaved RoPE, RMS norm; and the
recording of one pass's fake-quants that a second pass, restating it, takes (`roundings_taken`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

# every finite e4m3fn value with its byte code (the format's definition, read through torch's dtype)
_CODES = np.arange(256, dtype=np.uint8)
_VALUES = torch.from_numpy(_CODES.copy()).view(torch.float8_e4m3fn).float().numpy().astype(np.float64)
_FINITE = np.isfinite(_VALUES)
E4M3_VALUES, E4M3_CODES = _VALUES[_FINITE], _CODES[_FINITE]
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def report(name: str, got: np.ndarray, want: np.ndarray) -> float:
    """Max error of got relative to the largest |want| (printed for the report; pytest -s shows it)."""
    err = float(np.max(np.abs(np.asarray(got, np.float64) - want)) / max(np.max(np.abs(want)), 1e-30))
    print(f"[v41] {name}: max error {err:.3g} (relative to max |value|)")
    return err


def bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest, ties to an even last kept bit), as float64."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def nearest_even(x: np.ndarray, values: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Each x to the nearest of `values`; a tie goes to the even code."""
    flat = np.asarray(x, np.float64).reshape(-1)
    dist = np.abs(flat[:, None] - values[None, :])
    best = dist.min(1, keepdims=True)
    cand = dist == best
    tie = cand.sum(1) > 1
    cand[tie] &= (codes % 2 == 0)[None, :]
    return values[cand.argmax(1)].reshape(np.shape(x))


def e4m3(x: np.ndarray) -> np.ndarray:
    return nearest_even(np.clip(x, -448, 448), E4M3_VALUES, E4M3_CODES)


def e2m1(x: np.ndarray) -> np.ndarray:
    """Magnitude to the nearest e2m1 value, ties to the even code (codes 0..7 in grid order)."""
    mag = nearest_even(np.abs(x), E2M1, np.arange(8))
    return np.sign(x) * mag


def blocks(x: np.ndarray, block: int) -> np.ndarray:
    assert x.shape[-1] % block == 0
    return np.asarray(x, np.float64).reshape(*x.shape[:-1], -1, block)


def fp8_pow2(x: np.ndarray, block: int) -> np.ndarray:
    """e4m3 with one power-of-two scale per block: 2^ceil(log2(max(amax, 1e-4) / 448))."""
    b = blocks(x, block)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), 1e-4)
    scale = 2.0 ** np.ceil(np.log2(amax / 448))
    return (e4m3(b / scale) * scale).reshape(x.shape)


def fp4_ue8m0(x: np.ndarray, block: int) -> np.ndarray:
    """e2m1 with a power-of-two scale per block: 2^ceil(log2(amax / 6))."""
    b = blocks(x, block)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), 6 * 2.0**-126)
    scale = 2.0 ** np.ceil(np.log2(amax / 6))
    return (e2m1(np.clip(b / scale, -6, 6)) * scale).reshape(x.shape)


def fp4_e4m3(x: np.ndarray, block: int) -> np.ndarray:
    """The note's §1 main-row format: s = e4m3(max(amax, 6 * 2^-9) / 6), q = e2m1(clamp(x / s, +-6)) * s."""
    b = blocks(x, block)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), 6 * 2.0**-9)
    scale = e4m3(amax / 6)
    return (e2m1(np.clip(b / scale, -6, 6)) * scale).reshape(x.shape)


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + eps)
    return y if weight is None else y * weight


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate interleaved pairs (2i, 2i+1) of the last 2 * len(inv_freq) dims by position * inv_freq[i]."""
    x = np.array(x, np.float64)
    r = 2 * len(inv_freq)
    ang = np.asarray(positions, np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None, :]
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (r // 2,)
    c, s = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    a, b = x[..., -r::2].copy(), x[..., -r + 1 :: 2].copy()
    x[..., -r::2], x[..., -r + 1 :: 2] = a * c - b * s, a * s + b * c
    return x


@contextmanager
def roundings_recorded() -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every FP8 / FP4 fake-quant (`ops.fp8_round`, `ops.fp4_round`) run inside, as (input, output), in order."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recording(fn):
        def wrapped(x, *args, **kwargs):
            out = fn(x, *args, **kwargs)
            calls.append((x.detach().clone(), out.detach().clone()))
            return out

        return wrapped

    with _patched(recording):
        yield calls


@contextmanager
def roundings_taken(calls: list[tuple[torch.Tensor, torch.Tensor]], rtol: float = 1e-4) -> Iterator[None]:
    """Another pass's fake-quants, in the same order, take the recorded pass's rounded values once their
    own inputs agree with its inputs to `rtol` (relative to the largest). Two float32 passes that add in
    different orders differ by an ulp here and there; an element an ulp from a rounding boundary then
    rounds a whole FP8 step (an eighth of its value) or FP4 step apart, and that, not the passes'
    structure, would be the difference left at the logits. Here it is an input difference, checked, and
    the pass's own rounding of its input must agree with the recorded values but for such boundary
    cases (under 1% of the values; FP4 blocks of 16 where 32 are due move 3.5% of
    normally distributed values)."""
    pending = list(calls)

    def taking(fn):
        def wrapped(x, *args, **kwargs):
            assert pending, "this pass rounds more often than the recorded one"
            seen, out = pending.pop(0)
            site = f"rounding {len(calls) - len(pending)}"
            assert x.shape == seen.shape, f"{site}: shape {x.shape} vs {seen.shape}"
            err = float((x - seen).abs().max() / seen.abs().max().clamp_min(1e-30))
            assert err < rtol, f"{site}: inputs differ by {err:.3g} (relative)"
            own = fn(x, *args, **kwargs)  # its own rounding (format, block) must be the recorded pass's
            moved = float((own != out).float().mean())
            assert moved < 0.01, f"{site}: {moved:.1%} of its values round elsewhere"
            return out.clone()

        return wrapped

    with _patched(taking):
        yield
    assert not pending, f"this pass rounds {len(pending)} times less often than the recorded one"


@contextmanager
def _patched(wrap) -> Iterator[None]:
    from dwarfstar.backends.reference import ops

    originals = ops.fp8_round, ops.fp4_round
    ops.fp8_round, ops.fp4_round = (wrap(fn) for fn in originals)
    try:
        yield
    finally:
        ops.fp8_round, ops.fp4_round = originals
