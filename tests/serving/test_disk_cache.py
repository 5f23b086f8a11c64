"""The disk KV cache behind the live sessions: evicted conversations come back from disk, with their
tool calls' exact DSML, even across a restart."""

from __future__ import annotations

from dataclasses import replace

import openai
import torch
from conftest import API_KEY, BASE_CONFIG, TOOLS, start_server

from dwarfstar.kvcache.kvpolicy import SaveReason
from dwarfstar.model.state import KVCache, SequenceState, TorchStorage
from dwarfstar.serving.disk import DiskCache
from dwarfstar.serving.pool import LiveSession
from dwarfstar.serving.replay import ToolMemory
from dwarfstar.session.session import Session

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
    # a tiny-model session holds about 1 MB (mostly its next-token logits): a 1 MiB budget keeps one.
    # The first reply is scripted: a sampled one may end inside a UTF-8 character, which the client
    # returns as U+FFFD, so the next turn's text would no longer spell the tokens the file is keyed by.
    config = replace(BASE_CONFIG, kv_memory_mb=1, kv_disk_dir=tmp_path / "kv", kv_cache_min_tokens=64, trace=None)
    running = start_server(engine, config)
    server = next(running)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)

    def ask(messages):
        return client.chat.completions.create(
            model="deepseek-v4-flash", messages=messages, tools=TOOLS, max_tokens=3, extra_body=NOTHINK
        )

    first = [{"role": "user", "content": "First conversation. [[script:hello]]"}]
    reply = ask(first)
    ask([{"role": "user", "content": "Second conversation."}])
    assert len(server.service.pool.live) == 1  # released (and the budget enforced) before the reply
    first += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "user", "content": "More."}]
    again = ask(first)
    assert server.metric("dwarfstar_cache_lookups_total", source="disk") == 1
    assert again.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens
    running.close()


class MetaStates:
    """The engine's backend, keeping its states on the meta device (as a GPU backend keeps them on the GPU)."""

    def __init__(self, inner) -> None:
        self.inner, self.args = inner, inner.args

        self.cache = KVCache(inner.args, inner.args.max_seq_len, TorchStorage("meta"))

    def new_state(self) -> SequenceState:
        return self.cache.new_state()


def state_tensors(state: SequenceState) -> list[torch.Tensor]:
    layers = range(state.cache.args.n_layers)
    tables = [pages.table for pages in state.cache.pages[state.slot[0]].values()]
    return [state.logits, *tables] + [array for il in layers for array in state.parts(il).values()]


def test_a_cache_hit_is_loaded_onto_the_backends_device(engine, tmp_path):
    """A state read from disk goes where the backend keeps its states, not to the CPU."""
    text = "A conversation long enough to be worth a file on disk. " * 4
    session = Session(engine.backend, ctx=4096, chunk=256)
    session.prefill(engine.tokenizer.encode(text))
    opened = dict(space_mb=64, min_tokens=8, ctx=4096, chunk=256, memory=ToolMemory(100))
    saving = DiskCache.open(tmp_path, engine=engine, **opened)
    saving.save(LiveSession(session), SaveReason.COLD)
    saving.flush()  # saves are written by the cache's writer thread

    on_meta = DiskCache.open(tmp_path, engine=replace(engine, backend=MetaStates(engine.backend)), **opened)
    hit = on_meta.restore((text + " And more.").encode(), better_than=0)
    assert hit is not None and hit.tokens == session.tokens
    assert {t.device.type for t in state_tensors(hit)} == {"meta"}
