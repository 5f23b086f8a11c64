"""`dwarfstar serve` on a DeepSeek V4.1 file (issue 33): the real Starlette app on a loopback uvicorn
over v41-tiny on the reference. It names the model by its family, answers chat completions, reuses a
conversation's prefix from memory and, after a restart, from the disk cache, and a request's
`think_level` reaches the V4.1 prompt."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import httpx2 as httpx
import pytest
from live_server import LiveServer, start_server

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.serving.config import ServerConfig

CTX = 256
CONFIG = ServerConfig(ctx=CTX, max_sessions=2, prefill_chunk=32, kv_cache_min_tokens=8)
MODEL = "deepseek-v4.1-flash"
QUESTION = [{"role": "user", "content": "Name three colours of the sea."}]


@pytest.fixture(scope="module")
def engine(v41_tiny_file):
    return load_engine(EngineSpec(v41_tiny_file, "reference", ctx=CTX))


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory) -> Iterator[LiveServer]:
    yield from start_server(engine, replace(CONFIG, trace=tmp_path_factory.mktemp("trace") / "trace.jsonl"))


@pytest.fixture(scope="module")
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def chat(http: httpx.Client, messages: list[dict], **fields) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0, **fields}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_model_is_named_by_its_family(http):
    (model,) = http.get("/v1/models").json()["data"]
    assert (model["id"], model["name"], model["context_length"]) == (MODEL, "DeepSeek V4.1 Flash", CTX)
    assert http.get("/health").json() == {"status": "ok", "model": MODEL, "backend": "reference"}
    assert http.get("/v1/models/deepseek-v4-flash").status_code == 200  # clients set up for V4 still reach it


def test_a_conversation_reuses_its_prefix_from_memory(http, server):
    first = chat(http, QUESTION, think=False)
    assert first["choices"][0]["finish_reason"] == "length" and first["usage"]["completion_tokens"] == 3
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    reply = first["choices"][0]["message"]
    turn = [*QUESTION, {"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "More."}]
    second = chat(http, turn, think=False)
    usage = second["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    assert server.metric("dwarfstar_cache_lookups_total", source="memory") == 1
    assert server.metric("dwarfstar_cached_tokens_total") == usage["prompt_tokens_details"]["cached_tokens"]


def test_a_think_level_reaches_the_v41_prompt(http, server):
    thinking = chat(http, [{"role": "user", "content": "Why is the sky blue?"}], think_level=30)
    assert thinking["choices"][0]["message"].get("reasoning_content")  # the answer starts in its reasoning
    plain = chat(http, [{"role": "user", "content": "Why is the sea blue?"}], think_level=0)
    assert not plain["choices"][0]["message"].get("reasoning_content")
    prompts = [record["prompt"] for record in server.trace_records()[-2:]]
    # V4.1's think level preamble (ds4's `--think-level`), only where the request thinks
    assert "Reasoning Effort: 30 (range 1-100" in prompts[0] and prompts[0].endswith("<think>")
    assert "Reasoning Effort" not in prompts[1] and prompts[1].endswith("</think>")


def test_a_restarted_server_restores_the_conversation_from_the_disk_cache(engine, tmp_path):
    config = replace(CONFIG, kv_disk_dir=tmp_path)
    first_server = start_server(engine, config)
    with httpx.Client(base_url=next(first_server).base_url, timeout=120) as client:
        first = chat(client, QUESTION, think=False)
    first_server.close()  # saves every live session at shutdown (and the prompt's cold save point before)
    assert list(tmp_path.glob("*.kv"))

    second_server = start_server(engine, config)
    server = next(second_server)
    reply = first["choices"][0]["message"]["content"]
    turn = [*QUESTION, {"role": "assistant", "content": reply}, {"role": "user", "content": "More."}]
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        second = chat(client, turn, think=False)
    assert server.metric("dwarfstar_cache_lookups_total", source="disk") == 1
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    second_server.close()
