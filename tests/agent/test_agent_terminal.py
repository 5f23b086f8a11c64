"""Sessions end to end, driven in a real terminal (pexpect) with the bundled model at temperature 0:
save, list, quit; restart and switch with no prefill and the same next reply as an uninterrupted
session; strip and switch (rebuilt by prefill, same reply); delete; unusable files; the terminal UI."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pexpect
import pytest

PROMPT = "agent> "
STATUS = re.compile(r"\[(\w+), (\d+) tool rounds, reused (\d+), prefilled (\d+); context (\d+)/")
FIRST, SECOND = "Quel ramo del lago di Como", "e poi?"


class Agent:
    def __init__(self, tmp: Path, kv: Path, *args: str, work: Path | None = None, plain: bool = True) -> None:
        self.trace = tmp / "trace.txt"
        work = work or tmp / "work"  # the workspace path is part of the system prompt
        work.mkdir(exist_ok=True)
        env = dict(os.environ, HOME=str(tmp / "home"), DWARFSTAR_KVCACHE=str(kv), NO_COLOR="1", COLUMNS="200")
        argv = ["-m", "dwarfstar", "agent", "--backend", "reference", "--temp", "0", "-n", "12", "--ctx", "4096"]
        argv += ["--trace", str(self.trace), *(["--plain"] if plain else []), *args]
        self.child = pexpect.spawn(sys.executable, argv, cwd=work, env=env, encoding="utf-8", timeout=120,
                                   dimensions=(40, 200))  # fmt: skip
        if plain:
            self.child.expect_exact(PROMPT)

    def command(self, line: str) -> str:
        """Send a line; returns what was printed before the next prompt."""
        self.child.sendline(line)
        self.child.expect_exact(PROMPT)
        return self.child.before.replace("\r\n", "\n").split("\n", 1)[1]  # drop the echoed line

    def ask(self, text: str) -> tuple[str, re.Match]:
        """A prompt; returns the reply as printed and its status line."""
        out = self.command(text)
        status = STATUS.search(out)
        assert status, out
        return out[: status.start()], status

    def quit(self, answer: str | None = None) -> None:
        self.child.sendline("/quit")
        if answer is not None:
            self.child.expect_exact("save the session before leaving? [y/N] ")
            self.child.sendline(answer)
        self.child.expect(pexpect.EOF)
        self.child.close()
        assert self.child.exitstatus == 0

    def traced(self) -> str:
        return self.trace.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("work")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, work: Path) -> str:
    """The second reply of a session that never stopped."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    agent = Agent(tmp, tmp / "kv", work=work)
    agent.ask(FIRST)
    second, _ = agent.ask(SECOND)
    agent.quit("n")
    return second


def test_sessions_end_to_end(tmp_path: Path, work: Path, uninterrupted: str) -> None:
    kv = tmp_path / "kv"
    first = Agent(tmp_path, kv, work=work)
    assert first.command("/list").strip() == "no saved sessions"
    _, status = first.ask(FIRST)
    saved = first.command("/save")
    sid, tokens = re.search(r"saved session ([0-9a-f]{8}) \((\d+) tokens\)", saved).groups()
    listing = first.command("/list")
    assert re.search(rf"^  {sid} \(\d+s ago\) {FIRST}  \[{tokens} tokens, [\d.]+ MiB\]$", listing, re.M), listing
    first.quit()  # saved: nothing to ask
    assert "sysprompt: prefilled" in first.traced()

    # a restart loads the system prompt and the session from their KV files: nothing is prefilled
    second = Agent(tmp_path, kv, work=work)
    switched = second.command(f"/switch {sid[:5]}")
    assert f"switched to {sid}: {tokens} tokens, loaded from disk, no prefill (0 tokens prefilled)" in switched
    assert f"1. {FIRST}" in switched  # the last user turns
    reply, status = second.ask(SECOND)
    assert int(status.group(3)) == int(tokens)  # the whole restored context was reused
    assert reply == uninterrupted
    trace = second.traced()
    assert re.search(r"sysprompt: loaded \d+ tokens from sysprompt.kv, prefilled 0", trace)
    assert re.search(rf"switch {sid}\w+: loaded {tokens} tokens from disk, prefilled 0", trace)
    assert second.command("/history 1") == f"  2. {SECOND}\n"
    assert second.command("/history") == f"  1. {FIRST}\n  2. {SECOND}\n"
    second.quit("n")

    # stripped: the text stays, the KV goes; switching rebuilds it by prefill, with the same reply
    third = Agent(tmp_path, kv, work=work)
    assert f"stripped session {sid}" in third.command(f"/strip {sid}")
    assert "stripped]" in third.command("/list")
    switched = third.command(f"/switch {sid}")
    rebuilt = int(re.search(r"rebuilt by prefill \((\d+) tokens prefilled\)", switched).group(1))
    assert rebuilt > 0
    reply, _ = third.ask(SECOND)
    assert reply == uninterrupted
    assert f"deleted session {sid}" in third.command(f"/del {sid}")
    assert third.command("/list").strip() == "no saved sessions"
    third.quit("n")
    assert sorted(p.name for p in kv.iterdir()) == ["sysprompt.kv"]


def test_unusable_session_files_are_listed_not_fatal(tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    kv.mkdir()
    (kv / "agent-00000000deadbeef.json").write_text("][")
    kv_name = "ab" * 20 + ".kv"
    (kv / kv_name).write_bytes(b"KVC\1" + b"\0" * 60)
    meta = {"title": "broken", "created": 1.0, "updated": 2.0, "tokens": 5, "kv": kv_name,
            "transcript": {"system": "s", "mode": "think", "summary": None, "entries": []}}  # fmt: skip
    (kv / "agent-11111111cafecafe.json").write_text(json.dumps(meta))
    agent = Agent(tmp_path, kv)
    listing = agent.command("/list")
    assert re.search(r"^  00000000 .*UNUSABLE: unreadable session file", listing, re.M), listing
    assert re.search(r"^  11111111 .*broken .*UNUSABLE: KV file: ", listing, re.M), listing
    assert "cannot be used" in agent.command("/switch 1111")
    _, status = agent.ask("ciao")  # still working
    assert status.group(1) in ("stop", "length")
    agent.quit("n")


CURSOR_QUERY = re.compile(re.escape("\x1b[6n"))


def expect_on_screen(child: pexpect.spawn, pattern: str) -> None:
    """Wait for `pattern`, answering prompt_toolkit's cursor-position queries as a terminal does (it draws
    the footer only once it knows the screen)."""
    while child.expect([pattern, CURSOR_QUERY]) == 1:
        child.send("\x1b[20;1R")


def test_the_terminal_ui(tmp_path: Path) -> None:
    agent = Agent(tmp_path, tmp_path / "kv", plain=False)
    child = agent.child
    expect_on_screen(child, r"nano\.gguf │ \d+/4096 tokens, \d+ free │ [\d.,]+ tok/s │ session new │ idle")
    child.send(FIRST + "\r")
    expect_on_screen(child, r"session [0-9a-f]{8} │ idle")  # the footer names the session once it has one
    child.send("/sa\t")  # Tab completes the command
    expect_on_screen(child, "/save")
    child.send("\r")
    expect_on_screen(child, r"saved session [0-9a-f]{8} \(\d+ tokens\)")
    child.sendcontrol("d")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
