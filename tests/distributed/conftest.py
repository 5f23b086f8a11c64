"""Routes for the distributed tests: the coordinator in the test process, workers as subprocesses on loopback.

Workers run with the test process's torch thread count, so every layer computes as it does in the
single-process reference, and bit-identical logits are a fair demand.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dwarfstar.distributed.backend import RouteBackend
from dwarfstar.distributed.launch import DistOptions, start_coordinator
from dwarfstar.distributed.route import Route
from dwarfstar.engine import Engine, load_engine
from dwarfstar.model.bundled import default_model_path

CTX = 256  # stage_worker.CTX
WORKER = Path(__file__).with_name("stage_worker.py")
WAIT_S = 120.0  # loading torch in several processes on the 2 shared cores is slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A route over `layers` (the coordinator's slice first) of one model."""

    def __init__(
        self, engine: Engine, path: Path, layers: list[str], worker_args: dict[str, int | None] | None = None
    ) -> None:
        """`layers[1:]` start as plain workers, `worker_args` maps more slices to a die-at-rows count."""
        self.engine, self.path = engine, path
        self.local = engine.backend
        self.addr = f"127.0.0.1:{free_port()}"
        self.workers: dict[str, subprocess.Popen] = {}
        for worker_layers in layers[1:]:
            self.start_worker(worker_layers)
        for worker_layers, die_at in (worker_args or {}).items():
            self.start_worker(worker_layers, die_at)
        opts = DistOptions.resolved(role="coordinator", layers=layers[0], addr=self.addr, wait_s=WAIT_S, timeout_s=60)
        self.route: Route = start_coordinator(engine, opts, CTX)
        self.backend = RouteBackend(self.route)

    def start_worker(self, layers: str, die_at_rows: int | None = None) -> subprocess.Popen:
        argv = [sys.executable, str(WORKER), str(self.path), layers, self.addr, str(torch.get_num_threads())]
        if die_at_rows is not None:
            argv.append(str(die_at_rows))
        self.workers[layers] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self.workers[layers]

    def close(self) -> None:
        self.route.close()
        for proc in self.workers.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_file) -> tuple[Engine, Path]:
    path = tiny_model_file(0)
    return load_engine(path, "reference", ctx=CTX), path


@pytest.fixture(scope="module")
def tiny2(tiny_engine):
    cluster = Cluster(*tiny_engine, ["0:3", "3:output"])
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def tiny3(tiny_engine):
    cluster = Cluster(*tiny_engine, ["0:2", "2:4", "4:output"])
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def nano2():
    path = default_model_path()
    cluster = Cluster(load_engine(path, "reference", ctx=CTX), path, ["0:2", "2:output"])
    yield cluster
    cluster.close()
