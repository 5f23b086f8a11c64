"""`agent --ssd-streaming --trace`: each reply's trace has the expert cache's record, as `run --trace` has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_agent_trace_records_the_expert_cache(tmp_path: Path) -> None:
    trace = tmp_path / "agent.trace"
    env = dict(os.environ, HOME=str(tmp_path / "home"), DWARFSTAR_KVCACHE=str(tmp_path / "kv"), NO_COLOR="1")
    argv = [sys.executable, "-m", "dwarfstar", "agent", "--plain", "--backend", "reference", "--temp", "0"]
    argv += ["-n", "4", "--ctx", "2048", "-p", "Quel ramo del lago di Como", "--trace", str(trace)]
    argv += ["--ssd-streaming", "--ssd-streaming-cache-experts", "200KB", "--ssd-streaming-cold"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = trace.read_text(encoding="utf-8").splitlines()
    at = [i for i, line in enumerate(lines) if line.endswith("] experts")]
    assert at, "no experts record in the agent's trace"
    record = json.loads(lines[at[-1] + 1])
    assert record["hits"] + record["misses"] > 0 and record["resident_experts"] <= record["capacity_experts"]
    layers = record["per_layer"]
    assert len(layers) == 6 and sum(c["misses"] for c in layers) == record["misses"]
    assert sum(c["bytes_read"] for c in layers) == record["bytes_read"] > 0
