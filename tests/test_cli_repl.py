"""The interactive `dwarfstar run`, driven as a real terminal through pexpect."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pexpect
import pytest

from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.tokenizer.specials import ASSISTANT, THINK_END, THINK_START

PROMPT = "dwarfstar> "
# [reused N cached tokens, prefilled N at X tok/s, generated N at X tok/s (finish); session N/ctx tokens, ...]
STATS = re.compile(r"\[reused (\d+) cached tokens, prefilled (\d+) .*generated (\d+) .*\((\w+)\); session (\d+)/")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_synthetic_model(path, TINY, seed=0)
    return path


def spawn(tiny: Path, home: Path, *args: str) -> pexpect.spawn:
    env = dict(os.environ, HOME=str(home), NO_COLOR="1", COLUMNS="200")
    child = pexpect.spawn(
        sys.executable,
        ["-m", "dwarfstar", "run", "-m", str(tiny), "--backend", "reference", "--temp", "0", *args],
        env=env,
        encoding="utf-8",
        timeout=60,
        dimensions=(40, 200),
    )
    child.expect_exact(PROMPT)
    return child


def turn_stats(child: pexpect.spawn) -> re.Match:
    """Wait for the end of a turn; returns its statistics line."""
    child.expect(STATS)
    match = child.match
    child.expect_exact(PROMPT)
    return match


def say(child: pexpect.spawn, line: str) -> re.Match:
    child.sendline(line)
    return turn_stats(child)


def rendered_prompts(trace: Path) -> list[str]:
    """The rendered prompts in the trace, in order."""
    text = trace.read_text(encoding="utf-8")
    return re.findall(r"rendered prompt \(\d+ tokens\)\n(.*?)\n-{40}\n", text, flags=re.S)


def test_memory_thinking_read_save_load(tiny, tmp_path) -> None:
    trace = tmp_path / "trace.txt"
    child = spawn(tiny, tmp_path, "--nothink", "-n", "8", "--ctx", "4096", "--trace", str(trace))

    first = say(child, "My name is Ada.")
    assert first.group(1) == "0" and first.group(3) == "8"
    second = say(child, "What is my name?")
    # the second turn reuses the whole live session and computes only the new message
    assert int(second.group(1)) == int(first.group(5)) and int(second.group(2)) < 20

    child.sendline("/think")
    child.expect_exact("[mode: think]")
    child.expect_exact(PROMPT)
    note = tmp_path / "note.txt"
    note.write_text("The secret word is pineapple.", encoding="utf-8")
    child.sendline(f"/read {note}")
    child.expect_exact("[sending")
    third = turn_stats(child)
    assert int(third.group(1)) == int(second.group(5))

    prompts = rendered_prompts(trace)
    assert len(prompts) == 3
    assert prompts[0].endswith(f"{ASSISTANT}{THINK_END}") and prompts[1].endswith(f"{ASSISTANT}{THINK_END}")
    assert prompts[2].endswith(f"The secret word is pineapple.{ASSISTANT}{THINK_START}")  # /think, /read
    assert prompts[2].startswith(prompts[1]) and "My name is Ada." in prompts[2]  # one growing transcript

    child.sendline("/save chat1")
    child.expect(r"\[saved chat1: (\d+) tokens")
    saved_tokens = int(child.match.group(1))
    child.expect_exact(PROMPT)
    assert (tmp_path / ".dwarfstar" / "sessions" / "chat1.dsv4").is_file()
    child.sendline("/ctx 4096")  # a new, empty session...
    child.expect_exact("[new session of 4096 tokens")
    child.expect_exact(PROMPT)
    child.sendline("/load chat1")  # ...brought back from the file, without recomputing
    child.expect_exact(f"[loaded chat1: 3 turns, {saved_tokens} tokens, mode think]")
    child.expect_exact(PROMPT)
    fourth = say(child, "And the secret word?")
    assert int(fourth.group(1)) == saved_tokens and int(fourth.group(5)) > saved_tokens

    child.sendline("/quit")
    child.expect(r"load [\d.]+ s \| prefill")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_generation_and_the_chat_goes_on(tiny, tmp_path) -> None:
    # a small context bounds the follow-up reply; -n cannot end the first one before Ctrl+C does
    child = spawn(tiny, tmp_path, "--nothink", "-n", "100000", "--ctx", "256")
    child.sendline("Tell me a very long story.")
    child.expect_exact("Tell me a very long story.\r\n")  # the terminal's echo
    child.expect(r"\S{3}")  # the reply is streaming
    child.sendintr()
    child.expect_exact("[interrupted]")
    child.expect(STATS)
    interrupted = child.match
    assert interrupted.group(4) == "interrupted" and 0 < int(interrupted.group(3)) < 200
    child.expect_exact(PROMPT)

    follow_up = say(child, "Go on.")
    # the interrupted turn stays in the conversation and its KV is reused
    assert int(follow_up.group(1)) == int(interrupted.group(5))
    assert follow_up.group(4) == "length" and int(follow_up.group(3)) > 0

    child.sendintr()  # at an empty prompt: a hint, then a second Ctrl+C leaves
    child.expect_exact("again to quit")
    child.expect_exact(PROMPT)
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
