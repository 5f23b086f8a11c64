"""The agent as the coordinator of a distributed route (run's --dist-* flags): the bundled model split
in two processes on loopback answers as one process does, and the system prompt's KV file it saves
loads in a one-process agent with no prefill and the same reply."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from live_server import free_port

CTX = "4096"
PROMPT = "Quel ramo del lago di Como"


def dwarfstar(tmp: Path, kv: Path, *argv: str) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, HOME=str(tmp / "home"), DWARFSTAR_KVCACHE=str(kv), NO_COLOR="1")
    return [sys.executable, "-m", "dwarfstar", *argv], env


def agent(tmp: Path, kv: Path, *flags: str) -> subprocess.CompletedProcess:
    argv, env = dwarfstar(tmp, kv, "agent", "--plain", "--backend", "reference", "--temp", "0", "-n", "12",
                          "--ctx", CTX, "--trace", str(kv.with_suffix(".trace")), "-p", PROMPT, *flags)  # fmt: skip
    return subprocess.run(argv, cwd=tmp / "work", env=env, capture_output=True, text=True, timeout=300)


def reply(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n[")[0]


def test_the_agent_coordinates_a_two_stage_route(tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()  # the workspace path is in the system prompt: the same for every run
    addr = f"127.0.0.1:{free_port()}"
    argv, env = dwarfstar(tmp_path, tmp_path / "unused", "run", "--backend", "reference", "--ctx", CTX,
                          "--dist-role", "worker", "--layers", "2:output", "--dist-addr", addr)  # fmt: skip
    worker = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        routed = agent(tmp_path, tmp_path / "routed", "--dist-role", "coordinator", "--layers", "0:2",
                       "--dist-addr", addr)  # fmt: skip
        assert worker.wait(timeout=60) == 0  # the coordinator's exit shut it down
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    alone = agent(tmp_path, tmp_path / "alone")
    assert reply(routed) == reply(alone) and reply(alone).strip()
    # the route's system-prompt KV, loaded by one process: nothing prefilled, the same reply
    reloaded = agent(tmp_path, tmp_path / "routed")
    assert reply(reloaded) == reply(alone)
    assert "from sysprompt.kv, prefilled 0" in (tmp_path / "routed.trace").read_text()
