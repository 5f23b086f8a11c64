"""Disk-cache restores run on the cache's reader thread: while one request's checkpoint is being read
(held here by a slow reader stand-in), another request's stream goes on decoding."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import httpx2 as httpx
import openai
from conftest import API_KEY, BASE_CONFIG, TOOLS, start_server

NOTHINK = {"think": False}


def held_reads(disk) -> tuple[threading.Event, threading.Event]:
    """Make every checkpoint read wait until `release` is set; `entered` is set when one starts."""
    entered, release = threading.Event(), threading.Event()
    real_lookup = disk.store.lookup

    def lookup(text: bytes):
        entered.set()
        release.wait(timeout=60)
        return real_lookup(text)

    disk.store.lookup = lookup
    return entered, release


def wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_another_stream_decodes_while_a_checkpoint_is_read(engine, tmp_path):
    config = replace(BASE_CONFIG, max_sessions=2, kv_disk_dir=tmp_path / "kv", kv_cache_min_tokens=64)
    messages = [{"role": "user", "content": "Weather in Paris? [[script:weather]]"}]
    first_server = start_server(engine, config)
    server = next(first_server)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    first = client.chat.completions.create(
        model="deepseek-v4-flash", messages=messages, tools=TOOLS, extra_body=NOTHINK
    )
    (call,) = first.choices[0].message.tool_calls
    first_server.close()  # the conversation is saved at shutdown

    second_server = start_server(engine, config)
    server = next(second_server)
    entered, release = held_reads(server.service.disk)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    story = {
        "model": "deepseek-v4-flash",
        "messages": [{"role": "user", "content": "A story. [[script:long_story]]"}],
        "stream": True,
        "think": False,
    }
    chunks: list[str] = []

    def read_story() -> None:
        with httpx.Client(base_url=server.base_url, headers=headers, timeout=120) as http:
            with http.stream("POST", "/v1/chat/completions", json=story) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line)  # seen by the test thread as it arrives

    resumed: list = []
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny"},
    ]

    def resume_weather() -> None:
        resumed.append(
            client.chat.completions.create(
                model="deepseek-v4-flash", messages=messages, tools=TOOLS, max_tokens=2, extra_body=NOTHINK
            )
        )

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    streamer = threading.Thread(target=read_story)
    streamer.start()
    wait_for(lambda: len(chunks) > 3, "the story to start")
    resumer = threading.Thread(target=resume_weather)
    resumer.start()
    assert entered.wait(timeout=60), "the restore never read the checkpoint"
    during = len(chunks)
    wait_for(lambda: len(chunks) >= during + 20, "the story to go on during the read")
    assert not resumed and not release.is_set()  # still reading: the story advanced meanwhile
    release.set()
    resumer.join(timeout=120)
    streamer.join(timeout=120)
    assert chunks[-1] == "data: [DONE]"
    (second,) = resumed
    assert server.metric("dwarfstar_cache_lookups_total", source="disk") == 1
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + 10
    second_server.close()
