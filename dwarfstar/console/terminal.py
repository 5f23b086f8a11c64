"""What the user sees while a model works: streamed text, progress bars, the closing speed summary.

Generated text goes to stdout; progress and statistics go to stderr, so `dwarfstar run -p ... > out`
captures only the answer. On a terminal the reasoning is shown dim and italic, apart from the answer;
anywhere else the exact generated text is written (`reasoning</think>answer`), so nothing is lost.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from dwarfstar.prompt.dsml_parser import ContentDelta, DsmlParser, ReasoningDelta, ToolCallEnd

REASONING_STYLE = "\x1b[2;3m"  # dim italic
RESET_STYLE = "\x1b[0m"
PROGRESS_AFTER_S = 1.0  # prefills shorter than this show no bar

stderr_console = Console(stderr=True, highlight=False)


def note(text: str, style: str = "dim") -> None:
    """One status line on stderr, never wrapped (rich wraps at 80 columns when stderr is a file)."""
    stderr_console.print(text, style=style, markup=False, soft_wrap=True)


def is_styled(stream: TextIO) -> bool:
    return stream.isatty() and "NO_COLOR" not in os.environ


class StreamPrinter:
    """Writes generated text as it arrives, through the DSML parser: on a terminal the reasoning dim
    before the answer; elsewhere (a pipe, a file) the answer alone, the reasoning on `reasoning_out`
    (stderr), with no `</think>` or DSML markup in the output."""

    def __init__(self, thinking: bool, out: TextIO | None = None, reasoning_out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.styled = is_styled(self.out)
        self.reasoning_out = None if self.styled else reasoning_out or sys.stderr
        self.parser = DsmlParser(thinking=thinking)
        self.in_reasoning = False
        self.last_char = "\n"
        self.reasoning_last = "\n"

    def feed(self, text: str) -> None:
        for event in self.parser.feed(text):
            self._show(event)
        self.out.flush()

    def finish(self) -> None:
        for event in self.parser.finish():
            self._show(event)
        self._set_reasoning(False)
        if self.last_char != "\n":
            self._write("\n")
        self.out.flush()

    def _show(self, event: object) -> None:
        if isinstance(event, ReasoningDelta) and self.reasoning_out is not None:
            if event.text:
                self.reasoning_out.write(event.text)
                self.reasoning_last = event.text[-1]
        elif isinstance(event, ReasoningDelta):
            self._set_reasoning(True)
            self._write(event.text)
        elif isinstance(event, ContentDelta):
            self._set_reasoning(False)
            self._write(event.text)
        elif isinstance(event, ToolCallEnd):
            self._set_reasoning(False)
            self._write(f"\n[tool call {event.call.name} {event.call.arguments_json}]\n")

    def _set_reasoning(self, on: bool) -> None:
        if self.reasoning_out is not None and self.reasoning_last != "\n":
            self.reasoning_out.write("\n")  # the reasoning ends its own line on stderr
            self.reasoning_last = "\n"
        if on == self.in_reasoning:
            return
        self.in_reasoning = on
        if on:
            self.out.write(REASONING_STYLE)
        else:
            self.out.write(RESET_STYLE)
            if self.last_char != "\n":
                self._write("\n")  # the answer starts on its own line after the reasoning

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.last_char = text[-1]


class Interrupt:
    """While active, Ctrl+C only raises a flag; generation polls it between tokens and prefill between
    chunks, so the session always stops at a consistent point."""

    def __init__(self) -> None:
        self.requested = False

    def __enter__(self) -> Interrupt:
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self.previous)

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True

    def __call__(self) -> bool:
        return self.requested


def count_bar(label: str, *extra: ProgressColumn, spinner: bool = False) -> Progress:
    """A transient bar on stderr: [a spinner,] `label`, the bar, done/total, the `extra` columns, the
    time elapsed."""
    return Progress(
        *([SpinnerColumn()] if spinner else []),
        TextColumn(label),
        BarColumn(),
        MofNCompleteColumn(),
        *extra,
        TimeElapsedColumn(),
        console=stderr_console,
        transient=True,
    )


@contextmanager
def loading(path: Path) -> Iterator[Callable[[int, int], None]]:
    """A bar over the weights being read while the model loads; yields the `progress` callback."""
    try:
        size = f"{path.stat().st_size / 1e9:.1f} GB"
    except OSError:
        size = "?"
    bar = count_bar(f"loading {path.name} ({size})", spinner=True)
    task = bar.add_task("load", total=None)
    with bar:
        yield lambda done, total: bar.update(task, completed=done, total=total)


class PrefillProgress:
    """A bar that appears once a prefill has run for a second, with tokens done and tokens/s.

    A timer thread shows it, so a long first chunk still gets a bar; `update` is the session's
    `on_chunk` callback.
    """

    def __init__(self, total: int | None = None, label: str = "prefill") -> None:
        self.start = time.perf_counter()
        self.progress = count_bar(label, TextColumn("{task.fields[speed]}"), spinner=True)
        self.task = self.progress.add_task(label, total=total, speed="")
        self.lock = threading.Lock()
        self.shown = False
        self.timer = threading.Timer(PROGRESS_AFTER_S, self._show)
        self.timer.daemon = True

    def __enter__(self) -> PrefillProgress:
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.cancel()
        with self.lock:
            if self.shown:
                self.progress.stop()
            self.shown = True  # a timer that fires late must not start it again

    def _show(self) -> None:
        with self.lock:
            if not self.shown:
                self.shown = True
                self.progress.start()

    def update(self, done: int, total: int) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.progress.update(self.task, completed=done, total=total, speed=f"{done / elapsed:,.0f} tok/s")


@dataclass
class Speed:
    """Tokens and seconds of one kind of work, summed over a run."""

    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def describe(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return f"{self.tokens} tok in {self.seconds:.2f} s ({rate:,.1f} tok/s)"


def summary_line(load_s: float, prefill: Speed, decode: Speed, power: tuple[int, float] | None = None) -> str:
    """The closing line; `power` is (--power percent, seconds spent idle for it)."""
    line = f"load {load_s:.2f} s | prefill {prefill.describe()} | decode {decode.describe()}"
    return line + (f" | power {power[0]}%: idle {power[1]:.2f} s" if power else "")
