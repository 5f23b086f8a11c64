"""Decode speed of the MLX backend against the reference backend, and against the memory bandwidth.

`compare_decode` prefills a prompt on each backend, then decodes the same fixed tokens one at a
time (teacher-forced, so both do identical work whatever their logits), and reports tok/s, the
MLX/reference ratio, the parity of the decoded logits, and the bandwidth the MLX run achieved: the
bytes a decoded token must read (the file's weights a token touches plus the KV it attends to,
counted as `dwarfstar bench` does) times tok/s, as a fraction of the chip's specified bandwidth
where the chip is known and of a measured streaming read otherwise.
"""

from __future__ import annotations

import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import torch

from dwarfstar.backends.mlx import default_packing, metal_available
from dwarfstar.backends.mlx.model import MLXModel
from dwarfstar.backends.mlx.parity import compare_logits
from dwarfstar.backends.protocol import Backend
from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.bench.frontier import kv_bytes_read, weight_bytes_per_token
from dwarfstar.model.loader import open_model

# Specified unified-memory bandwidth (GB/s) by chip, and by performance-core count where one name
# covers two bandwidths (binned Max chips).
CHIP_BANDWIDTH = {
    "Apple M1": 68.25,
    "Apple M1 Pro": 200,
    "Apple M1 Max": 400,
    "Apple M1 Ultra": 800,
    "Apple M2": 100,
    "Apple M2 Pro": 200,
    "Apple M2 Max": 400,
    "Apple M2 Ultra": 800,
    "Apple M3": 100,
    "Apple M3 Pro": 150,
    "Apple M3 Max": {10: 300, 12: 400},
    "Apple M3 Ultra": 819,
    "Apple M4": 120,
    "Apple M4 Pro": 273,
    "Apple M4 Max": {10: 410, 12: 546},
}


def _sysctl(name: str) -> str:
    return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, check=False).stdout.strip()


def chip_bandwidth() -> tuple[str, float | None]:
    """(chip name, specified GB/s or None when the chip is not Apple silicon or not in the table)."""
    if platform.system() != "Darwin":
        return platform.processor() or platform.machine(), None
    chip = _sysctl("machdep.cpu.brand_string")
    entry = CHIP_BANDWIDTH.get(chip)
    if isinstance(entry, dict):
        entry = entry.get(int(_sysctl("hw.perflevel0.physicalcpu") or 0))
    return chip, entry


def measured_read_bandwidth(gigabytes: float = 1.0, repeats: int = 5) -> float:
    """GB/s of a streaming read (a sum over a large array) on MLX's default device, best of `repeats`."""
    x = mx.ones((int(gigabytes * 2**30) // 4,), dtype=mx.float32)
    mx.eval(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(x.sum())
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best / 1e9


def time_decode(backend: Backend, prompt: Sequence[int], steps: Sequence[int]) -> tuple[float, torch.Tensor]:
    """(tok/s, logits [len(steps), vocab]) of decoding `steps` one token at a time after `prompt`.

    The first step is run untimed: it pays one-off costs (kernel compilation, first allocations).
    """
    state = backend.new_state()
    backend.forward(list(prompt), state, all_logits=False)
    logits = [backend.forward([steps[0]], state, all_logits=False)]
    start = time.perf_counter()
    for token in steps[1:]:
        logits.append(backend.forward([token], state, all_logits=False))
    return (len(steps) - 1) / (time.perf_counter() - start), torch.cat(logits)


def compare_decode(
    model_path: str | Path,
    tokens: int = 32,
    prompt_tokens: int = 16,
    with_reference: bool = True,
    packing: str | None = None,
    qat: bool = True,
) -> dict:
    """Decode tok/s of MLX and (optionally) the reference on one model, their ratio, parity and bandwidth."""
    model = open_model(model_path)
    args = model.args
    ids = torch.randint(3, args.vocab_size, (prompt_tokens + tokens,), generator=torch.Generator().manual_seed(0))
    prompt, steps = ids[:prompt_tokens].tolist(), ids[prompt_tokens:].tolist()
    packing = packing or default_packing()
    mlx_tps, mlx_logits = time_decode(MLXModel(model, qat=qat, packing=packing), prompt, steps)
    chip, spec_gbs = chip_bandwidth()
    read_gbs = measured_read_bandwidth(1.0 if metal_available() else 0.25)
    mean_ctx = prompt_tokens + tokens // 2
    token_bytes = weight_bytes_per_token(model) + kv_bytes_read(args, mean_ctx, 4)
    achieved = token_bytes * mlx_tps / 1e9
    report = {
        "model": str(model_path),
        "prompt_tokens": prompt_tokens,
        "decode_tokens": tokens,
        "device": "gpu" if metal_available() else "cpu",
        "chip": chip,
        "packing": packing,
        "mlx_tok_s": mlx_tps,
        "bytes_per_token": token_bytes,
        "achieved_gb_s": achieved,
        "measured_read_gb_s": read_gbs,
        "fraction_of_measured_read": achieved / read_gbs,
        "spec_gb_s": spec_gbs,
        "fraction_of_spec": None if spec_gbs is None else achieved / spec_gbs,
        "bandwidth_limit_tok_s": (spec_gbs or read_gbs) * 1e9 / token_bytes,
    }
    if with_reference:
        ref_tps, ref_logits = time_decode(ReferenceModel(model, qat=qat), prompt, steps)
        parity = compare_logits(ref_logits, mlx_logits)
        report |= {
            "reference_tok_s": ref_tps,
            "mlx_over_reference": mlx_tps / ref_tps,
            "max_rel": parity.max_rel,
            "mean_kl": parity.mean_kl,
        }
    model.close()
    return report
