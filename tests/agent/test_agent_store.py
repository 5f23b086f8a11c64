"""Saved sessions: KV files in the disk-cache format plus sidecars; listing, loading, strip, delete,
the system prompt's cache, and files that cannot be used (damaged, unreadable, another model's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Recorder, make_agent

from dwarfstar.agent.policy import ScriptedPolicy
from dwarfstar.agent.store import SYSPROMPT, SessionError, SessionStore, session_id
from dwarfstar.engine.load import Engine, load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.kvcache import kvfile
from dwarfstar.kvcache.kvfile import ModelIdentity
from dwarfstar.kvcache.kvpolicy import SaveReason
from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.prompt.efforts import PREVIEW


def open_store(engine: Engine, directory: Path, ctx: int = 8192) -> SessionStore:
    return SessionStore(directory, engine.backend.args, ModelIdentity.of(engine.model), ctx, 4096,
                        engine.tokenizer, engine.backend.new_state)  # fmt: skip


@pytest.fixture
def saved(nano: Engine, tmp_path: Path):
    """A store holding one two-turn session; returns (store, agent, id)."""
    policy = ScriptedPolicy(nano.tokenizer, nano.backend.args.eos_token_id, ["a</think>One.", "b</think>Two."])
    agent = make_agent(nano, tmp_path / "work", policy)
    (tmp_path / "work").mkdir(exist_ok=True)
    agent.run("first   task\nwith lines", Recorder())
    agent.run("second", Recorder())
    store = open_store(nano, tmp_path / "kv")
    sid = session_id("first", 1000.0)
    store.save(sid, 1000.0, agent.transcript, agent.session.state)
    return store, agent, sid


def test_save_list_and_load_back_the_exact_state(saved) -> None:
    store, agent, sid = saved
    [listed] = store.sessions()
    assert (listed.id, listed.title, listed.problem) == (sid, "first task with lines", None)
    assert listed.tokens == len(agent.session.tokens)
    head = kvfile.read_head(store.directory / listed.kv_name)
    assert head.header.reason == SaveReason.AGENT_SESSION
    assert head.key == agent.tokenizer.decode_bytes(agent.session.tokens)  # the server's key: the decoded tokens
    found, transcript, state = store.load(sid[:4])
    assert found.id == sid and transcript.to_json() == agent.transcript.to_json()
    assert state.tokens == agent.session.tokens
    assert state.logits.equal(agent.session.logits)


def test_a_sidecar_saved_before_images_were_kept_loads_as_before(saved) -> None:
    """Older sidecars have no "images", in the sidecar or its entries; they load unchanged."""
    store, agent, sid = saved
    path = store.directory / f"agent-{sid}.json"
    meta = json.loads(path.read_text())
    assert meta.pop("images") == [] and all(e.pop("images") == [] for e in meta["transcript"]["entries"])
    path.write_text(json.dumps(meta))
    [listed] = store.sessions()
    assert listed.problem is None
    _, transcript, state = store.load(sid)
    assert transcript.to_json() == agent.transcript.to_json() and state.tokens == agent.session.tokens
    store.delete(sid)
    assert list(store.directory.iterdir()) == []


def test_an_image_a_sidecar_names_badly_makes_it_unreadable(saved) -> None:
    """An image named by anything but a SHA-256 (a path, say) is never looked for."""
    store, _, sid = saved
    path = store.directory / f"agent-{sid}.json"
    meta = json.loads(path.read_text())
    tools = {"kind": "tools", "results": ["cat.png: image/png, 3 bytes"], "thinking": True}
    ref = {"result": 0, "sha256": "../../etc/passwd", "media_type": "image/png", "where": "cat.png"}
    meta["transcript"]["entries"].append({**tools, "images": [ref]})
    path.write_text(json.dumps(meta))
    [listed] = store.sessions()
    assert (
        listed.problem
        == "unreadable session file (bad transcript: an image named '../../etc/passwd', not by a SHA-256)"
    )
    with pytest.raises(SessionError, match="not by a SHA-256"):
        store.load(sid)


def test_saving_again_replaces_the_old_kv_file(saved) -> None:
    store, agent, sid = saved
    old = store.sessions()[0].kv_name
    agent.policy.replies.append("c</think>Three.")
    agent.run("third", Recorder())
    store.save(sid, 1000.0, agent.transcript, agent.session.state)
    [listed] = store.sessions()
    assert listed.kv_name != old and not (store.directory / old).exists()
    assert sorted(p.name for p in store.directory.iterdir()) == sorted([listed.kv_name, f"agent-{sid}.json"])


def test_strip_keeps_the_text_and_delete_removes_everything(saved) -> None:
    store, agent, sid = saved
    kv = store.directory / store.sessions()[0].kv_name
    stripped = store.strip(sid[:6])
    assert stripped.kv_name is None and stripped.title == "first task with lines" and not kv.exists()
    assert "stripped" in stripped.line(stripped.updated)
    _, transcript, state = store.load(sid)
    assert state is None and transcript.user_turns() == ["first   task\nwith lines", "second"]
    store.delete(sid)
    assert store.sessions() == [] and list(store.directory.iterdir()) == []
    with pytest.raises(SessionError, match="no session"):
        store.load(sid)


def test_the_system_prompt_cache_is_reused_only_for_the_same_prompt(saved) -> None:
    store, agent, _ = saved
    head = agent.transcript.head_ids(agent.tokenizer, PREVIEW)
    assert store.load_system(head) is None
    agent.session.truncate(len(head))
    store.save_system(agent.session.state)
    assert (store.directory / SYSPROMPT).exists() and len(store.sessions()) == 1  # not listed as a session
    assert store.load_system(head).tokens == head
    agent.transcript.system += " changed"
    assert store.load_system(agent.transcript.head_ids(agent.tokenizer, PREVIEW)) is None


def test_unusable_files_are_listed_with_the_reason(saved, tmp_path: Path) -> None:
    store, agent, sid = saved
    kv = store.directory / store.sessions()[0].kv_name
    (store.directory / "agent-0123456789abcdef.json").write_text("{not json")
    kv.write_bytes(kv.read_bytes()[:100])
    listing = {s.id: s for s in store.sessions()}
    assert listing[sid].problem.startswith("KV file: truncated")
    assert listing["0123456789abcdef"].problem.startswith("unreadable session file")
    assert "UNUSABLE: KV file: truncated" in listing[sid].line(0)
    with pytest.raises(SessionError, match="cannot be used: KV file: truncated"):
        store.load(sid)
    with pytest.raises(SessionError, match="give a session id"):
        store.find("")


def test_another_models_session_is_listed_as_foreign(saved, tmp_path: Path) -> None:
    store, _, sid = saved
    path = tmp_path / "tiny.gguf"
    write_synthetic_model(path, TINY, seed=0)
    other = load_engine(EngineSpec(path, "reference", ctx=8192))
    [listed] = open_store(other, store.directory).sessions()
    assert (listed.id, listed.problem) == (sid, "KV file was written for another model")


def test_a_session_is_only_loaded_under_the_steering_it_was_saved_with(saved, nano: Engine) -> None:
    """A state computed with a steering direction differs from one without: a store that runs with
    another setting lists the session as unusable, keeps its own KV files and its own system prompt."""
    store, agent, sid = saved
    tag = "direction 0123456789abcdef ffn 1 attn 0"
    steered = SessionStore(store.directory, store.args, store.identity, store.ctx, store.chunk, store.tokenizer,
                           store.new_state, steering=tag)  # fmt: skip
    [listed] = steered.sessions()
    assert listed.problem == f"saved with steering off; this agent runs with steering {tag}"
    with pytest.raises(SessionError, match="steering"):
        steered.load(sid)
    steered.save("steered1", 1000.0, agent.transcript, agent.session.state)
    names = {s.id: s.kv_name for s in store.sessions()}
    assert names["steered1"] != names[sid]  # the same tokens, another file: the unsteered one stays
    assert [s.problem for s in store.sessions() if s.id == "steered1"] == [
        f"saved with steering {tag}; this agent runs with steering off"
    ]
    steered.save_system(agent.session.state)
    assert store.load_system(agent.session.tokens) is None  # the steered system prompt is not the plain one
    assert steered.load_system(agent.session.tokens) is not None
    assert not (store.directory / SYSPROMPT).exists()
