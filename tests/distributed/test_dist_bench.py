"""`dwarfstar bench dist`: one process, then a 2-stage route whose worker the bench spawns itself,
with each hop's layers and the bytes it moved."""

from __future__ import annotations

import re

from conftest import free_port
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.model.synthetic import TINY


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
