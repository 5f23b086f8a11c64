"""`--plain`: the agent as a line-mode program, for pipes, scripts and tests.

One line is one prompt or command; when the task is done a status line (the terminal UI's footer)
is printed and the next prompt (`agent> `) appears. Questions are answered by the next input line. Ctrl+C
interrupts the running task; EOF exits like /quit.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from dwarfstar.agent.commands import Commands
from dwarfstar.agent.output import Printer
from dwarfstar.agent.worker import Worker

PROMPT = "agent> "
POLL_S = 0.05


def status_line(worker: Worker) -> str:
    agent = worker.agent
    used = len(agent.session.tokens)
    result = worker.last_result
    done = (
        f"{result.finish}, {result.rounds} tool rounds, reused {result.reused}, prefilled {result.prefilled}; "
        if result
        else ""
    )
    session = worker.identity.id[:8] if worker.identity.id else "new"
    return (
        f"[{done}context {used}/{agent.ctx} tokens, {agent.ctx - used} free; "
        f"decode {agent.decode_speed.describe()}; session {session}]"
    )


def wait(worker: Worker) -> None:
    """Wait for the task to end; Ctrl+C interrupts it (the second one too, never the wait)."""
    while True:
        try:
            while worker.busy or worker.queue:
                if worker.question is not None:
                    worker.answer(False)  # the line mode cannot ask in the middle of a task
                time.sleep(POLL_S)
            return
        except KeyboardInterrupt:
            worker.interrupt()


def run_plain(
    worker: Worker, commands: Commands, printer: Printer, first: str | None, stdin: TextIO | None = None
) -> int:
    """The line loop; with `first` (-p) it runs that one task and returns 0 unless it failed or was stopped."""
    source = stdin or sys.stdin

    def run_task(task: str) -> None:
        worker.submit(task)
        wait(worker)
        printer.message(status_line(worker), "dim")

    if first is not None:
        run_task(first)
        result = worker.last_result
        return 0 if result is not None and result.finish in ("stop", "length") else 1
    while True:
        printer.out.write(PROMPT)
        printer.out.flush()
        try:
            line = source.readline()
        except KeyboardInterrupt:
            printer.message("")
            continue
        if not line:
            printer.message("")
            commands.handle("/quit")
            return 0
        if not commands.typed(line, run_task):
            return 0


def confirm_from(stdin: TextIO | None, printer: Printer):
    """A yes/no question answered by the next input line (EOF: no)."""

    def confirm(question: str) -> bool:
        printer.out.write(f"{question} [y/N] ")
        printer.out.flush()
        answer = (stdin or sys.stdin).readline()
        return answer.strip().lower() in ("y", "yes")

    return confirm
