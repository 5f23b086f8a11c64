"""`GPU_CHECK_DRY=1 tools/gpu_check.sh`: every step of the GPU check gets past its imports, paths and
arguments on this machine, without a GPU and without the packages the GPU image lacks, before a
GPU's minutes are spent on it."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def test_the_dry_gpu_check_gets_every_step_past_its_imports(tmp_path):
    steps = re.search(r"^CAPS=\((.*)\)$", SCRIPT.read_text(), re.M).group(1).split()
    caps = {step.split(":")[0]: int(step.split(":")[1]) for step in steps}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "GPU_CHECK_", "DWARFSTAR_"))}
    env.update(GPU_CHECK_DRY="1", PYTHON=sys.executable, DWARFSTAR_WHEELS=str(tmp_path / "no-wheels"))
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 0, done.stdout + done.stderr
    assert sum(caps.values()) <= 465
    assert list(caps)[:5] == ["warm", "bench", "profile", "ncu", "tests"]  # benchmarks first
    verdicts = {m[1]: m[0] for m in re.findall(r"^(ok|SKIP|TIMEOUT|FAILED rc=\d+)\s+(\S+)", summary, re.M)}
    assert verdicts == {name: "ok" for name in caps}, summary
    bench_log = (out / "bench.log").read_text()
    # 2 contexts x 2 batches x 2 row bounds, in each precision
    assert re.search(r"warm: \d+ launches of 16 decode graphs and 2 prefill chunks recorded", bench_log)
    assert "dry: profile flash-q2 at ctx 2048, batch 1,4, exact,fast" in bench_log
    assert "dry: batch 4 reads" in bench_log and "dry: flash-q2, 2 layers" in bench_log  # the ncu step's model
    for table, first in (("decode", "model"), ("prefill", "model"), ("parity", "model"), ("profile", "batch")):
        with open(out / f"{table}.csv") as f:
            assert next(csv.reader(f))[0] == first  # the header, written before any row is measured


def test_each_failure_reaches_the_failure_log_while_the_run_goes_on(tmp_path):
    """tests/conftest.py's hook, loaded into a pytest run of two workers: the planted failure's
    traceback is in DWARFSTAR_FAILURE_LOG once (from the controller, not again from its worker), the
    passing test is not."""
    (tmp_path / "test_planted.py").write_text(
        "def test_passes():\n    assert True\n\ndef test_fails():\n    assert [1, 2] == [1, 3], 'planted'\n"
    )
    log = tmp_path / "failures.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}  # this run may be a worker
    env.update(DWARFSTAR_FAILURE_LOG=str(log), PYTHONPATH=str(ROOT / "tests"))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-n", "2", "test_planted.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    text = log.read_text()
    assert text.count("==== test_planted.py::test_fails failed (call)") == 1
    assert "AssertionError: planted" in text and "test_passes" not in text
