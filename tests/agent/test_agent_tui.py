"""The terminal UI driven in-process: the real prompt_toolkit application reads keys from a pipe while
a scripted model works. The question before a write outside the workspace, and the queue, Ctrl+X,
ESC and Ctrl+C keys."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable
from pathlib import Path

from conftest import make_agent, reply
from prompt_toolkit.application import create_app_session
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from dwarfstar.agent.commands import Commands
from dwarfstar.agent.output import Printer
from dwarfstar.agent.policy import ScriptedPolicy
from dwarfstar.agent.store import SessionStore
from dwarfstar.agent.tui import run_tui
from dwarfstar.agent.worker import Worker
from dwarfstar.kvcache.kvfile import ModelIdentity

WAIT_S = 60


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_write_outside_the_workspace_asks_and_the_answer_decides(nano, tmp_path: Path) -> None:
    work, outside = tmp_path / "work", tmp_path / "outside.txt"
    work.mkdir()
    write = ("write", {"path": str(outside), "content": "allowed\n"})
    policy = ScriptedPolicy(
        nano.tokenizer,
        nano.backend.args.eos_token_id,
        [reply("t", "", write), "t</think>Refused.", reply("t", "", write), "t</think>Written."],
    )
    agent = make_agent(nano, work, policy)
    store = SessionStore(tmp_path / "kv", nano.backend.args, ModelIdentity.of(nano.model), agent.ctx,
                         agent.session.chunk, nano.tokenizer, nano.backend.new_state)  # fmt: skip
    out = io.StringIO()
    printer = Printer(out)
    worker = Worker(agent, store, printer)
    agent.toolbox.workspace.confirm = worker.ask  # as `dwarfstar agent` wires it without --plain
    commands = Commands(worker, printer, lambda: agent.transcript, lambda question: False)
    seen: dict[str, object] = {}

    def user(keys) -> None:
        def answer_when_asked(answer: str) -> None:
            wait_for(lambda: worker.question is not None, "the question")
            seen.setdefault("questions", []).append(worker.question)
            keys.send_text(answer + "\r")
            wait_for(lambda: not worker.busy and not worker.queue, "the task to end")

        keys.send_text("write it\r")
        answer_when_asked("n")
        seen["after no"] = outside.exists()
        keys.send_text("again\r")
        answer_when_asked("y")
        keys.send_text("\x04")  # Ctrl+D on an empty line: exit, which asks to save
        keys.send_text("n\r")

    try:
        with create_pipe_input() as keys, create_app_session(input=keys, output=DummyOutput()):
            typist = threading.Thread(target=user, args=(keys,), daemon=True)
            typist.start()
            code = run_tui(worker, commands, printer, "nano.gguf", None, tmp_path / "home")
            typist.join(WAIT_S)
    finally:
        worker.close()
    assert code == 0
    assert seen["after no"] is False
    assert outside.read_text() == "allowed\n"
    question = f"the agent wants to write {outside}, outside the workspace {work}; allow?"
    assert seen["questions"] == [question, question]
    shown = out.getvalue()
    assert shown.count(f"[{question} [y/N]]") == 2  # the question is printed in the transcript
    first, second = (e.results for e in agent.transcript.entries if e.kind == "tools")
    assert first == [f"error: refused: {outside} is outside the workspace {work}"]
    assert second == [f"wrote 8 bytes (1 lines) to {outside}"]
    assert [line for line in shown.splitlines() if line in ("Refused.", "Written.")] == ["Refused.", "Written."]
    assert (tmp_path / "home" / "agent_history").read_text().count("+write it") == 1


def test_queue_edit_escape_and_ctrl_c_keys(nano, tmp_path: Path) -> None:
    """Enter while busy queues, Ctrl+X takes the queued prompt back into the editor, ESC interrupts
    and sends it now, Ctrl+C interrupts a task or clears the line when idle."""
    sleep = ("bash", {"command": "sleep 30"})
    replies = [reply("t", "", sleep), "t</think>B done.", reply("t", "", sleep)]
    policy = ScriptedPolicy(nano.tokenizer, nano.backend.args.eos_token_id, replies)
    agent = make_agent(nano, tmp_path, policy)
    store = SessionStore(tmp_path / "kv", nano.backend.args, ModelIdentity.of(nano.model), agent.ctx,
                         agent.session.chunk, nano.tokenizer, nano.backend.new_state)  # fmt: skip
    out = io.StringIO()
    printer = Printer(out)
    worker = Worker(agent, store, printer)
    commands = Commands(worker, printer, lambda: agent.transcript, lambda question: False)
    steps: list[str] = []

    def user(keys) -> None:
        def running(name: str) -> bool:
            return worker.busy and printer.activity == f"running {name}"

        keys.send_text("A\r")
        wait_for(lambda: running("bash"), "the first tool")
        keys.send_text("B\r")  # Enter while busy: queued
        wait_for(lambda: list(worker.queue) == ["B"], "B queued")
        keys.send_text("\x18")  # Ctrl+X: back into the editor
        wait_for(lambda: not worker.queue, "B taken back")
        steps.append(f"busy after Ctrl+X: {worker.busy}")
        keys.send_text("\r")  # the editor holds B again: Enter queues it once more
        wait_for(lambda: list(worker.queue) == ["B"], "B queued again")
        keys.send_text("\x1b")  # ESC: stop the tool, B goes now
        wait_for(lambda: not worker.busy and not worker.queue, "B's turn")
        keys.send_text("C\r")
        wait_for(lambda: running("bash"), "the second tool")
        keys.send_text("\x03")  # Ctrl+C while busy: interrupt
        wait_for(lambda: not worker.busy, "the interrupt")
        steps.append(f"C finished {worker.last_result.finish}")
        keys.send_text("never sent\x03")  # Ctrl+C while idle: the line is cleared
        keys.send_text("\r")  # an empty line: nothing
        keys.send_text("\x04")
        keys.send_text("n\r")

    try:
        with create_pipe_input() as keys, create_app_session(input=keys, output=DummyOutput()):
            typist = threading.Thread(target=user, args=(keys,), daemon=True)
            typist.start()
            code = run_tui(worker, commands, printer, "nano.gguf", None, tmp_path / "home")
            typist.join(WAIT_S)
    finally:
        worker.close()
    assert code == 0
    assert steps == ["busy after Ctrl+X: True", "C finished interrupted"]
    assert agent.transcript.user_turns() == ["A", "B", "C"]  # "never sent" was cleared, not submitted
    tools = agent.transcript.entries[2]
    assert tools.kind == "tools" and tools.text == "B" and "interrupted by the user" in tools.results[0]
    assert "B done." in out.getvalue().splitlines()
    assert out.getvalue().count("[interrupted]") == 2 and "sending the queued prompt" in out.getvalue()
    assert policy.replies == []
