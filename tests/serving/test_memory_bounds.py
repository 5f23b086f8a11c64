"""The live sessions and the tool memory are bounded by default."""

from __future__ import annotations

from dataclasses import replace

import torch
from conftest import BASE_CONFIG

from dwarfstar.backends.registry import host_memory
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.synthetic import TINY
from dwarfstar.serving.config import ServerConfig
from dwarfstar.serving.pool import SessionPool
from dwarfstar.serving.replay import ToolMemory
from dwarfstar.serving.service import Service
from dwarfstar.session.session import Session


def test_the_session_budget_defaults_to_a_share_of_the_machine(engine):
    assert ServerConfig().kv_memory_mb is None
    budget = Service(engine, BASE_CONFIG).pool.memory_bytes
    assert 0 < budget < host_memory()
    assert Service(engine, replace(BASE_CONFIG, kv_memory_mb=0)).pool.memory_bytes == 0  # asked: unbounded
    assert Service(engine, replace(BASE_CONFIG, kv_memory_mb=3)).pool.memory_bytes == 3 << 20


def test_tool_memory_is_capped_in_utf8_bytes():
    memory = ToolMemory(max_ids=100, max_bytes=10)
    memory.remember(["a"], "é" * 3)  # 6 bytes, 3 characters
    memory.remember(["b"], "é" * 2)  # 4 more: exactly at the cap
    assert memory.get("a") == "ééé" and memory.get("b") == "éé"
    memory.remember(["c"], "x")  # 11 bytes: the least recently used goes
    assert memory.get("a") is None and memory.get("b") == "éé" and memory.get("c") == "x"
    memory.remember(["b"], "yy")  # replacing an id counts its new size only
    memory.remember(["d"], "z" * 7)
    assert [memory.get(k) for k in "bcd"] == ["yy", "x", "z" * 7]


def test_the_servers_tool_memory_has_ds4s_byte_cap(engine):
    assert Service(engine, BASE_CONFIG).tool_memory.max_bytes == 512 * 1024 * 1024


def test_a_forked_session_shares_the_prefixs_rows_and_the_budget_counts_them_once(tiny_model_file):
    """A request sharing a long prefix with an idle conversation gets a fork of it (cut back to the
    prefix): below the last checkpoint before the cut, its rows are the conversation's own pages,
    not copies, and the pool's byte count holds them once."""
    engine = load_engine(EngineSpec(tiny_model_file(0), "reference", ctx=4096, kv_slots=2))
    pool = SessionPool(engine.backend, engine.tokenizer, ctx=4096, chunk=256, max_sessions=2)
    ids = torch.randint(3, TINY.vocab_size, (750,), generator=torch.Generator().manual_seed(1)).tolist()
    other = ids[:600] + [7] * 50  # a subagent: the same first 600 tokens, then its own task

    def serve(tokens: list[int]):
        lease = pool.acquire(None, tokens)
        logits = lease.session.prefill(lease.plan.suffix)
        pool.release(lease, len(tokens))
        return lease, logits

    first, _ = serve(ids)
    second, logits = serve(other)
    assert (first.source, second.source) == ("cold", "fork")
    a, b = first.session.state, second.session.state
    # the fork was cut back to 600 tokens from its checkpoint at 512: the ratio-4 rows of tokens
    # 0..511 (pages 0 and 1) are still the conversation's, the rows after them its own
    pages_a, pages_b = (s.row_pages(4).host[s.index][:3] for s in (a, b))
    assert (pages_a[:2] == pages_b[:2]).all() and pages_a[2] != pages_b[2]
    assert (a.row_pages(4).holders[pages_a[:2]] == 2).all()
    held = {(r, int(p)) for r in (4, 128) for s in (a, b) for p in s.row_pages(r).host[s.index] if p >= 0}
    assert a.cache.pages_in_use() == len(held) == 4 + 2  # ratio 128: the one page, rewritten from row 4
    checkpoints = sum(lease.session.nbytes() - lease.session.state.nbytes() for lease in (first, second))
    assert checkpoints > 0 and pool.nbytes() == a.nbytes() + b.nbytes() + checkpoints
    assert b.nbytes() < session_alone(engine, other).state.nbytes()
    cold = Session(engine.backend, ctx=4096, chunk=256)
    torch.testing.assert_close(logits, cold.prefill(other), rtol=1e-5, atol=1e-5)


def session_alone(engine, tokens: list[int]) -> Session:
    """The tokens prefilled in a session of their own (rows not shared with anything)."""
    session = Session(engine.backend, ctx=4096, chunk=256)
    session.prefill(tokens)
    return session
