"""`nox -s clients` starts tests/serving/scripted_server.py as a module of its own (not under pytest):
its imports must resolve there too, or the clients check dies before any client runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_scripted_server_starts_as_the_clients_check_starts_it() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.serving.scripted_server", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--scripts" in done.stdout
