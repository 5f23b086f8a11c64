"""`dwarfstar run` as a coordinator and as a worker: --dump-logits through a route equals one process."""

from __future__ import annotations

import numpy as np
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app

PROMPT_IDS = "0,17,42,99,5,1000"


def dump(tiny, out, *extra: str) -> np.ndarray:
    _register_commands()
    args = ["run", "-m", str(tiny), "--backend", "reference", "-c", "256", "--prompt-tokens", PROMPT_IDS]
    done = CliRunner().invoke(app, [*args, "--dump-logits", str(out), *extra])
    assert done.exit_code == 0, done.output
    return np.load(out)


def test_run_dump_logits_on_a_coordinator(clusters, tiny_model_file, tmp_path):
    cluster = clusters["cli"]
    tiny = tiny_model_file(0)
    want = dump(tiny, tmp_path / "one.npy")
    route = ["--dist-role", "coordinator", "--layers", "0:3", "--dist-addr", cluster.addr, "--dist-timeout", "300"]
    got = dump(tiny, tmp_path / "route.npy", *route)
    assert got.shape == (6, 129280)
    assert np.array_equal(got, want)
    assert cluster.workers["3:output"].wait(timeout=60) == 0  # the coordinator's exit shut the worker down
