"""The live sessions and the tool memory are bounded by default."""

from __future__ import annotations

from dataclasses import replace

from conftest import BASE_CONFIG

from dwarfstar.serving.config import ServerConfig, physical_memory_bytes
from dwarfstar.serving.replay import ToolMemory
from dwarfstar.serving.service import Service


def test_the_session_budget_defaults_to_a_share_of_the_machine(engine):
    assert ServerConfig().kv_memory_mb is None
    budget = Service(engine, BASE_CONFIG).pool.memory_bytes
    assert 0 < budget < physical_memory_bytes()
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
