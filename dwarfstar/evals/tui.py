"""How `dwarfstar eval` shows its run: ds4-eval's split-screen TUI (rich), or `--plain` text.

TUI: the questions on the left with their state (pending, prefill, thinking, answer, passed, failed,
skipped, stopped), the running question's stream on the right (reasoning dim, the answer plain), and
a status line. Keys, as in ds4-eval: Up/Down select a question, Enter runs the selected one next
(the running one goes back to pending), `p` pauses and resumes, `q` quits and prints the report.
Plain: one heading per question, the streamed text, then `PASSED`/`FAIL got X expected Y`.
"""

from __future__ import annotations

import os
import select
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from rich.console import Console, Group
from rich.layout import Layout
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

from dwarfstar.evals.eval_trace import CaseRecord
from dwarfstar.evals.questions import Question
from dwarfstar.evals.runner import Stop

STREAM_CHARS = 6000  # the tail of the running output the right pane keeps
STATE_STYLES = {"passed": "green", "failed": "red", "skipped": "yellow", "stopped": "yellow", "pending": "dim"}


class PlainDisplay:
    """`--plain`: everything in order on stdout, reasoning dim on a terminal."""

    requested: int | None = None
    quit = False

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.styled = self.out.isatty() and "NO_COLOR" not in os.environ
        self.last = "\n"

    def __enter__(self) -> PlainDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def start(self, index: int, total: int, question: Question) -> None:
        self.out.write(f"\n[{index}/{total}] {question.source}/{question.domain} {question.title}\n")
        self.last = "\n"

    def phase(self, name: str) -> None:
        pass

    def text(self, piece: str, thinking: bool) -> None:
        if not piece:
            return
        style = "\x1b[90m" if thinking and self.styled else ""
        self.out.write(style + piece + ("\x1b[0m" if style else ""))
        self.out.flush()
        self.last = piece[-1]

    def finish(self, record: CaseRecord) -> None:
        if self.last != "\n":
            self.out.write("\n")
        if record.status == "skipped":
            self.out.write(f"SKIPPED prompt={record.prompt_tokens} ({record.error})\n")
            return
        verdict = "PASSED" if record.status == "passed" else "FAIL"
        if self.styled:
            verdict = ("\x1b[32m" if record.status == "passed" else "\x1b[31m") + verdict + "\x1b[0m"
        self.out.write(
            f"{verdict} got {record.picked} expected {record.expected} "
            f"({record.elapsed_sec:.1f}s, {record.generated_tokens} tokens)\n"
        )
        self.out.flush()

    def check(self) -> None:
        pass


class _Keys:
    """Reads single keys from the terminal in a thread (cbreak mode), restoring it on close."""

    def __init__(self) -> None:
        import termios
        import tty

        self.fd = sys.stdin.fileno()
        self.saved = termios.tcgetattr(self.fd)
        tty.setcbreak(self.fd)
        self.keys: list[str] = []
        self.lock = threading.Lock()
        self.running = True
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        buffer = ""
        while self.running:
            ready, _, _ = select.select([self.fd], [], [], 0.1)
            if not ready:
                continue
            buffer += os.read(self.fd, 16).decode("utf-8", errors="replace")
            while buffer:
                for name, seq in (("up", "\x1b[A"), ("down", "\x1b[B")):
                    if buffer.startswith(seq):
                        self._push(name)
                        buffer = buffer[len(seq) :]
                        break
                else:
                    if buffer.startswith("\x1b") and len(buffer) < 3:
                        break  # the rest of an arrow key's sequence is on its way
                    key, buffer = buffer[0], buffer[1:]
                    self._push({"\r": "enter", "\n": "enter"}.get(key, key.lower()))

    def _push(self, key: str) -> None:
        with self.lock:
            self.keys.append(key)

    def take(self) -> list[str]:
        with self.lock:
            keys, self.keys = self.keys, []
        return keys

    def close(self) -> None:
        import termios

        self.running = False
        self.thread.join(timeout=1)
        termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)


class EvalTui:
    """The split screen; `check()` applies the keys pressed since the last call and raises `Stop`."""

    def __init__(self, questions: Sequence[Question], model: str, console: Console | None = None) -> None:
        self.questions, self.model = questions, model
        self.states = ["pending"] * len(questions)
        self.picked = [""] * len(questions)
        self.selected, self.running = 0, -1
        self.requested: int | None = None
        self.quit = self.paused = False
        self.stream = Text()
        self.phase_name = "starting"
        self.started = time.perf_counter()
        self.tokens = 0
        self.live = Live(self._render(), console=console, auto_refresh=False, screen=True, transient=True)
        self.keys: _Keys | None = None

    def __enter__(self) -> EvalTui:
        self.live.__enter__()
        self.keys = _Keys()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.keys:
            self.keys.close()
        self.live.__exit__(None, None, None)

    def _render(self) -> Layout:
        rows = []
        for i, question in enumerate(self.questions):
            mark = ">" if i == self.selected else " "
            state = self.states[i]
            style = STATE_STYLES.get(state, "cyan")
            line = Text(f"{mark}{i + 1:3d} ", style="bold" if i == self.selected else "")
            line.append(f"{state:<8} ", style=style)
            line.append(f"{self.picked[i] or '-':<6} {question.label}")
            rows.append(line)
        layout = Layout()
        layout.split_row(Layout(name="list", ratio=2), Layout(name="stream", ratio=3))
        layout["list"].update(Panel(Group(*rows), title=f"dwarfstar eval: {self.model}"))
        done = sum(s == "passed" for s in self.states)
        status = (
            f"{self.phase_name}{' (paused)' if self.paused else ''} | {self.tokens} tokens | "
            f"{done} passed | {time.perf_counter() - self.started:.0f}s | Up/Down Enter p q"
        )
        layout["stream"].update(Panel(self.stream, title=status))
        return layout

    def refresh(self) -> None:
        self.live.update(self._render(), refresh=True)

    def start(self, index: int, total: int, question: Question) -> None:
        self.running = index - 1
        self.states[self.running] = "prefill"
        self.stream, self.tokens = Text(), 0
        self.refresh()

    def phase(self, name: str) -> None:
        self.phase_name = name
        if self.running >= 0:
            self.states[self.running] = name
        self.refresh()

    def text(self, piece: str, thinking: bool) -> None:
        self.tokens += 1
        self.stream.append(piece, style="dim italic" if thinking else "")
        if len(self.stream) > STREAM_CHARS:
            self.stream = self.stream[-STREAM_CHARS:]
        self.refresh()

    def finish(self, record: CaseRecord) -> None:
        self.states[record.index - 1] = record.status
        self.picked[record.index - 1] = record.picked
        self.refresh()

    def check(self) -> None:
        while True:
            for key in self.keys.take() if self.keys else []:
                if key == "up":
                    self.selected = max(0, self.selected - 1)
                elif key == "down":
                    self.selected = min(len(self.questions) - 1, self.selected + 1)
                elif key == "p":
                    self.paused = not self.paused
                elif key == "q":
                    self.quit = True
                elif key == "enter" and self.selected != self.running:
                    self.requested = self.selected
            self.refresh()
            if self.quit:
                raise Stop("quit")
            if self.requested is not None and self.running >= 0:
                self.states[self.running] = "pending"
                raise Stop("switch")
            if not self.paused:
                return
            time.sleep(0.05)
