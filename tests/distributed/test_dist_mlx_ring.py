"""The route on mx.distributed's ring backend over loopback, with the MLX backend in both stages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import WAIT_S, free_port

from dwarfstar.model.bundled import default_model_path
from dwarfstar.speculative.mtp_options import BUNDLED_MTP

pytest.importorskip("mlx.core")

MEMBER = Path(__file__).with_name("ring_member.py")


def ring(tmp_path, *args: str) -> dict[str, np.ndarray]:
    """Run a 2-member ring route (ring_member.py with `args`) and return the coordinator's figures."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    out = tmp_path / "figures.npz"
    procs = []
    for rank in (1, 0):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        argv = [sys.executable, str(MEMBER), args[0], str(out), *args[1:]]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    try:
        codes = [p.wait(timeout=WAIT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], [p.stderr.read().decode()[-2000:] for p in procs]
    return dict(np.load(out))


def test_mlx_ring_route_matches_one_process(tiny_model_file, tmp_path):
    figures = ring(tmp_path, str(tiny_model_file(0)))
    assert figures["route_logits"].shape == figures["local_logits"].shape == (12, 129280)
    assert np.array_equal(figures["route_logits"], figures["local_logits"])
    assert np.array_equal(figures["route_greedy"], figures["local_greedy"])


def test_mlx_ring_route_speculates_as_one_process(tmp_path):
    """The last ring member drafts with the bundled model's MTP block: the same greedy tokens, steps,
    rollbacks and acceptance as one process's speculation, which emits the plain greedy text."""
    nano = default_model_path()
    figures = ring(tmp_path, str(nano), str(nano.with_name(BUNDLED_MTP)))
    assert np.array_equal(figures["route_greedy"], figures["local_greedy"])
    assert np.array_equal(figures["local_greedy"], figures["plain_greedy"])
    assert np.array_equal(figures["route_figures"], figures["local_figures"])
    steps, rollbacks, *accepted = figures["local_figures"].tolist()
    assert rollbacks > 0 and sum(accepted) > 0  # both a rejection's truncation and accepted drafts ran
