"""Prefix reuse for DeepSeek V4.1 sessions (issue 33): the server's session pool continues or forks a
live session, and restores a conversation from the disk cache (DS41 payloads in KVC files), each giving
the logits of a cold prefill; a V4 cache opened on the same directory refuses the V4.1 files and
keeps them."""

from __future__ import annotations

import functools

import pytest
import torch

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.kvcache.kvfile import ModelIdentity
from dwarfstar.kvcache.kvpolicy import KVCacheOptions, SaveReason
from dwarfstar.kvcache.kvstore import KVStore, tokens_key
from dwarfstar.model.config import V41
from dwarfstar.model.synthetic import TINY
from dwarfstar.prompt.render import render_conversation
from dwarfstar.prompt.render_options import RenderOptions
from dwarfstar.serving.disk import DiskCache
from dwarfstar.serving.pool import SessionPool
from dwarfstar.serving.replay import ToolMemory

CTX, CHUNK = 256, 16
OPTIONS = RenderOptions(efforts=V41)


@pytest.fixture(scope="module")
def engine(v41_tiny_file):
    return load_engine(EngineSpec(v41_tiny_file, "reference", ctx=CTX))


def prompt_of(*texts: str):
    """A conversation of user turns (answered "ok") rendered for V4.1 without thinking."""
    messages = []
    for text in texts:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
    return render_conversation(messages[:-1], options=OPTIONS)


def cold(engine, ids: list[int]) -> torch.Tensor:
    return engine.backend.forward(ids, engine.backend.new_state(), all_logits=False)[0]


def serve(pool: SessionPool, engine, prompt) -> tuple[str, int, torch.Tensor]:
    """One request's prefill through the pool: where its session came from, the tokens kept, the logits."""
    ids = engine.tokenizer.encode_prompt(prompt.parts)
    lease = pool.acquire(prompt, ids)
    lease.session.prefill(lease.plan.suffix)
    pool.release(lease, len(ids))
    return lease.source, lease.plan.keep, lease.session.logits


def test_the_pool_continues_and_forks_live_v41_sessions(engine):
    pool = SessionPool(engine.backend, engine.tokenizer, ctx=CTX, chunk=CHUNK, max_sessions=2)
    first = prompt_of("Tell me about the weather in Paris today, please.")
    source, keep, logits = serve(pool, engine, first)
    assert (source, keep) == ("cold", 0)
    longer = prompt_of("Tell me about the weather in Paris today, please.", "And tomorrow?")
    ids = engine.tokenizer.encode_prompt(longer.parts)
    source, keep, logits = serve(pool, engine, longer)
    held = len(engine.tokenizer.encode_prompt(first.parts))
    assert source == "memory" and keep == held and torch.equal(logits, cold(engine, ids))
    other = prompt_of("Tell me about the weather in Paris today, please.", "And in Rome?")
    source, keep, logits = serve(pool, engine, other)  # another conversation of the same start
    assert source == "fork" and keep >= CHUNK
    assert torch.equal(logits, cold(engine, engine.tokenizer.encode_prompt(other.parts)))


def test_a_conversation_comes_back_from_the_disk_cache_as_a_cold_prefill(engine, tmp_path):
    def open_disk() -> DiskCache:
        return DiskCache.open(
            tmp_path, space_mb=64, min_tokens=8, engine=engine, ctx=CTX, chunk=CHUNK, memory=ToolMemory(16)
        )

    disk = open_disk()
    pool = SessionPool(engine.backend, engine.tokenizer, ctx=CTX, chunk=CHUNK, max_sessions=2, disk=disk)
    first = prompt_of("Summarise the plot of a short story about a lighthouse.")
    serve(pool, engine, first)
    pool.save_all()  # as the server does at shutdown
    disk.close()
    assert len(list(tmp_path.glob("*.kv"))) == 1

    disk = open_disk()  # a restarted server: nothing in memory
    pool = SessionPool(engine.backend, engine.tokenizer, ctx=CTX, chunk=CHUNK, max_sessions=2, disk=disk)
    later = prompt_of("Summarise the plot of a short story about a lighthouse.", "Shorter.")
    source, keep, logits = serve(pool, engine, later)
    disk.close()
    assert source == "disk" and keep == len(engine.tokenizer.encode_prompt(first.parts))
    assert torch.equal(logits, cold(engine, engine.tokenizer.encode_prompt(later.parts)))


def test_a_v4_cache_refuses_v41_files_and_keeps_them(engine, tmp_path):
    identity = ModelIdentity.of(engine.model)
    key = functools.partial(tokens_key, engine.tokenizer.decode_bytes, engine.tokenizer.vocab_size)
    options = KVCacheOptions(min_tokens=8)
    mine = KVStore(tmp_path, engine.backend.args, identity, CTX, CHUNK, key, options, engine.backend.new_state)
    state = engine.backend.new_state()
    engine.backend.forward(list(range(100, 120)), state, all_logits=False)
    path = mine.save(state, SaveReason.COLD)
    assert path is not None
    v4 = KVStore(tmp_path, TINY, identity, CTX, CHUNK, key, options)  # even under the same fingerprint
    (entry,) = v4.entries()
    assert entry.refusal == "a DeepSeek V4.1 Flash payload cannot load into a DeepSeek V4 model"
    assert v4.lookup(key(state.tokens)) is None and path.exists()
    hit = mine.lookup(key(state.tokens) + b" and more")
    assert hit is not None and hit.state.tokens == state.tokens
    bare = KVStore(tmp_path, engine.backend.args, identity, CTX, CHUNK, key, options)  # host states of its own
    assert torch.equal(bare.lookup(key(state.tokens)).state.rows[6], state.rows[6])
    assert torch.equal(engine.backend.forward([7], hit.state)[0], engine.backend.forward([7], state)[0])
