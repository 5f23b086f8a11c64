"""The expert cache's telemetry where it is reported: `/metrics` (through a collector) and `run
--trace` (a JSON record after each reply); evictions and the read busy time counted by the store."""

from __future__ import annotations

import json
import re

from starlette.testclient import TestClient
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.experts.attach import StreamingOptions
from dwarfstar.experts.layout import ExpertLayout
from dwarfstar.experts.policy import make_policy
from dwarfstar.experts.replay import replay
from dwarfstar.experts.routing_trace import skewed_trace
from dwarfstar.experts.store import ExpertStore
from dwarfstar.model.loader import open_model
from dwarfstar.serving.app import create_app
from dwarfstar.serving.config import ServerConfig
from dwarfstar.serving.metrics import Metrics, expert_collector
from dwarfstar.serving.service import Service

_register_commands()


def metric(text: str, name: str, labels: str = "") -> float:
    line = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    assert line is not None, f"{name}{labels} missing from /metrics"
    return float(line.group(1))


def test_metrics_show_the_store(tiny_k_path):
    model_file = open_model(tiny_k_path)
    layout = ExpertLayout.of(model_file.gguf, model_file.args)
    trace = skewed_trace(layout.n_layers, layout.n_experts, 2, 30, zipf=1.0, seed=2)
    store = ExpertStore(layout, 12, make_policy("ds4", layout.total_experts))
    metrics = Metrics()
    metrics.collectors.append(expert_collector(store))
    assert metric(metrics.render(), "dwarfstar_expert_misses_total") == 0
    try:
        replay(store, trace)
    finally:
        store.close()
    text, stats = metrics.render(), store.stats
    assert metric(text, "dwarfstar_expert_hits_total") == stats.hits > 0
    assert metric(text, "dwarfstar_expert_misses_total") == stats.misses > 12
    # every miss past the first 12 took a cached expert's slot
    assert metric(text, "dwarfstar_expert_evictions_total") == stats.misses - 12 == stats.evictions
    assert metric(text, "dwarfstar_expert_read_bytes_total") == stats.misses * layout.max_expert_bytes
    assert metric(text, "dwarfstar_expert_resident") == 12 == metric(text, "dwarfstar_expert_capacity")
    busy = metric(text, "dwarfstar_expert_read_busy_seconds_total")
    # reads overlap: the busy wall time is at most their summed durations
    assert 0 < busy <= stats.read_seconds + 1e-9
    assert abs(metric(text, "dwarfstar_expert_read_gbps") - stats.bytes_read / busy / 1e9) < 1e-6
    p50 = metric(text, "dwarfstar_expert_miss_latency_seconds", '{quantile="0.5"}')
    assert 0 < p50 <= metric(text, "dwarfstar_expert_miss_latency_seconds", '{quantile="0.99"}')
    # per layer: each layer's uses are the trace's (30 tokens x 2 experts, one per call), and they add up
    layer = range(layout.n_layers)
    hits = [metric(text, "dwarfstar_expert_layer_hits_total", f'{{layer="{il}"}}') for il in layer]
    misses = [metric(text, "dwarfstar_expert_layer_misses_total", f'{{layer="{il}"}}') for il in layer]
    read = [metric(text, "dwarfstar_expert_layer_read_bytes_total", f'{{layer="{il}"}}') for il in layer]
    assert [h + m for h, m in zip(hits, misses, strict=True)] == [60] * layout.n_layers
    assert sum(hits) == stats.hits and sum(misses) == stats.misses and sum(read) == stats.bytes_read
    assert read == [m * layout.expert_bytes(il) for il, m in enumerate(misses)]


def test_run_trace_records_the_expert_cache(tiny_k_path, tmp_path):
    trace = tmp_path / "run.trace"
    args = ["run", "-m", str(tiny_k_path), "--backend", "reference", "--prompt-tokens", "0,17,4242,99", "-n", "3"]
    args += ["--temp", "0", "--ssd-streaming", "--ssd-streaming-cache-experts", "400KB", "--trace", str(trace)]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    lines = trace.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.endswith("] experts"))
    record = json.loads(lines[at + 1])
    assert record["capacity_experts"] == 7  # 400 KiB of 54 KiB experts
    assert record["hits"] + record["misses"] > 0 and record["bytes_read"] == record["misses"] * 55296
    assert record["evictions"] == record["misses"] - record["resident_experts"]
    layers = record["per_layer"]
    assert [c["layer"] for c in layers] == list(range(6))
    assert sum(c["hits"] for c in layers) == record["hits"] and sum(c["misses"] for c in layers) == record["misses"]
    assert all(c["bytes_read"] == c["misses"] * 55296 for c in layers)


def test_a_streaming_servers_trace_records_the_expert_cache(tiny_k_path, tmp_path):
    """`serve --ssd-streaming --trace`: each request's record carries the cache's figures."""
    engine = load_engine(
        EngineSpec(tiny_k_path, "reference", ctx=512, streaming=StreamingOptions(cache_experts="400KB"))
    )
    trace = tmp_path / "serve.trace"
    service = Service(engine, ServerConfig(ctx=512, max_sessions=2, trace=trace))
    body = {"model": "deepseek-v4-flash", "prompt": [0, 17, 4242, 99], "max_tokens": 3, "temperature": 0, "raw": True}
    with TestClient(create_app(service)) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
    record = json.loads(trace.read_text().splitlines()[-1])["experts"]
    assert record["capacity_experts"] == 7 and record["hits"] + record["misses"] > 0
    assert record["bytes_read"] == record["misses"] * 55296
