"""The `dwarfstar tokens`, `render` and `bench-tokenizer` command-line contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.prompt import render_conversation
from dwarfstar.tokenizer import Tokenizer
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json, tokenizer_metadata

CORPUS = json.loads((Path(__file__).parent / "data" / "encoding" / "corpus.json").read_text(encoding="utf-8"))
CASE = next(case for case in CORPUS["cases"] if case["name"] == "agent_three_rounds")
runner = CliRunner()
_register_commands()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A GGUF file holding only the tokenizer keys, as a converted model carries them."""
    path = tmp_path_factory.mktemp("gguf") / "tokenizer-only.gguf"
    with GGUFWriter(path, tokenizer_metadata(bundled_tokenizer_json(), 129280)):
        pass
    return path


@pytest.fixture(scope="module")
def tok(model: Path) -> Tokenizer:
    return Tokenizer.from_gguf(model)


@pytest.fixture(scope="module")
def conversation(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("conv") / "conv.json"
    path.write_text(json.dumps(CASE["request"], ensure_ascii=False), encoding="utf-8")
    return path


def invoke(*args: str, stdin: bytes | None = None):
    result = runner.invoke(app, list(args), input=stdin)
    assert result.exit_code == 0, result.output
    return result


def test_render_prints_the_official_bytes(conversation: Path) -> None:
    assert CASE["thinking"] and CASE["reasoning_effort"] == "max"
    result = invoke("render", "--messages-file", str(conversation), "--thinking", "--reasoning-effort", "max")
    assert result.stdout_bytes == CASE["expected"].encode("utf-8")


def test_render_in_the_0731_effort_table(conversation: Path) -> None:
    """The same request for Flash 0731 / PRO 0813: `max` opens with the "Beyond maximum" preamble instead,
    and the rest of the prompt is the preview's bytes after its own preamble."""
    args = ("render", "--messages-file", str(conversation), "--thinking", "--reasoning-effort", "max")
    text = invoke(*args, "--release", "0731").stdout_bytes.decode("utf-8")
    first = "<｜begin▁of▁sentence｜>Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    assert text.startswith(first)
    preview_rest = CASE["expected"].split("unchecked.\n\n", 1)[1]
    assert text.split("undiscovered.\n\n", 1)[1] == preview_rest
    bad = runner.invoke(app, [*args, "--release", "0999"])
    assert bad.exit_code != 0 and "--release must be one of preview, 0731" in str(bad.exception) + bad.output


def test_render_chat_mode_from_stdin(conversation: Path) -> None:
    result = invoke("render", "--messages-file", "-", stdin=conversation.read_bytes())
    expected = render_conversation(CASE["request"]["messages"], tools=CASE["request"]["tools"]).text
    assert result.stdout_bytes == expected.encode("utf-8")
    assert result.stdout_bytes.endswith("<｜Assistant｜></think>".encode())


def test_tokens_plain_and_special(model: Path, tok: Tokenizer, tmp_path: Path) -> None:
    text = "Ciao <｜User｜> 東京 🙂\n"
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    plain = invoke("tokens", "-m", str(model), "--text-file", str(path)).stdout
    special = invoke("tokens", "-m", str(model), "--text-file", str(path), "--special").stdout
    assert plain == " ".join(map(str, tok.encode(text))) + "\n"
    assert special == " ".join(map(str, tok.encode_with_specials(text))) + "\n"
    assert "128803" in special.split() and "128803" not in plain.split()


def test_render_piped_through_tokens_special_gives_the_model_ids(conversation: Path, model: Path, tok) -> None:
    rendered = invoke("render", "--messages-file", str(conversation), "--thinking").stdout_bytes
    ids = invoke("tokens", "-m", str(model), "--special", "--text-file", "-", stdin=rendered).stdout.split()
    request = CASE["request"]
    prompt = render_conversation(request["messages"], tools=request["tools"], thinking=True)
    assert [int(i) for i in ids] == tok.encode_prompt(prompt.parts)


def test_bench_tokenizer_reports_speed_and_agent_time(tmp_path: Path) -> None:
    text = tmp_path / "bench.txt"
    text.write_text("Quel ramo del lago di Como, che volge a mezzogiorno.\n" * 400, encoding="utf-8")
    output = invoke("bench-tokenizer", "--text-file", str(text), "--repeats", "1").stdout
    assert "ids identical to the official tokenizer: yes" in output
    assert "ratio (goal >= 0.9):" in output
    assert "agent conversation: 100 messages" in output


def test_user_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"messages": [{"role": "robot", "content": "x"}]}', encoding="utf-8")
    dwarfstar = Path(sys.executable).with_name("dwarfstar")
    result = subprocess.run([dwarfstar, "render", "--messages-file", bad], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr == "error: messages[0]: unknown role 'robot'; known: " + (
        "system, developer, user, assistant, tool, latest_reminder\n"
    )
