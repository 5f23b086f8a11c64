"""Requests that wait together are prefilled together: one batched forward over their prompts, so
they start decoding in the same step (that a batched prefill leaves each session as its own does is
tests/test_prefill_batch.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import openai
import pytest
from conftest import API_KEY, BASE_CONFIG, start_server

from dwarfstar.model.forward import forward_then_sample
from dwarfstar.model.state import SequenceState

MODEL = "deepseek-v4-flash"
NOTHINK = {"thinking": {"type": "disabled"}}
HOLD = "[[hold]]"


class HoldsFirstPrefill:
    """Holds the marked request's prefill until `release` is set, so that others queue meanwhile;
    records how many prompts (calls of more than one token per sequence) each forward ran."""

    def __init__(self, inner, tokenizer) -> None:
        self.inner, self.args, self.tokenizer = inner, inner.args, tokenizer
        self.holding, self.release = threading.Event(), threading.Event()
        self.prompts_per_call: list[int] = []

    def new_state(self) -> SequenceState:
        return self.inner.new_state()

    def forward(self, tokens, state, all_logits: bool = True, images=None):
        return self.forward_batch([tokens], [state], all_logits, None if images is None else [images])[0]

    def forward_batch(self, token_lists, states: Sequence[SequenceState], all_logits: bool = False, images=None):
        if any(len(t) > 1 for t in token_lists):
            self.prompts_per_call.append(len(token_lists))
            if HOLD in self.tokenizer.decode(list(token_lists[0])):
                self.holding.set()
                assert self.release.wait(60)
        return self.inner.forward_batch(token_lists, states, all_logits, images=images)

    def sample_batch(self, logits, samplers):
        return self.inner.sample_batch(logits, samplers)

    def decode_sample(self, tokens, states, samplers):
        return forward_then_sample(self, tokens, states, samplers)  # through this double's forward_batch


@pytest.fixture
def held_server(engine):
    held = replace(engine, backend=HoldsFirstPrefill(engine.backend, engine.tokenizer))
    running = start_server(held, replace(BASE_CONFIG, max_sessions=4))
    yield next(running), held.backend
    running.close()


def ask(client: openai.OpenAI, text: str) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], temperature=0, max_tokens=8, extra_body=NOTHINK
    )


def test_queued_prompts_are_prefilled_in_one_call(held_server):
    server, backend = held_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(ask, client, f"Hold this one. {HOLD}")
        assert backend.holding.wait(60)
        calls = len(backend.prompts_per_call)
        together = [pool.submit(ask, client, f"Question {i} about the river Adda.") for i in range(3)]
        deadline = time.monotonic() + 30
        while server.metric("dwarfstar_queue_depth") < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.metric("dwarfstar_queue_depth") == 3
        backend.release.set()
        replies = [f.result(timeout=120) for f in together]
        assert first.result(timeout=120).usage.completion_tokens == 8
    assert [r.usage.completion_tokens for r in replies] == [8, 8, 8]
    assert backend.prompts_per_call[calls:] == [3]  # the three waiting prompts: one forward
