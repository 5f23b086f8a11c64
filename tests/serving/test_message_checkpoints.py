"""Checkpoints at message starts, through the server: a request that cuts the live KV back inside the
last prompt (a thinking turn's `<think>`, closed otherwise once the client drops the reasoning; a
retried turn) starts from a checkpoint there and replays nothing, as the trace records."""

from __future__ import annotations

# long enough for a mark after `<｜Assistant｜>` (prefix.MARK_GAP), shorter than the server's 256-token chunk
QUESTION = "Say hello, as you would to someone you meet on the shore of the lake. " * 3 + "[[script:think_hello]]"
ASK = dict(model="deepseek-v4-flash", max_tokens=50, extra_body={"think": True})


def test_the_next_thinking_turn_reuses_all_but_the_closed_think_and_replays_nothing(oai, server):
    messages = [{"role": "user", "content": QUESTION}]
    first = oai.chat.completions.create(messages=messages, **ASK)
    assert first.choices[0].message.content == "Hello!"
    messages += [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again. [[script:hello]]"}]
    second = oai.chat.completions.create(messages=messages, **ASK)
    record = server.trace_records()[-1]
    assert record["cache"] == "memory"
    # the server's prefill chunk is 256 tokens: without a checkpoint after `<｜Assistant｜>` the cut
    # would replay the whole first prompt
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1 < 256
    assert record["replayed_tokens"] == 0


def test_a_retried_turn_replays_nothing(oai, server):
    messages = [{"role": "user", "content": "Tell me a story. [[script:long_story]]"}]  # one pass: no mark but the end
    first = oai.chat.completions.create(messages=messages, **{**ASK, "max_tokens": 120})
    retry = oai.chat.completions.create(messages=messages, **{**ASK, "max_tokens": 5})
    record = server.trace_records()[-1]
    assert retry.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert record["replayed_tokens"] == 0
