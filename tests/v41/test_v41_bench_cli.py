"""`dwarfstar bench` and `dwarfstar bench mtp` on a DeepSeek V4.1 file (issue 33), on `v41-tiny`: the
frontier CSV with V4.1's state sizes and its GB/s from the bytes a V4.1 token reads (counted here again
from the file's tensor table: the routed experts k of E, one embedding row, no Engram table; the KV of
CSA2's shared rows), the Engram rows reported apart; `bench mtp` measures plain greedy against DSpark and
refuses MTP drafts, which V4.1 has none of."""

from __future__ import annotations

import csv
import re

import pytest
from typer.testing import CliRunner

from dwarfstar.bench.frontier import CSV_HEADER, weight_bytes_per_token
from dwarfstar.bench.token_bytes41 import kv_bytes_read41
from dwarfstar.cli import _register_commands, app
from dwarfstar.errors import DwarfStarError
from dwarfstar.kvcache.payload_v41 import payload41_nbytes
from dwarfstar.model.file_v41 import open_model41
from dwarfstar.model.synthetic_v41 import TINY_DSPARK41, V41_TINY

SMALL = ("--backend", "reference", "--engram-cache", "1")


def invoke(*args: str):
    _register_commands()
    return CliRunner().invoke(app, list(args))


def file_weight_bytes(path) -> int:
    """Every tensor of the file but the Engram tables, with one row of the embedding and, per layer, 2 of the
    8 routed experts' bytes."""
    model = open_model41(path)
    try:
        tensors = model.gguf.tensors
        total = 0
        for name, info in tensors.items():
            if name.endswith("engram_embd.weight"):
                continue
            if name == "token_embd.weight":
                total += info.nbytes // V41_TINY.vocab_size
            elif not name.endswith("_exps.weight"):
                total += info.nbytes
        for il in range(V41_TINY.n_layers):
            experts = sum(tensors[f"blk.{il}.ffn_{part}_exps.weight"].nbytes for part in ("gate", "up", "down"))
            total += experts * 2 // 8
        return total
    finally:
        model.close()


def test_token_bytes_follow_the_tensor_table_and_csa2(v41_tiny_file):
    model = open_model41(v41_tiny_file)
    try:
        assert weight_bytes_per_token(model) == file_weight_bytes(v41_tiny_file)
    finally:
        model.close()
    # at 32 tokens: 12 windows of 8 rows; ratio-2 layers 2..5 read 16 rows of kv sources 2 and 4 (top-4
    # each), ratio-1 layers 6..11 32 rows of source 6; index keys scored on the index sources 2, 4, 6, 8, 10
    window = 12 * 8 * 128
    picked = 10 * 4 * 128
    scored = 2 * 16 * 64 + 3 * 32 * 64
    assert kv_bytes_read41(V41_TINY, 32) == 4 * (window + picked + scored)


def test_bench_measures_the_frontiers_of_a_v41_file(v41_tiny_file, tmp_path):
    out = tmp_path / "bench.csv"
    frontier = ("--ctx-start", "16", "--ctx-max", "32", "--step-incr", "16", "-n", "4", "--csv", str(out))
    done = invoke("bench", "-m", str(v41_tiny_file), *SMALL, *frontier)
    assert done.exit_code == 0, done.output
    weights = file_weight_bytes(v41_tiny_file)
    assert f"weights read per token {weights / 1e6:.1f} MB" in done.output
    assert "Engram rows 48 x 264 B = 12.7 kB per token (from the file, not in GB/s)" in done.output
    with out.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == CSV_HEADER
    assert [(int(r["ctx_tokens"]), int(r["prefill_tokens"]), int(r["gen_tokens"])) for r in rows] == [
        (16, 16, 4),
        (32, 16, 4),
    ]
    for r in rows:
        ctx, tps = int(r["ctx_tokens"]), float(r["gen_tps"])
        assert int(r["kvcache_bytes"]) == payload41_nbytes(V41_TINY, ctx)
        assert float(r["prefill_tps"]) > 0 and tps > 0
        expected = (weights + kv_bytes_read41(V41_TINY, ctx)) * tps / 1e9
        assert float(r["gen_gbps"]) == pytest.approx(expected, abs=0.006, rel=0.01)


def test_bench_mtp_measures_dspark_against_plain_greedy(v41_tiny_file, v41_dspark_file):
    args = ("bench", "mtp", "-m", str(v41_tiny_file), *SMALL, "-n", "6", "-p", "Quel ramo del lago")
    done = invoke(*args, "--drafts", "none", "--dspark", str(v41_dspark_file))
    assert done.exit_code == 0, done.output
    assert re.search(r"^backend reference \| 1 prompt\(s\), \d+ tokens \| plain greedy: [\d.]+ tok/s over 6 tokens$",
                     done.output, re.M)  # fmt: skip
    runs = [line.split() for line in done.output.splitlines() if line.startswith(("mtp ", "dspark "))]
    assert len(runs) == 1 and runs[0][:2] == ["dspark", "0"]
    acceptance, (per_step, tokens_per_step, rollbacks, tps, _, same) = runs[0][2:-6], runs[0][-6:]
    assert 1 <= len(acceptance) < TINY_DSPARK41.d.block_size and all(0 <= float(a) <= 1 for a in acceptance)
    assert 0 <= float(per_step) < float(tokens_per_step) and int(rollbacks) >= 0 and float(tps) > 0
    assert same == "yes"  # the text is plain greedy's
    # V4.1 has no MTP block: MTP drafts (the default 1,2,3) are refused before anything loads
    refused = invoke(*args, "--dspark", str(v41_dspark_file))
    assert isinstance(refused.exception, DwarfStarError)
    assert "no MTP block" in str(refused.exception) and "--drafts none" in str(refused.exception)
    assert "plain greedy" not in refused.output
