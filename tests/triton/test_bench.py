"""The benchmarks' plumbing on tiny shapes (timings are meaningless in the interpreter; the GPU check
runs them for real): every kernel's bench cases run, and the synthetic decode/prefill loops work."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.triton import gpu_bench, synthetic
from dwarfstar.backends.triton.runtime import EXACT, BenchShape
from dwarfstar.model.synthetic import Q2, TINY_K

pytestmark = pytest.mark.whole_model  # tests/triton/conftest.py: no int32 overflow checks


def test_every_kernel_has_bench_cases_that_run(device, tmp_path):
    shape = BenchShape(TINY_K, device, ctx=64, prefill=16)
    rows = gpu_bench.run_kernels(shape, gpu_bench.Peak("test", 100.0, 10.0))
    assert {r["kernel"] for r in rows} == set(gpu_bench.KERNELS)
    assert all(r["us"] > 0 and r["GB/s"] > 0 and r["%peak_bw"] != "" for r in rows)
    path = tmp_path / "kernels.csv"
    gpu_bench.write_csv(rows, path)
    assert path.read_text().splitlines()[0].startswith("kernel,case,us,GB/s")


def test_peak_table_and_override():
    assert gpu_bench.device_peak(torch.device("cpu"), peak_gbs=273.0).gbs == 273.0
    names = [name for name, _, _ in gpu_bench.KNOWN_GPUS]
    assert names.index("H100 PCIe") < names.index("H100")  # the specific entry matches first


def test_synthetic_decode_and_prefill_loops(device, monkeypatch):
    monkeypatch.setitem(synthetic.PRESETS, "tiny-k", (TINY_K, Q2))
    peak = gpu_bench.Peak("test", 100.0, None)
    one, two = gpu_bench.run_decode("tiny-k", None, [40], steps=1, device=device, peak=peak, warmup=1, batches=(1, 2))
    assert (one["ctx"], one["batch"], two["batch"]) == (40, 1, 2)
    assert one["tok/s"] > 0 and two["tok/s"] > 0
    # a step of two sequences reads up to twice the routed experts (TINY_K: 2 of 8 per layer), the rest once
    weights = synthetic.synthetic_weights("tiny-k", None, device)
    routed = sum(lw.gate_exps.nbytes + lw.up_exps.nbytes + lw.down_exps.nbytes for lw in weights.layers.values())
    per_expert = routed / TINY_K.n_routed_experts
    assert two["weight_GB/step"] - one["weight_GB/step"] == pytest.approx(
        (TINY_K.n_activated_experts * per_expert + weights.embed.row_bytes) / 1e9, abs=1e-3
    )
    (row,) = gpu_bench.run_prefill("tiny-k", None, tokens=2, chunk=2, device=device, precision=EXACT)
    assert row["tokens"] == 2 and row["tok/s"] > 0


def test_cli_refuses_to_time_the_interpreter():
    """Without a GPU, `dwarfstar bench kernels` says so instead of timing Python."""
    if torch.cuda.is_available():
        return  # on a GPU the command runs for real (tools/gpu_check.sh)
    from typer.testing import CliRunner

    from dwarfstar.cli import _register_commands, app

    _register_commands()
    result = CliRunner().invoke(app, ["bench", "kernels", "--only", "topk"])
    assert result.exit_code != 0
    assert "need a CUDA or ROCm GPU" in str(result.exception)


def test_csv_rows_are_on_disk_as_they_come(tmp_path):
    """The header at once and each row flushed when emitted: a run killed mid-way keeps its rows."""
    path = tmp_path / "decode.csv"
    out = gpu_bench.CsvRows(path, ("ctx", "tok/s"))
    assert path.read_text().splitlines() == ["ctx,tok/s"]
    out({"ctx": 2048, "tok/s": 80.5})
    assert path.read_text().splitlines() == ["ctx,tok/s", "2048,80.5"] and out.rows == [{"ctx": 2048, "tok/s": 80.5}]
    out.close()
