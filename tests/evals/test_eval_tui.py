"""The eval TUI's keys (ds4-eval's: Up/Down, Enter, p, q) and the plain printer, with no terminal."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from dwarfstar.evals import BUNDLED_SET
from dwarfstar.evals.eval_trace import read_trace
from dwarfstar.evals.questions import load_questions
from dwarfstar.evals.runner import Stop
from dwarfstar.evals.tui import EvalTui, PlainDisplay

GATES = Path(__file__).resolve().parent.parent / "data" / "gates"


class FakeKeys:
    def __init__(self, *batches: list[str]) -> None:
        self.batches = list(batches)

    def take(self) -> list[str]:
        return self.batches.pop(0) if self.batches else []


@pytest.fixture
def tui():
    console = Console(file=io.StringIO(), width=100, height=30, force_terminal=True)
    return EvalTui(load_questions(BUNDLED_SET, limit=4), "model.gguf", console=console)


def test_enter_switches_to_the_selected_question(tui):
    tui.start(1, 4, tui.questions[0])
    tui.keys = FakeKeys(["down", "down", "up", "down", "enter"])
    with pytest.raises(Stop) as stop:
        tui.check()
    assert stop.value.reason == "switch" and tui.requested == 2
    assert tui.states[0] == "pending"  # the interrupted question runs again later


def test_enter_on_the_running_question_and_bounds(tui):
    tui.start(1, 4, tui.questions[0])
    tui.keys = FakeKeys(["up", "enter"])
    tui.check()  # no switch: it is the running one
    assert tui.selected == 0 and tui.requested is None
    tui.keys = FakeKeys(["down"] * 9)
    tui.check()
    assert tui.selected == 3


def test_pause_waits_for_the_second_p_and_q_quits(tui):
    tui.start(1, 4, tui.questions[0])
    tui.keys = FakeKeys(["p"], [], ["p"])
    tui.check()  # returns only after the second p
    assert not tui.paused and tui.keys.batches == []
    tui.keys = FakeKeys(["q"])
    with pytest.raises(Stop) as stop:
        tui.check()
    assert stop.value.reason == "quit"


def test_screen_shows_states_and_stream(tui):
    _, cases = read_trace(GATES / "nano_eval.trace")
    tui.start(1, 4, tui.questions[0])
    tui.phase("thinking")
    tui.text("ragiono", True)
    tui.finish(cases[0])
    assert tui.states[0] == "failed" and tui.picked[0] == "?"
    assert "ragiono" in tui.stream.plain


def test_plain_display_reports_each_question():
    out = io.StringIO()
    display = PlainDisplay(out)
    _, cases = read_trace(GATES / "nano_eval.trace")
    question = load_questions(GATES / "eval_mixed.jsonl")[0]
    display.start(1, 3, question)
    display.text("pensiero</think>", True)
    display.text("Answer: Q", False)
    display.finish(cases[0])
    text = out.getvalue()
    assert text.startswith("\n[1/3] DwarfStar/Literature Who wrote the novel I promessi sposi?\n")
    assert f"pensiero</think>Answer: Q\nFAIL got ? expected B ({cases[0].elapsed_sec:.1f}s, 48 tokens)\n" in text
