"""`dwarfstar bench dist`: one process, then a 2-stage route whose worker the bench spawns itself,
with each hop's layers and the bytes it moved. And `dwarfstar bench` (the context frontiers) as a
route's coordinator, over a V4 file and a V4.1 one."""

from __future__ import annotations

import csv
import re

import pytest
from conftest import Cluster, free_port
from typer.testing import CliRunner

from dwarfstar.bench.frontier import kv_bytes_read, weight_bytes_per_token
from dwarfstar.bench.token_bytes41 import kv_bytes_read41
from dwarfstar.cli import _register_commands, app
from dwarfstar.model.file_v41 import open_model41
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY
from dwarfstar.model.synthetic_v41 import V41_TINY


def test_bench_dist_runs_one_process_then_a_spawned_route(tiny_model_file):
    _register_commands()
    args = ["bench", "dist", "-m", str(tiny_model_file(0)), "--stages", "1,2", "--prompt", "24", "--decode", "3"]
    done = CliRunner().invoke(app, [*args, "--dist-addr", f"127.0.0.1:{free_port()}", "--timeout", "300"])
    assert done.exit_code == 0, done.output
    stages = re.findall(r"^stages (\d): prefill ([\d.]+) tok/s, decode ([\d.]+) tok/s$", done.output, re.M)
    assert [s[0] for s in stages] == ["1", "2"]
    assert all(float(prefill) > 0 and float(decode) > 0 for _, prefill, decode in stages)
    # the split by bytes gives the worker the second half of the layers and the head
    hop = r"^  layers (\d+):(\w+) \((coordinator|worker 1)\) tokens 1 .*?(?:bytes (\d+))?$"
    hops = re.findall(hop, done.output, re.M)
    assert [h[:3] for h in hops] == [("0", "3", "coordinator"), ("3", "output", "worker 1")]
    # a decode step sends one token's 4 streams of float32 and gets back its float32 logits
    moved = int(hops[1][3])
    payload = 4 * TINY.dim * 4 + TINY.vocab_size * 4
    assert payload <= moved < payload + 1024
    assert re.search(r"^  worker 3:output: resident \d+ MiB", done.output, re.M)


def frontier_rows(tiny, out, *extra: str) -> list[dict[str, str]]:
    _register_commands()
    args = ["bench", "-m", str(tiny), "--backend", "reference", "--ctx-start", "16", "--ctx-max", "32"]
    done = CliRunner().invoke(app, [*args, "--step-incr", "16", "-n", "4", "--csv", str(out), *extra])
    assert done.exit_code == 0, done.output
    with out.open() as f:
        return list(csv.DictReader(f))


def test_bench_runs_on_a_coordinator(clusters, tiny_model_file, tmp_path):
    cluster, tiny = clusters["bench"], tiny_model_file(0)
    one = frontier_rows(tiny, tmp_path / "one.csv")
    route = ["--dist-role", "coordinator", "--layers", "0:3", "--dist-addr", cluster.addr, "--dist-timeout", "300"]
    routed = frontier_rows(tiny, tmp_path / "route.csv", *route)
    fixed = ("ctx_tokens", "prefill_tokens", "gen_tokens", "kvcache_bytes")
    assert [[r[k] for k in fixed] for r in routed] == [[r[k] for k in fixed] for r in one]
    # GB/s counts the weights of every stage, not only the coordinator's 3 layers
    weights = weight_bytes_per_token(open_model(tiny))
    for row in routed:
        expected = (weights + kv_bytes_read(TINY, int(row["ctx_tokens"]), 4)) * float(row["gen_tps"]) / 1e9
        assert float(row["gen_gbps"]) == pytest.approx(expected, abs=0.006, rel=0.01)
    assert cluster.workers["3:output"].wait(timeout=60) == 0  # the coordinator's exit shut the worker down


def test_bench_runs_on_a_v41_coordinator(v41_tiny_file, tmp_path):
    # v41-tiny cut at its candidate source (layer 6), as tests/distributed/test_dist_v41.py routes it
    cluster = Cluster(v41_tiny_file, ["0:6", "6:output"], tmp_path, cli=True)
    try:
        route = ["--dist-role", "coordinator", "--layers", "0:6", "--dist-addr", cluster.addr, "--dist-timeout", "300"]
        rows = frontier_rows(v41_tiny_file, tmp_path / "route.csv", *route)
        assert cluster.workers["6:output"].wait(timeout=60) == 0
    finally:
        cluster.close()
    assert [int(r["ctx_tokens"]) for r in rows] == [16, 32]
    model = open_model41(v41_tiny_file)  # every stage's weights: the whole file's table
    weights = weight_bytes_per_token(model)
    model.close()
    for row in rows:
        expected = (weights + kv_bytes_read41(V41_TINY, int(row["ctx_tokens"]))) * float(row["gen_tps"]) / 1e9
        assert float(row["gen_gbps"]) == pytest.approx(expected, abs=0.006, rel=0.01)
