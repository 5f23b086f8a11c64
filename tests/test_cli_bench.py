"""`dwarfstar bench`: ds4-bench's frontier method, its CSV and plot, and the bytes-per-token count."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from dwarfstar.bench.frontier import CSV_HEADER, frontiers, kv_bytes_read, weight_bytes_per_token
from dwarfstar.errors import DwarfStarError
from dwarfstar.kvcache.payload import payload_nbytes
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_synthetic_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_synthetic_model(path, TINY, seed=0)
    return path


def test_frontiers_follow_ds4_bench_steps() -> None:
    assert frontiers(2048, 32768, 2048, 1.0) == list(range(2048, 32769, 2048))
    assert frontiers(256, 2048, 2048, 2.0) == [256, 512, 1024, 2048]
    assert frontiers(100, 250, 100, 1.0) == [100, 200]
    with pytest.raises(DwarfStarError):
        frontiers(4096, 2048, 2048, 1.0)


def test_bytes_per_decoded_token(tiny) -> None:
    model = open_model(tiny)
    tensors = model.gguf.tensors
    everything = sum(t.nbytes for t in tensors.values())
    experts = sum(t.nbytes for name, t in tensors.items() if "_exps." in name)
    embedding = tensors["token_embd.weight"].nbytes
    hash_tables = sum(t.nbytes for name, t in tensors.items() if "tid2eid" in name)
    active = experts * TINY.n_activated_experts / TINY.n_routed_experts
    rows = (embedding + hash_tables) / TINY.vocab_size
    assert weight_bytes_per_token(model) == round(everything - experts - embedding - hash_tables + active + rows)
    # 2 window layers, then ratio 4 and 128 alternate; at 1024 tokens the indexer keeps top-4 of 256 rows
    window = 6 * 8 * 128
    ratio4 = 2 * (4 * 128 + 256 * 64)
    ratio128 = 2 * (8 * 128)
    assert kv_bytes_read(TINY, 1024, 4) == 4 * (window + ratio4 + ratio128)


def test_bench_writes_a_csv_and_a_png(tiny, tmp_path) -> None:
    out, png = tmp_path / "bench.csv", tmp_path / "bench.png"
    done = subprocess.run(
        [sys.executable, "-m", "dwarfstar", "bench", "-m", str(tiny), "--backend", "reference"]
        + ["--ctx-start", "64", "--ctx-max", "192", "--step-incr", "64", "--gen-tokens", "4"]
        + ["--csv", str(out), "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    with out.open(encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert (
        rows[0]
        == CSV_HEADER
        == [
            "ctx_tokens",
            "prefill_tokens",
            "prefill_tps",
            "gen_tokens",
            "gen_tps",
            "kvcache_bytes",
            "gen_gbps",
        ]
    )
    body = [dict(zip(CSV_HEADER, row, strict=True)) for row in rows[1:]]
    assert [int(r["ctx_tokens"]) for r in body] == [64, 128, 192]
    weights = weight_bytes_per_token(open_model(tiny))
    for r in body:
        assert int(r["prefill_tokens"]) == 64 and int(r["gen_tokens"]) == 4
        assert float(r["prefill_tps"]) > 0 and float(r["gen_tps"]) > 0
        assert int(r["kvcache_bytes"]) == payload_nbytes(TINY, int(r["ctx_tokens"]))
        expected = (weights + kv_bytes_read(TINY, int(r["ctx_tokens"]), 4)) * float(r["gen_tps"]) / 1e9
        assert float(r["gen_gbps"]) == pytest.approx(expected, abs=0.006, rel=0.01)
        assert all(len(v.split(".")[1]) == 2 for k, v in r.items() if k.endswith(("tps", "gbps")))
    assert "GB/s" in done.stderr  # the rows, as they come, with bandwidth next to tok/s

    import matplotlib.image

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 400 and height > 300
