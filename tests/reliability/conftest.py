"""A live server on the tiny random model for the HTTP fuzzing and the soak, built with the serving
tests' own helpers (tests/serving/conftest.py), loaded here by path since test dirs are not packages."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "serving_conftest", Path(__file__).parents[1] / "serving" / "conftest.py"
)
serving = importlib.util.module_from_spec(_spec)
sys.modules["serving_conftest"] = serving
_spec.loader.exec_module(serving)

# a small context bounds every generation a fuzzed request may start
FUZZ_CONFIG = replace(serving.BASE_CONFIG, ctx=512, max_sessions=2, max_queue=64)


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    serving.write_synthetic_model(path, serving.TINY, seed=0)
    return serving.load_engine(path, "reference", ctx=4096)


@pytest.fixture(scope="module")
def fuzz_server(tiny_engine) -> Iterator:
    yield from serving.start_server(tiny_engine, FUZZ_CONFIG)
