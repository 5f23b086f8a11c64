"""The streaming flags end to end: `run` with --ssd-streaming gives the resident run's tokens and an
expert line in its summary; `profile-experts` writes the profile the next streamed run is seeded
from; `bench experts --replay` reports every budget."""

from __future__ import annotations

import json
import re

import numpy as np
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.engine import load_engine
from dwarfstar.experts.attach import StreamingOptions, profile_path
from dwarfstar.experts.trace import RoutingTrace

_register_commands()
PROMPT = "0,17,4242,99,12001,7,300"


def invoke(*args: str):
    done = CliRunner().invoke(app, list(args))
    assert done.exit_code == 0, done.output
    return done


def generated(output: str) -> str:
    """The reply text: everything before the summary lines."""
    return output.split("load ")[0]


def test_streamed_run_gives_the_resident_tokens(tiny_k_path):
    base = ["run", "-m", str(tiny_k_path), "--backend", "reference", "--prompt-tokens", PROMPT, "-n", "6"]
    base += ["--temp", "0"]
    resident = invoke(*base)
    streamed = invoke(*base, "--ssd-streaming", "--ssd-streaming-cache-experts", "170KB")  # 3 experts of 54 KiB
    assert generated(streamed.output) == generated(resident.output)
    line = re.search(r"experts: hit ([\d.]+)% \| ([\d.]+) MB read/token .* resident (\d+)/(\d+)", streamed.output)
    assert line is not None, streamed.output
    assert line.group(4) == "3" and int(line.group(3)) <= 3 and float(line.group(2)) > 0
    assert "experts:" not in resident.output


def test_profile_seeds_and_preloads_the_next_run(tiny_k_path, tmp_path):
    model = tmp_path / "m.gguf"
    model.symlink_to(tiny_k_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"rendered": "<｜begin▁of▁sentence｜>Hello there"}) + "\n")
    done = invoke("profile-experts", "-m", str(model), "--prompts", str(prompts), "-n", "4")
    assert str(profile_path(model)) in done.output
    trace = RoutingTrace.load(profile_path(model), 6, 8)
    assert trace.calls[1:].tolist() == [1, 1, 1, 1]  # the prompt in one call, then 4 decode steps
    seeded = StreamingOptions(cache_experts="1MB", preload_experts=5)
    engine = load_engine(model, "reference", ctx=256, streaming=seeded)
    hot = trace.hot_keys()[:5]
    assert engine.experts.stats.preloaded == 5
    assert sorted(engine.experts.where) == sorted(hot)
    assert np.array_equal(engine.experts.policy.counts, trace.counts())
    cold = load_engine(model, "reference", ctx=256, streaming=StreamingOptions(cold=True, preload_experts=5))
    assert not cold.experts.where and not cold.experts.policy.counts.any()


def test_bench_replays_every_budget(tiny_k_path, tmp_path):
    trace = tmp_path / "t.npz"
    synthetic = ["--synthetic-zipf", "1.0", "--synthetic-tokens", "40"]
    invoke("profile-experts", "-m", str(tiny_k_path), "-o", str(trace), *synthetic)
    out = tmp_path / "r.json"
    args = ["--replay", str(trace), "-m", str(tiny_k_path), "--budgets", "25,100", "--disk-seconds", "0.1"]
    invoke("bench", "experts", *args, "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["budget_pct"] for r in rows] == [25, 100]
    full = rows[1]
    assert full["store_misses"] <= full["capacity"]  # each expert read once: no re-reads
    assert full["belady_hit"] == full["lru_hit"] == full["ds4_hit"] == full["store_hit_rate"]  # nothing evicted
    assert rows[0]["belady_hit"] >= max(rows[0]["lru_hit"], rows[0]["ds4_hit"])
    assert rows[0]["store_hit_rate"] == rows[0]["ds4_hit"]  # the store's own hits are the simulator's
