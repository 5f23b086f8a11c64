"""Compare reference logits with llama.cpp's `deepseek4` model (llama-cpp-python) on tiny GGUFs.

Run through `nox -s llama_parity`: it installs llama-cpp-python==0.3.36 (a ~15 minute source build
the first time). The comparison uses an F32 file, an F32 KV cache and the QAT rounding off, since
llama.cpp does not apply the FP8/FP4 rounding (spec §8). Prints one row per check and exits 1 if a
relative error exceeds --tolerance.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def llama_logits(path: Path, tokens: list[int], batch: int) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=max(1024, len(tokens)),
        n_batch=batch,
        n_ubatch=batch,
        logits_all=True,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        verbose=False,
        n_threads=2,
    )
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    llm.close()
    return logits


def main() -> int:
    from dwarfstar.backends.reference.model import ReferenceModel
    from dwarfstar.model.loader import open_model
    from dwarfstar.model.synthetic import TINY, write_synthetic_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--lengths", type=int, nargs="+", default=[300, 700])
    parser.add_argument("--tolerance", type=float, default=2e-5, help="max |err| / max |logit| allowed")
    opts = parser.parse_args()
    worst = 0.0
    print(f"{'seed':>4} {'tokens':>6} {'batch':>5} {'max abs err':>12} {'rel err':>10} {'top-1':>6} {'s':>5}")
    with tempfile.TemporaryDirectory() as tmp:
        for seed in opts.seeds:
            path = Path(tmp) / f"tiny-{seed}.gguf"
            write_synthetic_model(path, TINY, layout="f32", seed=seed)
            model = ReferenceModel(open_model(path), qat=False)
            for length in opts.lengths:
                tokens = np.random.default_rng(seed).integers(3, 128000, length).tolist()
                ours = model.forward(tokens, model.new_state()).numpy()
                for batch in (length, 61):  # one batch, and odd chunks that cross window boundaries
                    start = time.perf_counter()
                    theirs = llama_logits(path, tokens, batch)
                    err = float(np.abs(ours - theirs).max())
                    rel = err / float(np.abs(theirs).max())
                    top1 = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
                    worst = max(worst, rel)
                    print(
                        f"{seed:>4} {length:>6} {batch:>5} {err:>12.3e} {rel:>10.3e} {top1:>6.3f} "
                        f"{time.perf_counter() - start:>5.1f}"
                    )
    print(f"worst relative error {worst:.3e} (tolerance {opts.tolerance:g})")
    return 0 if worst <= opts.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
