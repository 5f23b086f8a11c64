"""`dwarfstar run` as a coordinator and as a worker: --dump-logits through a route equals one process,
and so does an MTP speculative reply (the worker drafting with its own --mtp)."""

from __future__ import annotations

import re

import numpy as np
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.model.bundled import default_model_path
from dwarfstar.speculative.mtp_options import BUNDLED_MTP

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


def speculative_reply(*extra: str) -> tuple[str, str]:
    """`run --mtp` on the bundled model without QAT rounding: the reply and the speculation figures."""
    _register_commands()
    nano = default_model_path()
    args = ["run", "-m", str(nano), "--backend", "reference", "-c", "256", "--prompt-tokens", PROMPT_IDS]
    args += ["--temp", "0", "-n", "24", "--mtp", str(nano.with_name(BUNDLED_MTP)), "--no-qat-rounding", *extra]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    output = "".join(line for line in done.output.splitlines(True) if not line.startswith("[dist]"))
    figures = re.search(r"mtp N=2 next: .*", output)
    assert figures is not None, output
    return output[: figures.start()].split("prefill")[0], figures.group(0)


def test_run_mtp_on_a_coordinator(clusters):
    cluster = clusters["mtpcli"]
    want = speculative_reply()
    route = ["--dist-role", "coordinator", "--layers", "0:2", "--dist-addr", cluster.addr, "--dist-timeout", "300"]
    assert speculative_reply(*route) == want
    assert cluster.workers["2:output"].wait(timeout=60) == 0
