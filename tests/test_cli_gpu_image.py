"""The CLI on the GPU check's image: with the packages that image lacks made unimportable
(tools/gpu_image/sitecustomize.py), every command's help and the commands tools/gpu_check.sh runs
get past their imports (to the GPU, or to the refusal to run Triton without one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_REFUSAL = "needs a CUDA or ROCm GPU"

# in a fresh interpreter: a command's imports happen once per process
SCRIPT = """
import json, sys
import typer
from typer.testing import CliRunner
from dwarfstar.cli import _register_commands, app

_register_commands()
runner = CliRunner()

def leaves(command, path):
    subs = getattr(command, "commands", None)
    if not subs:
        return [path]
    return [leaf for name, sub in sorted(subs.items()) for leaf in leaves(sub, [*path, name])]

calls = [[*path, "--help"] for path in leaves(typer.main.get_command(app), [])]
calls += json.loads(sys.argv[1])
results = []
for argv in calls:
    done = runner.invoke(app, argv)
    error = None if done.exception is None or isinstance(done.exception, SystemExit) else repr(done.exception)
    results.append({"argv": argv, "code": done.exit_code, "error": error, "tail": done.output[-400:]})
print(json.dumps(results))
"""

# the CLI commands of tools/gpu_check.sh (its `stream-run` and `gate-nano` steps)
CHECK_COMMANDS = [
    ["run", "--backend", "triton", "--prompt-tokens", "0,17,4242,99", "-n", "1", "--temp", "0", "--ssd-streaming",
     "--ssd-streaming-cache-experts", "1MB"],
    ["test", "vectors", "--vector-file", "tests/data/gates/nano.vec", "--backend", "triton"],
]  # fmt: skip


def test_cli_commands_import_nothing_the_gpu_image_lacks():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DWARFSTAR_ABSENT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tools" / "gpu_image"), str(ROOT)])
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(CHECK_COMMANDS)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    helps = [r for r in results if r["argv"][-1] == "--help"]
    assert len(helps) > 20 and {r["argv"][0] for r in helps} >= {"run", "serve", "agent", "pull", "test", "bench"}
    for r in helps:
        assert r["code"] == 0 and r["error"] is None, f"{r['argv']}: {r['error'] or r['tail']}"
    for r in results[len(helps) :]:  # ran, or stopped at the GPU (`main` prints the DwarfStarError)
        refused = r["error"] is not None and r["error"].startswith("DwarfStarError") and GPU_REFUSAL in r["error"]
        assert refused or (r["code"] == 0 and r["error"] is None), f"{r['argv']}: {r['error'] or r['tail']}"
