"""How the agent's work is written out: streamed reasoning and answer, tool calls and their results.

On a terminal the reasoning is dim italic (terminal.py's style) and tool lines are coloured through
rich; in a pipe (or with NO_COLOR) reasoning is framed by `<think>`/`</think>` lines instead, so a
transcript read back from a log still shows which text was thinking.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO

from rich.console import Console

from dwarfstar.agent.loop import Events
from dwarfstar.agent.tools import ToolOutcome
from dwarfstar.console.terminal import REASONING_STYLE, RESET_STYLE, is_styled

RESULT_PREVIEW_LINES = 6
ARGUMENT_PREVIEW_CHARS = 160


def preview(arguments: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
    return text if len(text) <= ARGUMENT_PREVIEW_CHARS else text[: ARGUMENT_PREVIEW_CHARS - 1] + "…"


class Printer(Events):
    def __init__(self, out: TextIO | None = None) -> None:
        self._out = out  # None: whatever sys.stdout is at the time (the terminal UI patches it)
        self.styled = is_styled(self.out)
        self.console = Console(file=out, highlight=False, soft_wrap=True, color_system="auto" if self.styled else None)
        self.kind: str | None = None
        self.activity = "idle"  # for the status footer
        self.at_line_start = True
        self.lock = threading.Lock()  # the worker writes; the front end writes command output

    @property
    def out(self) -> TextIO:
        return self._out or sys.stdout

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.at_line_start = text.endswith("\n")

    def _newline(self) -> None:
        if not self.at_line_start:
            self._write("\n")

    def _switch(self, kind: str | None) -> None:
        if kind == self.kind:
            return
        if self.kind == "reasoning":
            if self.styled:
                self.out.write(RESET_STYLE)
            self._newline()
            if not self.styled:
                self._write("</think>\n")
        elif self.kind == "content":
            self._newline()
        if kind == "reasoning":
            if self.styled:
                self.out.write(REASONING_STYLE)
            else:
                self._write("<think>\n")
        self.kind = kind

    def text(self, kind: str, text: str) -> None:
        self.activity = "thinking" if kind == "reasoning" else "writing"
        with self.lock:
            self._switch(kind)
            self._write(text)
            self.out.flush()

    def reply_end(self, finish: str) -> None:
        self.activity = "working"
        with self.lock:
            self._switch(None)
            if finish not in ("stop",):
                self._line(f"[{finish}]", "yellow")
            self.out.flush()

    def tool_start(self, name: str, arguments: dict[str, Any]) -> None:
        self.activity = f"running {name}"
        with self.lock:
            self._switch(None)
            self._line(f"⏺ {name}({preview(arguments)})", "bold cyan")

    def tool_progress(self, name: str, output: str) -> None:
        last = output.strip().splitlines()[-1:] or [""]
        with self.lock:
            self._line(f"  … {name} running: {last[0][:120]}", "dim")

    def tool_end(self, name: str, outcome: ToolOutcome) -> None:
        lines = outcome.text.splitlines() or [""]
        shown = lines[:RESULT_PREVIEW_LINES]
        if len(lines) > RESULT_PREVIEW_LINES:
            shown.append(f"… {len(lines) - RESULT_PREVIEW_LINES} more lines")
        with self.lock:
            self._switch(None)
            style = "red" if outcome.error else "dim"
            for line in shown:
                self._line(f"  ⎿ {line}", style)

    def status(self, text: str) -> None:
        with self.lock:
            self._switch(None)
            self._line(f"[{text}]", "magenta")

    def message(self, text: str, style: str = "") -> None:
        """Command output from the front end."""
        with self.lock:
            self._switch(None)
            for line in text.splitlines() or [""]:
                self._line(line, style)

    def _line(self, text: str, style: str) -> None:
        self._newline()
        self.console.print(text, style=style or None, markup=False)
        self.at_line_start = True
        self.out.flush()
