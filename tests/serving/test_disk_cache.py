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
