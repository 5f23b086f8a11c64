"""Quantization error of DwarfStar's encoders against llama.cpp's, on the same tensors.

Run through `nox -s quant_compare` (installs llama-cpp-python==0.3.36). It writes the f32 `tiny-k`
synthetic model, quantizes its routed-expert tensors with `llama_model_quantize` (a tensor-type override
puts them in the type under test; imatrix data is passed the way `llama-quantize --imatrix` does) and
with `dwarfstar.gguf.quantize`, decodes both with our dequantizer and prints, per type and imatrix
setting, the relative RMS error and the importance-weighted relative RMS error summed over the 18
expert tensors. Exits 1 if ours is worse than --max-ratio times llama.cpp's on either measure.

The importance is log-normal per (expert, column): a few columns carry most of the activation energy,
as in real transformer activations. Then llama.cpp runs whole files written by `dwarfstar quantize`
(q8, q4, q2) and its logits are compared with our reference backend's on the same file, position by
position: a misread block would give errors of the order of the logits themselves, while llama.cpp's
own arithmetic (activations rounded to 8 bits for quantized matmuls) costs a few percent, as the q8
file shows. `--speed` also times each
encoder on a slice of a Flash-sized expert tensor and extrapolates to the 256 × 2048 × 4096 tensor.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import torch

from dwarfstar.gguf.constants import GGMLType
from dwarfstar.gguf.dequant import dequantize
from dwarfstar.gguf.quantize import quantize
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.synthetic import TINY_K, write_synthetic_model

TYPES = (GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q2_K, GGMLType.IQ2_XXS)
EXPERT_PATTERN = "ffn_(gate|up|down)_exps"


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet(level: int, text: bytes, user_data: object) -> None:
    """llama.cpp logs a line per tensor; the table below is what this tool reports."""


def llama_quantize(src: Path, dst: Path, ggml_type: GGMLType, imatrix: dict[str, torch.Tensor] | None) -> None:
    import llama_cpp as lc

    lc.llama_log_set(_quiet, None)
    params = lc.llama_model_quantize_default_params()
    params.ftype = lc.LLAMA_FTYPE_MOSTLY_Q8_0
    params.nthread = 2
    keep: list[object] = []  # ctypes buffers must outlive the call
    overrides = (lc.llama_model_tensor_override * 2)()
    overrides[0].pattern = EXPERT_PATTERN.encode()
    overrides[0].type = int(ggml_type)
    overrides[1].pattern = None
    params.tt_overrides = overrides
    if imatrix is not None:
        entries = (lc.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, values) in enumerate(imatrix.items()):
            flat = values.reshape(-1).contiguous().numpy()
            keep += [flat, name.encode()]
            entries[i].name = keep[-1]
            entries[i].data = flat.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = flat.size
        entries[len(imatrix)].name = None
        params.imatrix = entries
    if lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed for {ggml_type.name}")


def errors(ref: torch.Tensor, test: torch.Tensor, importance: torch.Tensor) -> tuple[float, float, float, float]:
    """(Σ err², Σ x², Σ imp·err², Σ imp·x²) of one tensor; importance broadcasts over its rows."""
    err2 = (test - ref).square()
    return (
        float(err2.sum()),
        float(ref.square().sum()),
        float((err2 * importance).sum()),
        float((ref.square() * importance).sum()),
    )


def compare(tmp: Path, max_ratio: float) -> bool:
    src = tmp / "tiny-k-f32.gguf"
    write_synthetic_model(src, TINY_K, layout="f32", seed=0)
    f32 = GGUFFile(src)
    names = [n for n in f32.tensors if n.endswith("_exps.weight")]
    gen = torch.Generator().manual_seed(1)
    importance = {}
    for name in names:
        n_expert, _, cols = f32.tensors[name].shape
        importance[name] = torch.randn(n_expert, 1, cols, generator=gen).mul(1.5).exp()
    ok = True
    print(f"{'type':8} {'imatrix':7} {'rmse ours':>10} {'llama.cpp':>10} {'ratio':>6}  ", end="")
    print(f"{'w-rmse ours':>11} {'llama.cpp':>10} {'ratio':>6}")
    for ggml_type in TYPES:
        for use_imatrix in (False, True):
            if ggml_type == GGMLType.IQ2_XXS and not use_imatrix:
                continue  # llama.cpp refuses IQ2_XXS without an imatrix
            dst = tmp / f"llama-{ggml_type.name}-{use_imatrix}.gguf"
            llama_quantize(src, dst, ggml_type, importance if use_imatrix else None)
            theirs_file = GGUFFile(dst)
            sums = {"ours": [0.0] * 4, "llama": [0.0] * 4}
            for name in names:
                ref = f32.tensor(name)
                info = theirs_file.tensors[name]
                assert info.ggml_type == ggml_type, f"llama.cpp wrote {name} as {info.ggml_type.name}"
                theirs = dequantize(theirs_file.raw(name), info.ggml_type, info.n_elements).reshape(ref.shape)
                raw = quantize(ref, ggml_type, importance[name] if use_imatrix else None)
                ours = dequantize(raw, ggml_type, ref.numel()).reshape(ref.shape)
                for key, test in (("ours", ours), ("llama", theirs)):
                    sums[key] = [a + b for a, b in zip(sums[key], errors(ref, test, importance[name]), strict=True)]
            theirs_file.close()
            o, t = sums["ours"], sums["llama"]
            rmse = ((o[0] / o[1]) ** 0.5, (t[0] / t[1]) ** 0.5)
            wrmse = ((o[2] / o[3]) ** 0.5, (t[2] / t[3]) ** 0.5)
            r1, r2 = rmse[0] / rmse[1], wrmse[0] / wrmse[1]
            ok &= r1 <= max_ratio and r2 <= max_ratio
            print(
                f"{ggml_type.name:8} {'yes' if use_imatrix else 'no':7} {rmse[0]:10.5f} {rmse[1]:10.5f} {r1:6.3f}  "
                f"{wrmse[0]:11.5f} {wrmse[1]:10.5f} {r2:6.3f}"
            )
    f32.close()
    return ok


def llama_runs_our_files(tmp: Path, max_error: float) -> bool:
    """Our files through llama.cpp: logits against the reference backend's (QAT rounding off)."""
    import llama_cpp as lc
    import numpy as np

    from dwarfstar.backends.reference.model import ReferenceModel
    from dwarfstar.model.loader import open_model
    from dwarfstar.quant.recipes import quantize_model

    tokens = np.random.default_rng(0).integers(3, 128000, 64).tolist()
    ok = True
    for recipe in ("q8", "q4", "q2"):
        path = tmp / f"ours-{recipe}.gguf"
        quantize_model(tmp / "tiny-k-f32.gguf", path, recipe)
        model = open_model(path)
        reference = ReferenceModel(model, qat=False)
        ours = reference.forward(tokens, reference.new_state())
        llm = lc.Llama(
            model_path=str(path),
            n_ctx=256,
            n_batch=64,
            n_ubatch=64,
            logits_all=True,
            verbose=False,
            n_threads=2,
            type_k=lc.GGML_TYPE_F32,
            type_v=lc.GGML_TYPE_F32,
        )
        llm.eval(tokens)
        theirs = torch.from_numpy(np.array(llm.scores[: len(tokens)], dtype=np.float32))
        llm.close()
        model.close()
        rel = float(((ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)).median())
        top1 = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
        ok &= rel <= max_error
        print(
            f"llama.cpp on our {recipe} file: median max|logit error|/max|logit| {rel:.3f}, top-1 agreement {top1:.3f}"
        )
    return ok


def speed(n_experts: int) -> None:
    """Seconds to quantize `n_experts` experts of 2048 × 4096, extrapolated to 256 experts."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n_experts, 2048, 4096, generator=gen) / 64
    importance = torch.randn(n_experts, 1, 4096, generator=gen).exp()
    print(f"quantizing {n_experts} Flash expert(s) of 2048 x 4096 ({torch.get_num_threads()} threads)")
    for ggml_type in TYPES:
        for imp in (None, importance):
            start = time.perf_counter()
            quantize(x, ggml_type, imp)
            elapsed = time.perf_counter() - start
            print(
                f"{ggml_type.name:8} {'imatrix' if imp is not None else 'plain':8} {elapsed:7.1f} s  "
                f"-> {elapsed * 256 / n_experts / 60:6.1f} min for 256 experts"
            )
    print()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-ratio", type=float, default=1.05, help="largest allowed ours/llama.cpp error ratio")
    parser.add_argument("--max-logit-error", type=float, default=0.1, help="llama.cpp vs reference, relative")
    parser.add_argument("--speed", type=int, default=0, metavar="N", help="also time N Flash experts per type")
    opts = parser.parse_args()
    if opts.speed:  # first: running a tiny model drops torch to one thread (reference backend)
        speed(opts.speed)
    with tempfile.TemporaryDirectory() as tmp:
        ok = compare(Path(tmp), opts.max_ratio)
        ok &= llama_runs_our_files(Path(tmp), opts.max_logit_error)
    print("OK" if ok else f"FAIL: an error ratio is above {opts.max_ratio}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
