"""Routes for the distributed tests: the coordinator in the test process, workers as subprocesses on loopback.

Every cluster's workers start together at the first test that needs one (loading torch is most of a
worker's start), and each coordinator joins its workers when a test first asks for that route,
loading only its own slice of the model as the CLI's does (`connected`); the tests compare it with
one process holding every layer.
Workers run with the test process's torch thread count, so every layer computes as in the
single-process reference, and bit-identical logits are a fair demand.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from live_server import free_port

from dwarfstar.distributed.membership import parse_layers
from dwarfstar.distributed.route import Route
from dwarfstar.engine.launch import DistOptions, route_backend, start_coordinator
from dwarfstar.engine.load import Engine, load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.bundled import default_model_path
from dwarfstar.speculative.mtp_options import BUNDLED_MTP

CTX = 256  # stage_worker.CTX
WORKER = Path(__file__).with_name("stage_worker.py")
WAIT_S = 300.0  # loading torch in several processes on the 2 shared cores is slow
DIE_AT_ROWS = 37  # the fragile cluster's worker dies when a pass of this many rows arrives


class Cluster:
    """A route over `layers` (the coordinator's slice first) of one model file."""

    def __init__(
        self,
        path: Path,
        layers: list[str],
        logs: Path,
        die_at_rows: int | None = None,
        cli: bool = False,
        backend: str = "reference",
        mtp: Path | None = None,
        qat: bool = True,
        dspark: Path | None = None,
    ) -> None:
        """Start the workers for `layers[1:]` (the last one dying at `die_at_rows`, if given; with
        `cli`, as `dwarfstar run --dist-role worker` processes on `backend`; with `mtp` (`dspark`),
        the last one drafting with that MTP block (DSpark drafter), and the coordinator requiring a
        draft; `qat` False: every stage without QAT rounding)."""
        self.path, self.layers, self.logs, self.cli, self.backend_name = path, layers, logs, cli, backend
        self.mtp, self.qat, self.dspark = mtp, qat, dspark
        self.addr = f"127.0.0.1:{free_port()}"
        self.workers: dict[str, subprocess.Popen] = {}
        for i, worker_layers in enumerate(layers[1:], start=2):
            self.start_worker(worker_layers, die_at_rows if i == len(layers) else None)
        self.route: Route | None = None

    def connect(self, engine: Engine, reference: Engine | None = None) -> Cluster:
        """The coordinator's route on `engine` (the same model file), once; `reference` (default
        `engine`): the one-process engine the tests compare the route with (`local`)."""
        if self.route is None:
            self.engine = reference or engine
            self.local = self.engine.backend
            opts = DistOptions.resolved(
                role="coordinator", layers=self.layers[0], addr=self.addr, wait_s=WAIT_S, timeout_s=60,
                mtp=self.mtp is not None or self.dspark is not None,
            )  # fmt: skip
            self.route = start_coordinator(engine, opts, CTX)
            self.backend = route_backend(self.route)
        return self

    def start_worker(self, layers: str, die_at_rows: int | None = None) -> subprocess.Popen:
        argv = [sys.executable, str(WORKER), str(self.path), layers, self.addr, str(torch.get_num_threads())]
        if self.cli:
            argv = [sys.executable, "-m", "dwarfstar", "run", "-m", str(self.path), "--backend", self.backend_name]
            argv += ["-c", str(CTX), "--dist-role", "worker", "--layers", layers, "--dist-addr", self.addr]
        last = layers.endswith("output")
        if self.cli:
            argv += (["--mtp", str(self.mtp)] if self.mtp is not None and last else []) + (
                [] if self.qat else ["--no-qat-rounding"]
            )
        else:
            options = {"die": die_at_rows, "mtp": self.mtp if last else None, "qat": None if self.qat else 0}
            options["dspark"] = self.dspark if last else None
            argv += [f"{key}={value}" for key, value in options.items() if value is not None]
        log = open(self.logs / f"worker-{self.addr.rsplit(':', 1)[1]}-{layers.replace(':', '_')}.log", "ab")
        self.workers[layers] = subprocess.Popen(argv, stdout=log, stderr=log)
        log.close()
        return self.workers[layers]

    def close(self) -> None:
        if self.route is not None:
            self.route.close()
        for proc in self.workers.values():
            try:
                proc.wait(timeout=30 if self.route is not None else 0.1)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_file) -> tuple[Engine, Path]:
    path = tiny_model_file(0)
    return load_engine(EngineSpec(path, "reference", ctx=CTX)), path


@pytest.fixture(scope="session")
def clusters(tiny_model_file, tmp_path_factory):
    logs = tmp_path_factory.mktemp("dist-logs")
    tiny, nano = tiny_model_file(0), default_model_path()
    pool = {
        "tiny2": Cluster(tiny, ["0:3", "3:output"], logs),
        "tiny3": Cluster(tiny, ["0:2", "2:4", "4:output"], logs),
        "fragile": Cluster(tiny, ["0:3", "3:output"], logs, die_at_rows=DIE_AT_ROWS),
        "nano2": Cluster(nano, ["0:2", "2:output"], logs),
        "cli": Cluster(tiny, ["0:3", "3:output"], logs, cli=True),  # its coordinator is a `run` in the test
        "bench": Cluster(tiny, ["0:3", "3:output"], logs, cli=True),  # and this one's a `bench`
        # MTP drafting on the last stage, without QAT rounding (where greedy speculation is bit-exact)
        "mtp2": Cluster(nano, ["0:2", "2:output"], logs, mtp=nano.with_name(BUNDLED_MTP), qat=False),
        "mtp3": Cluster(nano, ["0:2", "2:4", "4:output"], logs, mtp=nano.with_name(BUNDLED_MTP), qat=False),
        "mtpcli": Cluster(nano, ["0:2", "2:output"], logs, cli=True, mtp=nano.with_name(BUNDLED_MTP), qat=False),
    }
    yield pool
    for cluster in pool.values():
        cluster.close()


def connected(cluster: Cluster, reference: Engine) -> Cluster:
    """The cluster's route, its coordinator loading only its slice as the CLI does; `reference`, one
    process holding every layer of the same file (with the cluster's QAT setting), is what the tests
    compare it with."""
    if cluster.route is None:
        layers = parse_layers(cluster.layers[0], reference.model.args.n_layers)
        sliced = (layers.first, layers.last)
        cluster.connect(
            load_engine(EngineSpec(cluster.path, "reference", ctx=CTX, qat=cluster.qat, layers=sliced)), reference
        )
    return cluster


@pytest.fixture
def tiny2(clusters, tiny_engine) -> Cluster:
    return connected(clusters["tiny2"], tiny_engine[0])


@pytest.fixture
def tiny3(clusters, tiny_engine) -> Cluster:
    return connected(clusters["tiny3"], tiny_engine[0])


@pytest.fixture
def fragile(clusters, tiny_engine) -> Cluster:
    """A 2-stage route whose worker dies, before replying, on a pass of DIE_AT_ROWS rows."""
    return connected(clusters["fragile"], tiny_engine[0])


@pytest.fixture(scope="session")
def nano_engine() -> Engine:
    return load_engine(EngineSpec(default_model_path(), "reference", ctx=CTX))


@pytest.fixture
def nano2(clusters, nano_engine) -> Cluster:
    return connected(clusters["nano2"], nano_engine)


@pytest.fixture(scope="session")
def exact_nano() -> Engine:
    """The bundled model in one process without QAT rounding: the MTP routes' reference."""
    return load_engine(EngineSpec(default_model_path(), "reference", ctx=CTX, qat=False))


@pytest.fixture
def mtp2(clusters, exact_nano) -> Cluster:
    return connected(clusters["mtp2"], exact_nano)


@pytest.fixture
def mtp3(clusters, exact_nano) -> Cluster:
    return connected(clusters["mtp3"], exact_nano)
