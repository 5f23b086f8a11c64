"""The bundled nano model calls the right tool when the request asks for thinking, as coding agents'
requests do, and not only with thinking off (`dwarfstar.train.tool_eval --thinking`).

A file trained to reason in one sentence before the call (`train_nano --tool-reasoning`, the recipe
of issue 36's runs 6-8 and 9b) loses this: run 9b's, after 150 steps, called the right tool for 2, 2
and 3 of 10 held-out requests per client shape in thinking mode against 8, 9 and 10 with thinking
off. `DWARFSTAR_TEST_NANO=FILE` checks another file:

    DWARFSTAR_TEST_NANO=build/agent9b/nano.gguf .venv/bin/python -m pytest tests/nano_tools/test_nano_thinking_calls.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dwarfstar.model.bundled import default_model_path
from dwarfstar.train.tool_eval import file_tool_accuracy

CORPUS = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "text" / "promessi_sposi.txt"
pytestmark = pytest.mark.skipif(not CORPUS.exists(), reason="needs ../shared (the corpus)")
REQUESTS = 2  # per client shape


def test_a_thinking_request_gets_the_call_a_plain_one_gets() -> None:
    path = Path(os.environ.get("DWARFSTAR_TEST_NANO") or default_model_path())
    plain, thinking = (file_tool_accuracy(path, REQUESTS, CORPUS, thinking=t) for t in (False, True))
    assert [score.right for _, score in plain] == [REQUESTS] * 3, plain
    assert [score.right for _, score in thinking] == [REQUESTS] * 3, thinking
