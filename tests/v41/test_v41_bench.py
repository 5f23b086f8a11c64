"""`dwarfstar bench v41` on `v41-tiny` (issue 33): it prints every figure, its hit rate rises with the Engram
cache budget; and a V4.1 model's logits do not depend on the budget (none, 1% and 100% of the tables),
on a warm cache, or on the file's pages being out of the page cache (cold reads)."""

from __future__ import annotations

import json

import pytest
import torch
from test_cli_front import cli, refused

from dwarfstar.backends.reference.v41.backend import ReferenceModel41
from dwarfstar.bench.v41 import PHASES, as_dict, file_facts, format_report, run_budget
from dwarfstar.cli import _register_commands
from dwarfstar.commands.bench_ctx import bench_text
from dwarfstar.commands.bench_v41 import _load
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.experts.replay import drop_page_cache
from dwarfstar.model.file_v41 import open_model41

_register_commands()

PROMPT = [(7919 * i + 101) % 120000 for i in range(40)]


@pytest.fixture(scope="module")
def runs(v41_tiny_file):
    """Budgets of 0, 1 and 4 MB: none, 44% and all of v41-tiny's 2.4 MB of tables."""
    text, spec = bench_text(None, 48), EngineSpec(v41_tiny_file, "reference")
    return [run_budget(lambda mb, ctx: _load(spec, mb, ctx), mb, text, 48, 2) for mb in (0, 1, 4)]


def test_the_report_has_every_figure(runs, v41_tiny_file):
    model = open_model41(v41_tiny_file)
    try:
        facts = file_facts(model, 24 << 30)
    finally:
        model.close()
    assert facts.engram_rows == sum(model.args.engram_rows) and facts.on_disk_bytes > 0
    report = format_report(facts, runs)
    for figure in ("GiB on disk", "RAM", "prefill 48 tok at", "decode 2 tok at", "tok/s", "loaded", "after decode"):
        assert figure in report, figure
    for phase in PHASES:
        line = next(line for line in report.splitlines() if f"engram {phase}:" in line)
        for figure in ("48 rows used/token", "read/token", "kB/token", "hit rate", "p50", "p99", "rows cached"):
            assert figure in line, (phase, figure)
    assert "greedy choices the same at every budget" in report
    data = json.loads(json.dumps(as_dict(facts, runs)))
    assert data["same_tokens"] and [row["budget_mb"] for row in data["budgets"]] == [0, 1, 4]
    for run in runs:
        assert run.prefill_tps > 0 and run.gen_tps > 0 and run.rows_per_token == 48
        assert run.loaded is not None and run.end is not None and run.peak_bytes >= run.end.now > 0


def test_hit_rate_rises_with_the_budget(runs):
    prefill = [run.hit_rate("prefill") for run in runs]
    read = [run.engram["prefill"]["misses"] for run in runs]
    assert prefill[0] < prefill[1] <= prefill[2] == 1.0  # 1 MB holds the prompt's rows already
    assert read[0] >= read[1] >= read[2]  # with no room for the prompt's rows nothing is read ahead to be evicted
    assert runs[0].engram["prefill"]["capacity_rows"] == 0 and runs[2].engram["prefill"]["resident_rows"] > 0
    decode = [run.hit_rate("decode") for run in runs]
    assert decode[0] < decode[1] <= decode[2]  # a decoded token's n-grams meet the prompt's
    assert len({run.generated for run in runs}) == 1


def test_the_command_prints_its_report_and_refuses_what_it_cannot_measure(monkeypatch, capsys, v41_tiny_file):
    args = ("bench", "v41", "-m", str(v41_tiny_file), "--backend", "reference", "--prompt-tokens", "8", "-n", "1")
    code, out, err = cli(monkeypatch, capsys, *args, "--budgets", "1", "--cold", "--decode-text")
    assert code == 0, err
    assert "--engram-cache 1 MB" in out and "engram decode:" in out and "load average" in err
    assert "--budgets takes comma-separated MB" in refused(monkeypatch, capsys, *args, "--budgets", "0,0.5")
    assert "one or more MB" in refused(monkeypatch, capsys, *args, "--budgets", ",")


def greedy_logits(backend: ReferenceModel41, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """The prompt's logits (one call, which reads its rows ahead), then those of `steps` greedy tokens."""
    state = backend.new_state()
    out = [backend.forward(prompt, state, all_logits=False)[0]]
    for _ in range(steps):
        out.append(backend.forward([int(out[-1].argmax())], state, all_logits=False)[0])
    return out


def test_logits_do_not_depend_on_the_cache_or_the_page_cache(v41_tiny_file):
    model = open_model41(v41_tiny_file)
    table = model.engram_bytes
    try:
        want = None
        for name, budget, cold in (("none", 0, False), ("1%", table // 100, False), ("100%", table, False),
                                   ("cold", 0, True)):  # fmt: skip
            if cold:
                drop_page_cache(str(v41_tiny_file))  # the rows come from the disk, not the page cache
            backend = ReferenceModel41.from_file(model, budget, 64)
            store = backend.transformer.ops.store
            got = greedy_logits(backend, PROMPT, 3)
            stats = store.telemetry()
            assert stats["misses"] > 0, name
            if name == "1%":
                assert 0 < stats["capacity_rows"] == stats["resident_rows"] < len(PROMPT) * 48  # it evicted
            if name == "100%":  # a warm cache: the same again reads nothing
                assert torch.equal(torch.stack(greedy_logits(backend, PROMPT, 3)), torch.stack(got))
                assert store.telemetry()["bytes_read"] == stats["bytes_read"]
            want = got if want is None else want
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), name
            store.close()
    finally:
        model.close()
