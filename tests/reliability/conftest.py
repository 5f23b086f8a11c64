"""The server on the tiny random model for the HTTP fuzzing (in process, no sockets) and the soak (a
live uvicorn), built with the serving tests' own helpers (tests/serving/conftest.py), loaded here by
path since test dirs are not packages."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.forward import forward_then_sample
from dwarfstar.serving.app import create_app
from dwarfstar.serving.service import Service

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
    return serving.load_engine(EngineSpec(path, "reference", ctx=4096))


# The fuzzing checks the HTTP layer, not the model: one layer of the tiny model prefills its valid
# requests several times faster than six, and every generation ends at its first token (EndsAtOnce),
# where a fuzzed max_tokens would otherwise let one run to the end of the context.
FUZZ_MODEL = serving.TINY.with_(n_layers=1, n_hash_layers=1, compress_ratios=serving.TINY.compress_ratios[:1])


class EndsAtOnce:
    """A backend whose every next token is the end-of-sentence token, by a lead of 60 in its logit."""

    def __init__(self, inner, eos_id: int) -> None:
        self.inner, self.eos_id = inner, eos_id

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def forward(self, tokens, state, all_logits: bool = True, images=None):
        out = self.inner.forward(tokens, state, all_logits, images=images)
        self._end(state)
        return out

    def forward_batch(self, token_lists, states, all_logits: bool = False, images=None):
        out = self.inner.forward_batch(token_lists, states, all_logits, images=images)
        for state in states:
            self._end(state)
        return out

    def decode_sample(self, tokens, states, samplers):
        return forward_then_sample(self, tokens, states, samplers)  # through this double's forward_batch

    def _end(self, state) -> None:
        logits = state.logits.clone()
        logits[self.eos_id] = logits.max() + 60.0
        state.logits = logits


@pytest.fixture(scope="module")
def fuzz_app(tmp_path_factory) -> Iterator[tuple[TestClient, Service]]:
    """An in-process client of the app (ASGI calls, no sockets: about ten times the requests per
    second of a loopback uvicorn) and its service; server exceptions are raised, not hidden in a 500."""
    path = tmp_path_factory.mktemp("model") / "fuzz.gguf"
    serving.write_synthetic_model(path, FUZZ_MODEL, seed=0)
    engine = serving.load_engine(EngineSpec(path, "reference", ctx=FUZZ_CONFIG.ctx))
    engine.backend = EndsAtOnce(engine.backend, engine.tokenizer.eos_id)
    service = Service(engine, FUZZ_CONFIG)
    headers = {"Authorization": f"Bearer {serving.API_KEY}", "Content-Type": "application/json"}
    with TestClient(create_app(service), base_url="http://fuzz", headers=headers) as client:
        yield client, service
