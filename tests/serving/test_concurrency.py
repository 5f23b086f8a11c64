"""Prefix reuse, batched decode of concurrent requests, disconnects, keepalives and the bounded queue."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx2 as httpx
import openai
import pytest
from conftest import API_KEY, BASE_CONFIG, start_server

NOTHINK = {"thinking": {"type": "disabled"}}
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 300  # about 3000 tokens: 12 prefill chunks


def chat(oai, content, **kwargs):
    kwargs.setdefault("extra_body", NOTHINK)
    return oai.chat.completions.create(
        model="deepseek-v4-flash", messages=[{"role": "user", "content": content}], temperature=0, **kwargs
    )


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_second_turn_prefills_only_the_suffix(oai, server):
    messages = [{"role": "user", "content": "Greet me. [[script:hello]]"}]
    first = oai.chat.completions.create(model="deepseek-v4-flash", messages=messages, extra_body=NOTHINK)
    assert first.choices[0].finish_reason == "stop"
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And?"},
    ]
    prefilled = server.metric("dwarfstar_prefill_tokens_total")
    second = oai.chat.completions.create(model="deepseek-v4-flash", messages=messages, max_tokens=2, extra_body=NOTHINK)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the session holds the first prompt and every generated token but the final EOS, which was
    # sampled but never run; the second prompt renders that reply exactly, then EOS and the new turn
    assert cached == first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert server.metric("dwarfstar_prefill_tokens_total") - prefilled == second.usage.prompt_tokens - cached
    assert second.usage.prompt_tokens - cached < 10


def test_conversations_keep_their_own_sessions_and_share_a_prefix_by_copy(oai, server):
    system = {"role": "system", "content": "You are a careful agent. " * 60}  # > one 256-token chunk
    main = [system, {"role": "user", "content": "Main task. [[script:hello]]"}]
    forks = server.metric("dwarfstar_cache_lookups_total", source="fork")
    first = oai.chat.completions.create(model="deepseek-v4-flash", messages=main, extra_body=NOTHINK)
    # a subagent with the same system prompt gets a copy of the main session, cut back to the prefix
    sub = oai.chat.completions.create(
        model="deepseek-v4-flash",
        messages=[system, {"role": "user", "content": "Subtask."}],
        max_tokens=2,
        extra_body=NOTHINK,
    )
    assert server.metric("dwarfstar_cache_lookups_total", source="fork") == forks + 1
    assert sub.usage.prompt_tokens_details.cached_tokens >= 256
    # ...and the main conversation's session was not touched: its next turn is a continuation
    main += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Go on."}]
    second = oai.chat.completions.create(model="deepseek-v4-flash", messages=main, max_tokens=2, extra_body=NOTHINK)
    assert (
        second.usage.prompt_tokens_details.cached_tokens
        == first.usage.prompt_tokens + first.usage.completion_tokens - 1
    )


def test_two_conversations_in_parallel_are_batched(oai, server):
    batched = server.metric("dwarfstar_batched_decode_steps_total")
    sampled = server.service.engine.backend.sampled_rows
    calls = len(sampled)
    prompts = ["First conversation, about rivers.", "Second conversation, about mountains."]
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda p: chat(oai, p, max_tokens=30), prompts))
    assert [r.usage.completion_tokens for r in together] == [30, 30]
    assert server.metric("dwarfstar_batched_decode_steps_total") - batched >= 15
    # both requests' tokens of a batched step come from one sampling call (one host sync)
    assert sum(sampled[calls:]) == 60 and sampled[calls:].count(2) >= 15
    # batching does not change what each conversation gets (greedy, same prompt: same reply)
    alone = [chat(oai, p, max_tokens=30) for p in prompts]
    assert [r.choices[0].message.content for r in alone] == [r.choices[0].message.content for r in together]


def test_ten_parallel_clients_all_get_their_own_answer(oai, server):
    with ThreadPoolExecutor(10) as pool:
        replies = list(pool.map(lambda i: chat(oai, f"Client {i} [[script:count{i}]]"), range(10)))
    assert [r.choices[0].message.content for r in replies] == [f"Reply number {i}." for i in range(10)]
    assert all(r.choices[0].finish_reason == "stop" for r in replies)
    assert server.metric("dwarfstar_decode_batch_max") >= 4  # max_sessions requests at once
    assert server.metric("dwarfstar_live_sessions") <= BASE_CONFIG.max_sessions


def test_disconnect_stops_generation(oai, server):
    cancelled = server.metric("dwarfstar_cancelled_requests_total", phase="decode")
    generated = server.metric("dwarfstar_generated_tokens_total")
    stream = chat(oai, "Talk for a long time.", max_tokens=3000, stream=True)
    for _, _chunk in zip(range(5), stream, strict=False):
        pass
    stream.close()
    wait_for(lambda: server.metric("dwarfstar_cancelled_requests_total", phase="decode") == cancelled + 1)
    total = server.metric("dwarfstar_generated_tokens_total")
    assert total - generated < 100  # stopped within a step of noticing, far from 3000
    time.sleep(0.3)
    assert server.metric("dwarfstar_generated_tokens_total") == total
    wait_for(lambda: server.metric("dwarfstar_active_requests") == 0)


def test_disconnect_stops_a_non_streaming_request(server):
    cancelled = server.metric("dwarfstar_cancelled_requests_total", phase="decode")
    # scripted, so the reply lasts until max_tokens: unscripted, the tiny random model's may end within
    # the second, and a full run once got its answer before the client gave up
    body = {"messages": [{"role": "user", "content": "Write a book. [[script:book]]"}], "max_tokens": 3000,
            "thinking": False}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=AUTH, timeout=1.0)
    wait_for(lambda: server.metric("dwarfstar_cancelled_requests_total", phase="decode") == cancelled + 1)
    wait_for(lambda: server.metric("dwarfstar_active_requests") == 0)


def test_disconnect_during_prefill_stops_it(oai, server):
    cancelled = server.metric("dwarfstar_cancelled_requests_total", phase="prefill")
    prefilled = server.metric("dwarfstar_prefill_tokens_total")
    stream = chat(oai, "Summarise: " + LONG_PROMPT, max_tokens=5, stream=True)
    next(iter(stream))  # the role chunk: the request holds a session and its prefill has started
    stream.close()
    wait_for(lambda: server.metric("dwarfstar_cancelled_requests_total", phase="prefill") == cancelled + 1)
    assert server.metric("dwarfstar_prefill_tokens_total") - prefilled < 2000  # of about 3000
    wait_for(lambda: server.metric("dwarfstar_active_requests") == 0)


def test_keepalive_comments_during_a_long_prefill(http):
    body = {
        "model": "deepseek-v4-flash",
        "messages": [{"role": "user", "content": "Once more: " + LONG_PROMPT}],
        "max_tokens": 1,
        "stream": True,
        "thinking": False,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    first_content = next(i for i, line in enumerate(lines) if '"content"' in line and '"role"' not in line)
    assert ": keepalive" in lines[:first_content]
    assert lines[-1] == "data: [DONE]"


@pytest.fixture(scope="module")
def small_server(engine):
    """One session, one queue slot, CORS on, no thinking by default (`--nothink`)."""
    config = replace(BASE_CONFIG, max_sessions=1, max_queue=1, cors=True, think_by_default=False, trace=None)
    yield from start_server(engine, config)


def test_nothink_default_and_per_request_thinking(small_server):
    client = openai.OpenAI(base_url=small_server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    ask = [{"role": "user", "content": "[[script:think_hello]]"}]
    plain = client.chat.completions.create(model="deepseek-v4-flash", messages=ask)
    # no <think> was opened, so the scripted reasoning is plain text, and its `</think>` token, which closes
    # nothing, is no text for the client (output.py)
    assert plain.choices[0].message.content == "A greeting deserves a greeting.Hello!"
    for extra in ({"model": "deepseek-reasoner"}, {"model": "deepseek-v4-flash", "extra_body": {"think": True}}):
        reply = client.chat.completions.create(messages=ask, **extra)
        assert reply.choices[0].message.content == "Hello!"
        assert reply.choices[0].message.reasoning_content == "A greeting deserves a greeting."


def test_cors_headers_and_preflight(small_server):
    preflight = httpx.options(small_server.base_url + "/v1/chat/completions")
    assert preflight.status_code == 204 and preflight.headers["access-control-allow-origin"] == "*"
    health = httpx.get(small_server.base_url + "/health")
    assert health.headers["access-control-allow-methods"] == "GET, POST, OPTIONS"


def test_full_queue_answers_429(small_server):
    client = openai.OpenAI(base_url=small_server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    running = chat(client, "Keep going.", max_tokens=2000, stream=True)
    next(iter(running))
    waiting = chat(client, "Wait your turn.", max_tokens=2000, stream=True)
    wait_for(lambda: small_server.metric("dwarfstar_queue_depth") == 1)
    with pytest.raises(openai.RateLimitError) as err:
        chat(client, "One too many.", max_tokens=1)
    assert err.value.status_code == 429 and err.value.body["code"] == "rate_limit_exceeded"
    running.close()
    next(iter(waiting))  # admitted once the running request was cancelled
    waiting.close()
    wait_for(lambda: small_server.metric("dwarfstar_active_requests") == 0)
    assert chat(client, "Now there is room.", max_tokens=2).choices[0].finish_reason == "length"
