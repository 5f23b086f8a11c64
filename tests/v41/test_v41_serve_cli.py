"""`dwarfstar serve` and `dwarfstar agent` take a DeepSeek V4.1 file on the reference backend (issue 33),
and what still cannot run with one is refused by name in one line, before any request."""

from __future__ import annotations

import re

import pytest
from test_cli_front import cli, refused

from dwarfstar.cli import _register_commands

_register_commands()

NOT_WITH_V41 = "does not run with DeepSeek V4.1 Flash yet (issue 33)"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mtp", "{model}"], "--mtp does not run with DeepSeek V4.1: it has no MTP block"),
        # steering runs V4.1 (tests/v41/test_v41_steering.py): the model file is no direction for it
        (["--dir-steering-file", "{model}"], "this model needs [12, 64] float32"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "agent"])
def test_what_cannot_run_with_v41_is_refused_by_name(
    monkeypatch, capsys, v41_tiny_file, tmp_path, command, flags, message
):
    model = str(v41_tiny_file)
    args = [command, "-m", model, "--backend", "reference", *(f.format(model=model) for f in flags)]
    args += ["--port", "0"] if command == "serve" else ["--plain", "-p", "hi", "--kv-dir", str(tmp_path)]
    assert message in refused(monkeypatch, capsys, *args)


def test_the_agent_answers_on_v41_and_keeps_its_system_prompt_on_disk(monkeypatch, capsys, v41_tiny_file, tmp_path):
    monkeypatch.chdir(tmp_path)
    args = ["agent", "-m", str(v41_tiny_file), "--backend", "reference", "--plain", "-p", "hi", "-n", "3"]
    args += ["--temp", "0", "--think-level", "40", "--kv-dir", str(tmp_path / "kv")]
    prefilled = []
    for _ in range(2):
        code, out, err = cli(monkeypatch, capsys, *args)
        assert code == 0, err
        assert "[length" in out + err and "Traceback" not in err
        prefilled.append(int(re.search(r"\| prefill (\d+) tok", out + err).group(1)))
        assert (tmp_path / "kv" / "sysprompt.kv").is_file()  # the system prompt's state: a DS41 payload
    assert prefilled[1] < prefilled[0] // 10  # the second start read the system prompt back instead
