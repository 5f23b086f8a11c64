"""The command line as a user meets it: --version and -h, the commands in order of use, the flag names,
--config, and the errors a user gets before any work: a bad output path, a bad or busy port, a
directory given as the model, --plot without matplotlib. Each of those is one line on stderr, exit 2,
no traceback, and nothing written."""

from __future__ import annotations

import re
import socket
import sys

import pytest
from typer.testing import CliRunner

from dwarfstar import __version__
from dwarfstar.cli import _register_commands, app, main
from dwarfstar.model.bundled import default_model_path
from dwarfstar.model.synthetic import TINY_K, write_synthetic_model

_register_commands()


def cli(monkeypatch, capsys, *argv: str) -> tuple[int, str, str]:
    """`dwarfstar ARGV` as the console script runs it (errors through `main`): exit code, stdout, stderr."""
    monkeypatch.setattr(sys, "argv", ["dwarfstar", *argv])
    with pytest.raises(SystemExit) as stopped:
        main()
    out = capsys.readouterr()
    return stopped.value.code or 0, out.out, out.err


def refused(monkeypatch, capsys, *argv: str) -> str:
    """The one-line error of a refused command line."""
    code, out, err = cli(monkeypatch, capsys, *argv)
    assert code == 2, (argv, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.strip().startswith("error: ")
    return err


def help_text(*argv: str) -> str:
    done = CliRunner().invoke(app, [*argv, "-h"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert done.exit_code == 0, done.output
    return done.output


def test_version_and_short_help(monkeypatch, capsys):
    assert cli(monkeypatch, capsys, "--version")[:2] == (0, f"dwarfstar {__version__}\n")
    assert "Usage:" in help_text() and "Usage:" in help_text("bench", "kv")


def test_the_commands_people_use_come_first():
    names = re.findall(r"^│ (\w[\w-]*) ", help_text(), flags=re.M)
    assert names[:5] == ["run", "serve", "agent", "pull", "bench"]
    assert {"tokens", "render", "convert", "quantize", "steer", "test"} <= set(names[5:])


def test_flags_read_as_a_user_expects():
    run = help_text("run")
    assert "<bool>" not in run
    names = set(re.findall(r"(?<![\w-])--?[\w-]+", run))
    assert "--no-think" in names and "--nothink" not in names and "-sys" not in names
    assert "-s" in names  # --system's one-letter short option
    assert all(panel in run for panel in ("Model", "Generation", "Speculative", "Memory", "Distributed", "Debug"))
    assert "bundled nano model" in help_text("bench")  # what `bench` runs without -m


def test_ds4_spellings_still_work(monkeypatch, capsys):
    """`--nothink` and `-sys` (ds4's, and older scripts') are read, though the help no longer shows them."""
    args = ["run", "-m", str(default_model_path()), "-p", "Renzo", "--dump-tokens"]
    code, out, err = cli(monkeypatch, capsys, *args, "--nothink", "-sys", "Be brief.")
    assert code == 0, err
    assert cli(monkeypatch, capsys, *args)[1] == out


def test_a_directory_given_as_the_model(monkeypatch, capsys, tmp_path):
    err = refused(monkeypatch, capsys, "run", "-m", str(tmp_path), "-p", "hi", "--backend", "reference")
    assert f"{tmp_path} is a directory" in err


OUTPUTS = {
    "quantize": ["quantize", str(default_model_path()), "{out}", "--recipe", "q8"],
    "synth": ["synth", "{out}"],
    "bench --csv": ["bench", "--csv", "{out}"],
    "bench --plot": ["bench", "--plot", "{out}"],
    "steer build -o": ["steer", "build", "--good", "good.txt", "--bad", "bad.txt", "-o", "{out}"],
    "run --dump-logits": ["run", "--prompt-tokens", "1,2", "--dump-logits", "{out}"],
    "run --dump-logprobs": ["run", "-p", "hi", "--dump-logprobs", "{out}"],
    "run --trace": ["run", "-p", "hi", "--trace", "{out}"],
    "eval --trace": ["eval", "--trace", "{out}"],
}


@pytest.mark.parametrize("command", list(OUTPUTS))
def test_an_unwritable_output_path_is_refused_before_any_work(monkeypatch, capsys, tmp_path, command):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.chdir(tmp_path)
    for out, problem in ((blocker / "out.bin", "is not a directory"), (tmp_path, "is a directory")):
        argv = [str(out) if arg == "{out}" else arg for arg in OUTPUTS[command]]
        assert problem in refused(monkeypatch, capsys, *argv)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing written


def test_an_output_folder_is_made(monkeypatch, capsys, tmp_path):
    out = tmp_path / "new" / "deeper" / "tiny.gguf"
    code, _, err = cli(monkeypatch, capsys, "synth", str(out))
    assert code == 0, err
    assert out.stat().st_size > 0


def test_serve_refuses_a_bad_port_before_the_model_loads(monkeypatch, capsys, tmp_path):
    missing = str(tmp_path / "missing.gguf")  # a model that would fail to load: the port fails first
    err = refused(monkeypatch, capsys, "serve", "-m", missing, "--backend", "reference", "--port", "99999")
    assert "--port must be 0..65535, got 99999" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = refused(monkeypatch, capsys, "serve", "-m", missing, "--backend", "reference", "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in err


def test_plot_without_matplotlib_is_refused_before_the_bench(monkeypatch, capsys, tmp_path):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name))
    missing = str(tmp_path / "missing.gguf")
    err = refused(monkeypatch, capsys, "bench", "-m", missing, "--plot", str(tmp_path / "speed.png"))
    assert "--plot needs matplotlib" in err


def test_config_file_sets_flags_and_the_command_line_wins(monkeypatch, capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f'model = "{default_model_path()}"\nprompt = "Renzo"\ndump-tokens = true\n')
    code, from_file, err = cli(monkeypatch, capsys, "run", "--config", str(config))
    assert code == 0, err
    direct = cli(monkeypatch, capsys, "run", "-m", str(default_model_path()), "-p", "Renzo", "--dump-tokens")[1]
    assert from_file == direct
    overridden = cli(monkeypatch, capsys, "run", "--config", str(config), "-p", "Lucia")[1]
    assert overridden != from_file and "Luc" in overridden


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("nope = 1\n", "unknown key 'nope'"),
        ('ctx = "big"\n', "ctx must be an integer, got 'big'"),
        ("think = 1\n", "think must be true or false"),
        ("ctx = 0\n", "ctx must be at least 1, got 0"),
        ("ctx = \n", "is not TOML"),
    ],
)
def test_a_bad_config_file_is_one_line(monkeypatch, capsys, tmp_path, text, problem):
    config = tmp_path / "bad.toml"
    config.write_text(text)
    assert problem in refused(monkeypatch, capsys, "run", "--config", str(config), "-p", "hi")


def test_eval_runs_with_a_small_token_budget(monkeypatch, capsys, tmp_path):
    """`eval -n 200` gets past the reply budgets it never set (to the missing question file), while a
    budget the user set too high is still an error."""
    missing = str(tmp_path / "none.jsonl")
    assert "none.jsonl" in refused(monkeypatch, capsys, "eval", "-n", "200", "--questions-file", missing)
    err = refused(monkeypatch, capsys, "eval", "-n", "200", "--hard-limit-reply-budget", "512")
    assert "--hard-limit-reply-budget (512) must be below --tokens (200)" in err


def test_quantize_notes_a_larger_output(tmp_path):
    from dwarfstar.commands.quant_tools import growth_note

    small, wide = tmp_path / "small.gguf", tmp_path / "wide.gguf"
    write_synthetic_model(small, TINY_K, layout="ds4", seed=0)
    write_synthetic_model(wide, TINY_K, layout="f32", seed=0)
    note = growth_note(small, wide)
    assert note.startswith("note: wide.gguf is ") and "larger than small.gguf" in note
    assert "(was " in note and "as F32" in note
    assert growth_note(wide, small) is None


def test_piped_output_has_no_think_markup():
    """The bundled model thinks (here it closes its reasoning at once): a pipe gets the answer alone."""
    args = ["run", "--backend", "reference", "-p", "Chi era Renzo?", "-n", "12", "--temp", "0"]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 0, done.output
    assert done.stdout.strip() and "think>" not in done.stdout
