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

pytest.importorskip("mlx.core")

MEMBER = Path(__file__).with_name("ring_member.py")


def test_mlx_ring_route_matches_one_process(tiny_model_file, tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    out = tmp_path / "figures.npz"
    procs = []
    for rank in (1, 0):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        argv = [sys.executable, str(MEMBER), str(tiny_model_file(0)), str(out)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    try:
        codes = [p.wait(timeout=WAIT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], [p.stderr.read().decode()[-2000:] for p in procs]
    figures = np.load(out)
    assert figures["route_logits"].shape == figures["local_logits"].shape == (12, 129280)
    assert np.array_equal(figures["route_logits"], figures["local_logits"])
    assert np.array_equal(figures["route_greedy"], figures["local_greedy"])
