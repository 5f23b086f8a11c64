"""One request's failure in the engine fails that request only: the others in the same decode batch
finish with exactly the text they get when run alone."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace

import openai
import pytest
from conftest import API_KEY, BASE_CONFIG, start_server

from dwarfstar.model.forward import forward_then_sample
from dwarfstar.model.state import SequenceState

MODEL = "deepseek-v4-flash"
NOTHINK = {"thinking": {"type": "disabled"}}
MARK = "[[late-fail]]"


class FailsAfterWriting:
    """Runs the real batched step, then raises for every batch holding the marked request from its
    third decode step on: every state in that batch has been written, as by a forward failing midway."""

    def __init__(self, inner, tokenizer) -> None:
        self.inner, self.args, self.tokenizer = inner, inner.args, tokenizer
        self.marked_steps = 0  # batches that held the marked request; from the third on, each fails

    def new_state(self) -> SequenceState:
        return self.inner.new_state()

    def forward(self, tokens, state, all_logits: bool = True, images=None):
        return self.inner.forward(tokens, state, all_logits, images=images)

    def forward_batch(self, token_lists, states: Sequence[SequenceState], all_logits: bool = False, images=None):
        out = self.inner.forward_batch(token_lists, states, all_logits, images=images)
        if any(MARK in self.tokenizer.decode(state.tokens) for state in states):
            self.marked_steps += 1
            if self.marked_steps >= 3:
                raise RuntimeError("injected failure after the states were written")
        return out

    def sample_batch(self, logits, samplers):
        return self.inner.sample_batch(logits, samplers)

    def decode_sample(self, tokens, states, samplers):
        return forward_then_sample(self, tokens, states, samplers)  # through this double's forward_batch


@pytest.fixture
def faulty_server(engine, tmp_path):
    faulty = replace(engine, backend=FailsAfterWriting(engine.backend, engine.tokenizer))
    running = start_server(faulty, replace(BASE_CONFIG, max_sessions=4))
    yield next(running)
    running.close()


def ask(client: openai.OpenAI, text: str, max_tokens: int) -> str:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        temperature=0,
        max_tokens=max_tokens,
        extra_body=NOTHINK,
    )
    return reply.choices[0].message.content


def test_a_failing_request_does_not_fail_its_batch(faulty_server):
    client = openai.OpenAI(base_url=faulty_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    prompts = [f"Conversation {i} about the lake." for i in range(3)]
    alone = [ask(client, prompt, 24) for prompt in prompts]
    batched_before = faulty_server.metric("dwarfstar_batched_decode_steps_total")

    results: dict[str, object] = {}

    def run(key: str, text: str, max_tokens: int) -> None:
        try:
            results[key] = ask(client, text, max_tokens)
        except openai.APIError as exc:
            results[key] = exc

    threads = [threading.Thread(target=run, args=(f"good{i}", p, 24)) for i, p in enumerate(prompts)]
    threads.append(threading.Thread(target=run, args=("bad", f"This one breaks. {MARK}", 24)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert faulty_server.metric("dwarfstar_batched_decode_steps_total") > batched_before  # they shared batches
    assert isinstance(results["bad"], openai.APIError) and "injected failure" in str(results["bad"])
    assert [results[f"good{i}"] for i in range(3)] == alone
    assert faulty_server.metric("dwarfstar_failed_requests_total") == 1
    assert ask(client, prompts[0], 24) == alone[0]  # and the server serves on
