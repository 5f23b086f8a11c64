"""Plot `dwarfstar bench experts --json` results and project Flash decode tok/s from them.

    .venv/bin/python tools/experts_projection.py BENCH.json [BENCH2.json ...] --out plot.png [--bound BOUND.json]

`--bound` adds the online bound of `dwarfstar bench experts-bound --json` (the best hit rate any online
policy can expect on the synthetic skewed trace) to the hit-rate panel.

The projection is a model, not a measurement: a decode token of the real Flash q2 file reads every
routed expert it uses (43 layers x 6 x 6.75 MiB) from memory, the missed fraction (1 - hit rate at
that budget) also from the SSD, and every non-routed weight except the embedding table from
memory; memory and SSD time add up (no overlap). Bandwidths are the machines' published memory
figures and assumed SSD read rates (see MACHINES).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dwarfstar.experts.layout import spec_bytes, split_bytes  # noqa: E402
from dwarfstar.model.config import ModelArgs  # noqa: E402
from dwarfstar.model.synthetic import tensor_type  # noqa: E402
from dwarfstar.model.tensors import EMBED, expected_tensors  # noqa: E402

# name -> (memory GB/s: published, SSD read GB/s: assumed NVMe class of the machine)
MACHINES = {
    "GB10 (273 GB/s LPDDR5x, 7 GB/s SSD assumed)": (273.0, 7.0),
    "M3 Max (400 GB/s, 6 GB/s SSD assumed)": (400.0, 6.0),
    "Strix Halo (256 GB/s LPDDR5x, 7 GB/s PCIe4 SSD assumed)": (256.0, 7.0),
}


def flash_bytes() -> tuple[float, float]:
    """(routed bytes one Flash token uses, non-routed bytes it reads) for the q2 file, in GB."""
    args = ModelArgs.flash()
    routed, other = split_bytes(args, lambda spec: tensor_type(spec, "ds4"))
    per_expert = routed / (args.n_layers * args.n_routed_experts)
    embed = next(s for s in expected_tensors(args) if s.name == EMBED)  # one row of it is read per token
    embed_bytes = spec_bytes(embed, tensor_type(embed, "ds4"))
    return args.n_layers * args.n_activated_experts * per_expert / 1e9, (other - embed_bytes) / 1e9


def project(hit: float, routed_gb: float, dense_gb: float, memory: float, ssd: float) -> float:
    return 1.0 / ((routed_gb + dense_gb) / memory + (1 - hit) * routed_gb / ssd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--bound", type=Path, help="bench experts-bound --json output")
    opts = parser.parse_args()
    routed_gb, dense_gb = flash_bytes()
    print(f"Flash q2 decode token: {routed_gb:.3f} GB of routed experts, {dense_gb:.3f} GB of other weights")
    fig, (hits, speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    for path in opts.bench:
        result = json.loads(path.read_text())
        rows = result["rows"]
        budgets = [r["budget_pct"] for r in rows]
        label = Path(result["trace"]).stem
        for name, style in (("ds4", "-o"), ("lru", "--s"), ("belady", ":^")):
            hits.plot(budgets, [r[f"{name}_hit"] for r in rows], style, label=f"{label}: {name}")
        for machine, (memory, ssd) in MACHINES.items():
            tps = [project(r["ds4_hit"], routed_gb, dense_gb, memory, ssd) for r in rows]
            speed.plot(budgets, tps, "-o", label=f"{label}: {machine}")
            print(label, machine, " ".join(f"{b:g}%={t:.1f}" for b, t in zip(budgets, tps, strict=True)))
    if opts.bound:
        rows = json.loads(opts.bound.read_text())["rows"]
        budgets = [r["budget_pct"] for r in rows]
        hits.plot(budgets, [r["online_bound"] for r in rows], "k-.", label="skewed: online bound (independent refs)")
    hits.set(xlabel="cache budget (% of experts)", ylabel="hit rate", title="Expert cache hit rate (replay)")
    speed.set(xlabel="cache budget (% of experts)", ylabel="tok/s", title="PROJECTED Flash q2 decode tok/s")
    hits.legend(fontsize=7)
    speed.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(opts.out, dpi=110)
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
