"""The disk KV cache behind the live sessions: evicted conversations come back from disk, with their
tool calls' exact DSML, even across a restart."""

from __future__ import annotations

from dataclasses import replace

import openai
from conftest import API_KEY, BASE_CONFIG, TOOLS, start_server

NOTHINK = {"thinking": {"type": "disabled"}}


def test_evicted_conversation_resumes_from_disk_after_restart(engine, tmp_path):
    config = replace(
        BASE_CONFIG, max_sessions=1, kv_disk_dir=tmp_path / "kv", kv_cache_min_tokens=64, trace=tmp_path / "t.jsonl"
    )
    first_server = start_server(engine, config)
    server = next(first_server)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris? [[script:weather]]"}]
    first = client.chat.completions.create(
        model="deepseek-v4-flash", messages=messages, tools=TOOLS, extra_body=NOTHINK
    )
    (call,) = first.choices[0].message.tool_calls
    # another conversation takes the only live session: the first one is saved as it goes
    client.chat.completions.create(
        model="deepseek-v4-flash",
        messages=[{"role": "user", "content": "Unrelated."}],
        max_tokens=2,
        extra_body=NOTHINK,
    )
    assert server.metric("dwarfstar_cache_lookups_total", source="cold") == 2
    first_server.close()  # shutdown: the live conversation is saved too
    assert len(list((tmp_path / "kv").glob("*.kv"))) >= 2

    second_server = start_server(engine, config)
    server = next(second_server)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny"},
    ]
    second = client.chat.completions.create(
        model="deepseek-v4-flash", messages=messages, tools=TOOLS, max_tokens=2, extra_body=NOTHINK
    )
    assert server.metric("dwarfstar_cache_lookups_total", source="disk") == 1
    record = server.trace_records()[-1]
    assert record["cache"] == "disk" and record["replayed_tool_ids"] == [call.id]  # the DSML came from the file
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + 10
    second_server.close()


def test_memory_budget_sends_idle_conversations_to_disk(engine, tmp_path):
    # a tiny-model session holds about 1 MB (mostly its next-token logits): a 1 MiB budget keeps one
    config = replace(BASE_CONFIG, kv_memory_mb=1, kv_disk_dir=tmp_path / "kv", kv_cache_min_tokens=64, trace=None)
    running = start_server(engine, config)
    server = next(running)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)

    def ask(messages):
        return client.chat.completions.create(
            model="deepseek-v4-flash", messages=messages, tools=TOOLS, max_tokens=3, extra_body=NOTHINK
        )

    first = [{"role": "user", "content": "First conversation."}]
    reply = ask(first)
    ask([{"role": "user", "content": "Second conversation."}])
    assert len(server.service.pool.live) == 1  # released (and the budget enforced) before the reply
    first += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "More."}]
    again = ask(first)
    assert server.metric("dwarfstar_cache_lookups_total", source="disk") == 1
    assert again.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens
    running.close()
