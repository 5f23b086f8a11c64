"""`--dspark-strict` (ds4's control for comparisons): the drafter is loaded and checked as for
speculation, and decoding is the model's alone, so the output is that of a run without `--dspark`."""

from __future__ import annotations

import pytest
from conftest import PROMPT, SMALL
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import ModelFileError
from dwarfstar.model.dspark import DSparkArgs
from dwarfstar.model.synthetic import write_synthetic_dspark
from dwarfstar.speculative.mtp_options import DSparkOptions

D = DSparkArgs(block_size=5, markov_rank=16, noise_token_id=128799, target_layers=(1, 2, 3), stages=3)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    path = tmp_path_factory.mktemp("strict") / "small-dspark.gguf"
    write_synthetic_dspark(path, SMALL, D, seed=2)
    return path


def invoke(args: list[str]):
    _register_commands()
    return CliRunner().invoke(app, args)


def test_a_strict_run_prints_what_a_run_without_dspark_prints(mtp_files, drafter):
    base = ["run", "-m", str(mtp_files["plain"]), "--backend", "reference", "--temp", "0", "-n", "24", "-c", "1024"]
    ids = ["--prompt-tokens", ",".join(map(str, PROMPT))]
    plain = invoke([*base, *ids])
    strict = invoke([*base, *ids, "--dspark", str(drafter), "--dspark-strict"])
    drafting = invoke([*base, *ids, "--dspark", str(drafter)])
    assert plain.exit_code == strict.exit_code == drafting.exit_code == 0, strict.output
    assert strict.stdout == plain.stdout and strict.stdout.strip()
    assert "accepted per step" in drafting.stderr  # the same flags without --dspark-strict speculate
    assert "accepted per step" not in strict.stderr


def test_strict_checks_the_drafter_as_speculation_does(mtp_files, drafter):
    base = ["run", "-m", str(mtp_files["plain"]), "--backend", "reference", "-n", "4", "-c", "1024", "-p", "hi"]
    cases = [
        (["--dspark-strict"], "--dspark-strict needs --dspark FILE"),
        (["--dspark", str(mtp_files["ds4"]), "--dspark-strict"], "not a DSpark support file"),
        (["--dspark", str(drafter), "--dspark-strict", "--mtp-draft", "2"], "--dspark and --mtp choose two drafters"),
    ]
    for args, message in cases:
        done = invoke([*base, *args])
        assert done.exit_code != 0
        assert message in str(done.exception) + done.output, (args, done.output)


def test_the_engine_loads_a_strict_drafter_for_checking_only(mtp_files, drafter, tmp_path):
    options = DSparkOptions(drafter, strict=True)
    strict = EngineSpec(mtp_files["plain"], backend="reference", ctx=256, speculation=options)
    assert strict.drafter is None  # nothing downstream (run, agent, serve) speculates
    assert load_engine(strict).model.args.n_layers == SMALL.n_layers
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(drafter.read_bytes()[: drafter.stat().st_size // 2])
    with pytest.raises(ModelFileError):
        load_engine(EngineSpec(mtp_files["plain"], backend="reference", speculation=DSparkOptions(broken, strict=True)))
