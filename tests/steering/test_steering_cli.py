"""The `--dir-steering-*` flags on run, serve and bench, and the `steer` commands' bad input, on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.model.loader import open_model
from dwarfstar.steering.direction import SteeringError, write_direction

_register_commands()


@pytest.fixture(scope="module")
def tiny(tiny_model_file) -> Path:
    return tiny_model_file(4)


@pytest.fixture(scope="module")
def direction(tiny, tmp_path_factory) -> Path:
    args = open_model(tiny).args
    rows = torch.randn(args.n_layers, args.dim, generator=torch.Generator().manual_seed(8))
    path = tmp_path_factory.mktemp("steer") / "dir.f32"
    write_direction(path, rows / rows.norm(dim=-1, keepdim=True), "ffn_out", {})
    return path


def invoke(*args: str):
    return CliRunner().invoke(app, [*args])


def run_text(tiny: Path, *extra: str) -> str:
    done = invoke("run", "-m", str(tiny), "--backend", "reference", "-p", "Milano", "--nothink", "--temp", "0",
                  "-n", "8", *extra)  # fmt: skip
    assert done.exit_code == 0, done.output
    return done.stdout


def test_run_applies_the_file(tiny, direction):
    plain = run_text(tiny)
    assert run_text(tiny, "--dir-steering-file", str(direction), "--dir-steering-ffn", "0") == plain
    assert run_text(tiny, "--dir-steering-file", str(direction), "--dir-steering-ffn", "-60") != plain


@pytest.mark.parametrize("command", [["run", "-p", "x"], ["serve"], ["bench"]])
def test_a_scale_without_a_file_is_an_error(command):
    done = invoke(*command, "--dir-steering-ffn", "2")
    assert isinstance(done.exception, SteeringError), done.output
    assert "need --dir-steering-file" in str(done.exception)


def test_a_file_of_another_model_names_both_shapes(tiny, tmp_path):
    args = open_model(tiny).args
    other = tmp_path / "pro.f32"
    other.write_bytes(bytes(61 * 7168 * 4))
    done = invoke("run", "-m", str(tiny), "--backend", "reference", "-p", "x", "--dir-steering-file", str(other))
    assert isinstance(done.exception, SteeringError)
    want = f"([61, 7168], DeepSeek V4 PRO's shape); this model needs [{args.n_layers}, {args.dim}]"
    assert want in str(done.exception)


def test_scale_out_of_range_on_the_command_line(tiny, direction):
    done = invoke("run", "-m", str(tiny), "--backend", "reference", "-p", "x", "--dir-steering-file", str(direction),
                  "--dir-steering-attn", "-100.5")  # fmt: skip
    assert isinstance(done.exception, SteeringError) and "between -100 and 100" in str(done.exception)


def test_steer_commands_refuse_bad_options(tiny, direction, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Renzo\n")
    model = ["-m", str(tiny), "--backend", "reference"]
    done = invoke("steer", "eval", str(direction), "--prompts", str(prompts), "--scales", "1,strong", *model)
    assert isinstance(done.exception, SteeringError) and "comma-separated numbers" in str(done.exception)
    done = invoke("steer", "eval", str(direction), "--prompts", str(prompts), "--scales", "150", *model)
    assert isinstance(done.exception, SteeringError) and "between -100 and 100" in str(done.exception)
    done = invoke("steer", "build", "--good", str(prompts), "--bad", str(prompts), "-o", str(tmp_path / "d.f32"),
                  "--component", "mlp", *model)  # fmt: skip
    assert isinstance(done.exception, SteeringError) and "ffn_out, attn_out" in str(done.exception)


def test_build_writes_a_file_run_reads(tiny, tmp_path):
    good, bad = tmp_path / "good.txt", tmp_path / "bad.jsonl"
    good.write_text("Renzo e Lucia\nIl lago di Como\n")
    bad.write_text('{"prompt": "Don Abbondio"}\n{"prompt": "I bravi"}\n')
    out = tmp_path / "built.f32"
    model = ["-m", str(tiny), "--backend", "reference"]
    done = invoke("steer", "build", "--good", str(good), "--bad", str(bad), "-o", str(out), "--component", "attn_out",
                  *model)  # fmt: skip
    assert done.exit_code == 0, done.output
    args = open_model(tiny).args
    assert out.stat().st_size == args.n_layers * args.dim * 4
    assert '"component": "attn_out"' in (tmp_path / "built.f32.json").read_text()
    assert run_text(tiny, "--dir-steering-file", str(out), "--dir-steering-attn", "1")


def test_options_pass_to_a_child_server_as_flags(direction):
    from dwarfstar.commands.flags import SteeringFlags

    options = SteeringFlags(direction, None, -0.5).options()  # a file alone steers the FFN at 1
    flags = options.flags()
    assert flags == ["--dir-steering-file", str(direction), "--dir-steering-ffn", "1.0", "--dir-steering-attn", "-0.5"]
    again = SteeringFlags(Path(flags[1]), float(flags[3]), float(flags[5])).options()
    assert again.path == options.path and again.scale == options.scale
