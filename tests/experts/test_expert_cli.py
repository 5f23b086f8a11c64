"""The streaming flags end to end: `run` with --ssd-streaming gives the resident run's tokens and an
expert line in its summary; `profile-experts` writes the profile the next streamed run is seeded
from; `bench experts --replay` reports every budget."""

from __future__ import annotations

import json
import re

import numpy as np
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.experts.attach import StreamingOptions, profile_path
from dwarfstar.experts.routing_trace import RoutingTrace, TraceError, skewed_trace

_register_commands()
PROMPT = "0,17,4242,99,12001,7,300"


def invoke(*args: str):
    done = CliRunner().invoke(app, list(args))
    assert done.exit_code == 0, done.output
    return done


def test_streamed_run_gives_the_resident_tokens(tiny_k_path):
    base = ["run", "-m", str(tiny_k_path), "--backend", "reference", "--prompt-tokens", PROMPT, "-n", "6"]
    base += ["--temp", "0"]
    resident = invoke(*base)
    streamed = invoke(*base, "--ssd-streaming", "--ssd-streaming-cache-experts", "170KB")  # 3 experts of 54 KiB
    assert streamed.stdout == resident.stdout  # the reply (stderr has the bars, whose lines depend on timing)
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
    engine = load_engine(EngineSpec(model, "reference", ctx=256, streaming=seeded))
    hot = trace.hot_keys()[:5]
    assert engine.experts.stats.preloaded == 5
    assert sorted(engine.experts.where) == sorted(hot)
    assert np.array_equal(engine.experts.policy.counts, trace.counts())
    cold = load_engine(
        EngineSpec(model, "reference", ctx=256, streaming=StreamingOptions(cold=True, preload_experts=5))
    )
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


def test_bench_replays_a_smaller_models_trace_and_simulates_a_budget_past_the_memory(
    tiny_k_path, tmp_path, monkeypatch
):
    """A 3-layer, 4-expert trace (a smaller model's routing) replays over the file's first layers' first
    experts; a budget whose slots would not fit in memory gets the simulated figures only."""
    import dwarfstar.commands.experts as experts_command

    trace = tmp_path / "small.npz"
    skewed_trace(3, 4, 2, 40, zipf=1.0, seed=1).save(trace)
    args = ["--replay", str(trace), "-m", str(tiny_k_path), "--budgets", "50", "--disk-seconds", "0.05", "--no-mmap"]
    done = invoke("bench", "experts", *args, "--json", str(tmp_path / "real.json"))
    assert "first 3 layers' first 4 experts" in done.output
    real = json.loads((tmp_path / "real.json").read_text())["rows"][0]
    assert real["capacity"] == 6  # 50% of the trace's 12 experts, not of the file's 48
    assert real["store_hit_rate"] == real["ds4_hit"] and real["store_bytes_per_token"] == real["sim_bytes_per_token"]
    layers = real["store_per_layer"]
    assert [c["layer"] for c in layers] == [0, 1, 2] and sum(c["misses"] for c in layers) == real["store_misses"]
    assert [c["misses"] for c in layers] == [c["misses"] for c in real["sim_per_layer"]]
    monkeypatch.setattr(experts_command, "STORE_MEMORY_FRACTION", 0.0)
    invoke("bench", "experts", *args, "--json", str(tmp_path / "sim.json"))
    simulated = json.loads((tmp_path / "sim.json").read_text())["rows"][0]
    assert simulated["store"].startswith("simulated only") and "store_hit_rate" not in simulated
    assert simulated["sim_bytes_per_token"] == real["sim_bytes_per_token"]


def test_bench_refuses_a_trace_larger_than_the_file(tiny_k_path, tmp_path):
    trace = tmp_path / "big.npz"
    skewed_trace(6, 16, 2, 5, zipf=1.0).save(trace)  # tiny-k has 8 experts per layer
    done = CliRunner().invoke(app, ["bench", "experts", "--replay", str(trace), "-m", str(tiny_k_path)])
    assert isinstance(done.exception, TraceError) and "does not fit in the model's 6 x 8" in str(done.exception)
