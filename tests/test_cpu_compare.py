"""tools/cpu_compare.py without llama.cpp or the 9.5 GB file: the bandwidth reader, the bad-input exits,
the figures and table from given times, and a whole run of ours alone on the bundled model."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import dwarfstar
from dwarfstar.bench.bandwidth import read_bandwidth, timed_pass

TOOL = Path(__file__).resolve().parents[1] / "tools" / "cpu_compare.py"
spec = importlib.util.spec_from_file_location("cpu_compare", TOOL)
cmp = sys.modules.setdefault("cpu_compare", importlib.util.module_from_spec(spec))  # dataclasses look it up
spec.loader.exec_module(cmp)

NANO = Path(dwarfstar.__file__).parent / "data" / "nano.gguf"


def test_the_bandwidth_reader_gives_one_positive_finite_figure_per_pass_and_reads_only_int64():
    words = np.arange(1 << 20, dtype=np.int64)  # 8 MiB
    for threads in (1, 3):
        passes = read_bandwidth(words, threads, passes=2)
        assert len(passes) == 2
        assert all(math.isfinite(g) and g > 0 for g in passes)
    with pytest.raises(ValueError):
        read_bandwidth(words.astype(np.float64), 2)


def test_a_pass_reads_every_word_once_over_its_threads_slices():
    n = 1 << 20
    words = np.arange(n, dtype=np.int64)
    seconds, total = timed_pass(np.array_split(words, 3))
    assert seconds > 0 and total == n * (n - 1) // 2


def test_the_file_bandwidth_reads_the_whole_words_of_the_file(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(bytes(8 * 1000 + 5))  # a tail shorter than a word is left out
    measured = cmp.measure_bandwidth(path, "file", 0, threads=2)
    assert (measured.source, measured.nbytes, len(measured.passes_gbps)) == ("file", 8000, 3)
    assert measured.gbps == max(measured.passes_gbps)
    memory = cmp.measure_bandwidth(path, "memory", 1 << 20, threads=2)
    assert (memory.source, memory.nbytes) == ("memory", 1 << 20)


def run_main(capsys, *argv: str) -> tuple[int, str]:
    status = cmp.main(list(argv))
    return status, capsys.readouterr().err


def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "none.gguf"
    status, err = run_main(capsys, "--model", str(missing))
    assert status == 2 and err.count("\n") == 1 and str(missing) in err

    present = tmp_path / "present.gguf"
    present.write_bytes(b"GGUF")
    status, err = run_main(capsys, "--model", str(present), "--backends", "reference,nope", "--skip-llama")
    assert status == 2 and err.count("\n") == 1 and "unknown backend 'nope'" in err

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    status, err = run_main(capsys, "--model", str(present), "--backends", "reference")
    assert status == 2 and err.count("\n") == 1 and "nox -s cpu_compare" in err

    status, err = run_main(capsys, "--model", str(present), "--backends", "reference", "--skip-llama")
    assert status == 2 and err.count("\n") == 1 and str(present) in err  # not a GGUF file

    with pytest.raises(SystemExit) as exit_:
        cmp.main(["--model", str(present), "--threads", "0"])
    assert exit_.value.code == 2


def given_figures(with_llama: bool = True) -> dict:
    # llama.cpp: 512 tokens in 10 s, 32 in 4 s; ours: 512 in 20 s, 32 in 16 s; 1 GB a token; best pass 20 GB/s
    runs = [
        cmp.Run("llama.cpp", 1.0, 512, 10.0, 32, 4.0, [5, 6, 7, 8]),
        cmp.Run("dwarfstar cpu", 2.0, 512, 20.0, 32, 16.0, [5, 6, 9, 8]),
    ]
    bandwidth = cmp.Bandwidth("file", 9 * 2**30, [10.0, 20.0, 16.0])
    about = {"model": "flash4.gguf", "model_bytes": 9_500_000_000, "threads": 2, "prefill": 512, "decode": 32}
    about["load_average"] = {"start": 0.25, "end": 1.5}
    return cmp.report(runs if with_llama else runs[1:], bandwidth, 1_000_000_000, about)


def test_the_figures_from_given_times():
    figures = given_figures()
    assert figures["bandwidth"]["gbps"] == 20.0
    assert figures["ceiling_tps"] == pytest.approx(20.0)  # 20 GB/s over 1 GB a token
    llama, ours = figures["rows"]
    assert (llama["prefill_tps"], llama["decode_tps"]) == pytest.approx((51.2, 8.0))
    assert (ours["prefill_tps"], ours["decode_tps"]) == pytest.approx((25.6, 2.0))
    assert (llama["decode_gbps"], ours["decode_gbps"]) == pytest.approx((8.0, 2.0))
    assert (llama["bandwidth_share"], ours["bandwidth_share"]) == pytest.approx((0.4, 0.1))
    assert (ours["prefill_vs_llama"], ours["decode_vs_llama"]) == pytest.approx((0.5, 0.25))
    assert ours["same_tokens_as_llama"] == 2
    assert json.loads(json.dumps(figures)) == figures  # --json writes it as is

    alone = given_figures(with_llama=False)["rows"][0]
    assert (alone["prefill_vs_llama"], alone["decode_vs_llama"], alone["same_tokens_as_llama"]) == (None, None, None)


def test_the_table_says_what_was_measured_and_one_line_per_engine():
    text = cmp.table(given_figures())
    assert "flash4.gguf (9.50 GB), 2 threads, 512-token prefill, 32 greedy decode tokens" in text
    assert "20.00 GB/s (best of 3 passes over 9.00 GiB of the model file)" in text
    assert "1000.0 MB" in text and "ceiling 20.00 tok/s" in text
    llama_line, ours_line = text.splitlines()[5:7]
    assert llama_line.split() == ["llama.cpp", "51.20", "8.00", "8.00", "40.0%", "1.00x", "1.00x"]
    assert ours_line.split() == ["dwarfstar", "cpu", "25.60", "2.00", "2.00", "10.0%", "0.50x", "0.25x"]
    assert "its first 2 of 32 greedy tokens are llama.cpp's" in text
    assert text.splitlines()[-1] == "machine load (1-minute average): 0.25 at the start, 1.50 at the end"

    alone = cmp.table(given_figures(with_llama=False)).splitlines()[5]
    assert alone.split()[-2:] == ["-", "-"]


def test_the_prompt_is_the_bench_text_tokenized_raw_by_the_files_tokenizer():
    from dwarfstar.commands.bench_ctx import bench_text
    from dwarfstar.model.loader import open_model
    from dwarfstar.tokenizer.tokenizer import Tokenizer

    model = open_model(NANO)
    try:
        tokens = cmp.prompt_tokens(model, 40)
        assert len(tokens) == 40 and cmp.prompt_tokens(model, 40) == tokens
        text = Tokenizer.from_gguf_metadata(model.gguf.metadata).decode(tokens)
    finally:
        model.close()
    assert len(text) > 40 and bench_text(None, 40).startswith(text)  # no BOS, no template: the text itself


def test_ours_alone_on_the_bundled_model_writes_its_figures(tmp_path, capsys):
    out = tmp_path / "figures.json"
    argv = ["--model", str(NANO), "--backends", "reference", "--skip-llama", "--threads", "1"]
    argv += ["--prefill", "16", "--decode", "2", "--bandwidth-gib", "0.01", "--json", str(out)]
    assert cmp.main(argv) == 0
    printed = capsys.readouterr().out
    figures = json.loads(out.read_text())
    (row,) = figures["rows"]
    assert (row["engine"], row["prefill_tokens"], row["decode_tokens"], len(row["generated"])) == (
        "dwarfstar reference",
        16,
        2,
        2,
    )
    assert row["decode_tps"] > 0 and row["prefill_tps"] > 0 and figures["threads"] == 1
    assert figures["load_average"]["start"] >= 0 and figures["load_average"]["end"] >= 0
    # the bundled file is too small to read for a bandwidth: a 0.01 GiB array is read instead
    assert (figures["bandwidth"]["source"], figures["bandwidth"]["nbytes"]) == ("memory", int(0.01 * 2**30) // 8 * 8)
    assert figures["versions"].keys() == {"torch", "numpy"}
    assert "dwarfstar reference" in printed and "1 thread, 16-token prefill" in printed
