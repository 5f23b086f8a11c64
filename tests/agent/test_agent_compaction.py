"""Compaction on the real engine: the bundled model writes the summary itself (sampled at temperature 0,
not scripted), after a soft trigger and after a hard one. What must hold, whatever the nano model's prose:
the summary is the text it streamed, the session shrinks and renders exactly from the rebuilt transcript,
and the compacted session saves, lists and switches back with no prefill and the same next reply.

The system prompt alone is about 1500 tokens, so the context is 2048; the summary budget is cut to
SUMMARY_TOKENS and the hard reserve to HARD_RESERVE so the reference backend's decode stays short.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import Recorder, make_agent, reply

from dwarfstar.agent import compaction
from dwarfstar.agent.loop import Agent
from dwarfstar.agent.policy import Policy, SampledPolicy, ScriptedPolicy
from dwarfstar.agent.store import SessionStore
from dwarfstar.agent.transcript import SUMMARY_HEADING, TITLE_CHARS
from dwarfstar.agent.worker import Worker
from dwarfstar.engine.load import Engine
from dwarfstar.kvcache.kvfile import ModelIdentity
from dwarfstar.prompt.dsml import BLOCK_OPEN
from dwarfstar.sampling import SamplingParams
from dwarfstar.session.session import Session

CTX = 2048
SUMMARY_TOKENS = 24
HARD_RESERVE = 128
REPLY_TOKENS = 8
NO_SUMMARY = "(the model wrote no summary)"


class ModelOrScript(Policy):
    """Scripted replies where the nano model cannot do the part (calling a tool); None: the model replies."""

    def __init__(self, engine: Engine, replies: list[str | None]) -> None:
        eos = engine.backend.args.eos_token_id
        self.model = SampledPolicy(SamplingParams(temperature=0), eos)
        self.script = ScriptedPolicy(engine.tokenizer, eos, [r for r in replies if r is not None])
        self.plan = list(replies)

    def reply(self, session: Session, max_tokens: int, should_stop: Callable[[], bool], guard=None) -> Iterator[int]:
        if self.plan and self.plan.pop(0) is not None:  # a script is not held to the model's -n
            return self.script.reply(session, session.ctx - len(session.tokens), should_stop)
        return self.model.reply(session, max_tokens, should_stop, guard)


@pytest.fixture(autouse=True)
def small_compaction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compaction, "SUMMARY_TOKENS", SUMMARY_TOKENS)
    monkeypatch.setattr(compaction, "HARD_RESERVE", HARD_RESERVE)


def build(nano: Engine, root: Path, replies: list[str | None]) -> Agent:
    agent = make_agent(nano, root, ModelOrScript(nano, replies), ctx=CTX)
    agent.max_tokens = REPLY_TOKENS
    return agent


def filler(tokens: int) -> str:
    """User text of about `tokens` tokens."""
    return " ".join(f"nota {n}." for n in range(tokens // 4))


def summary_events(events: Recorder) -> list[tuple[str, object]]:
    """What the loop reported from the COMPACTING announcement to the end of the summary reply."""
    at = next(i for i, (k, p) in enumerate(events.log) if k == "status" and str(p).startswith("COMPACTING"))
    end = next(i for i, (k, _) in enumerate(events.log) if i > at and k == "reply_end")
    return events.log[at:end]


def assert_summary_streamed(agent: Agent, events: Recorder) -> None:
    """The summary is what the model wrote (shown as it streamed), written without reasoning."""
    during = summary_events(events)
    assert not [k for k, _ in during if k == "reasoning"]
    text = "".join(str(p) for k, p in during if k == "content").split(BLOCK_OPEN)[0].strip()
    assert agent.transcript.summary == (text or NO_SUMMARY)


def assert_well_formed(agent: Agent) -> None:
    """The session holds exactly the rebuilt transcript: system + summary, then a tail opening a turn."""
    rendered, held = agent.transcript_ids(), agent.session.tokens
    assert held == rendered or held + [agent.eos] == rendered  # a reply cut at -n has no EOS in the session yet
    text = agent.tokenizer.decode(agent.session.tokens)
    assert f"{SUMMARY_HEADING}\n\n{agent.transcript.summary}" in text
    assert compaction.SUMMARY_REQUEST not in text  # the request and its reply are gone
    kinds = [e.kind for e in agent.transcript.entries]
    assert kinds[0] in ("user", "tools") and kinds[-1] == "assistant"
    assert all(a != b for a, b in zip(kinds, kinds[1:], strict=False))  # turns alternate


def save_and_switch_back(nano: Engine, agent: Agent, root: Path, kv: Path, title: str) -> None:
    """Save the compacted session, list it, switch to it from a fresh agent: no prefill, same next reply."""
    store = SessionStore(kv, nano.backend.args, ModelIdentity.of(nano.model), CTX, agent.session.chunk,
                         nano.tokenizer, nano.backend.new_state)  # fmt: skip
    worker = Worker(agent, store, Recorder())
    try:
        worker.identity.id, worker.identity.created = "c0ffee0000000001", 1000.0
        saved = worker.call(worker.save)
    finally:
        worker.close()
    [listed] = store.sessions()
    assert (listed.id, listed.tokens, listed.problem) == (saved.id, len(agent.session.tokens), None)
    assert listed.title == title  # the first prompt, even when compaction dropped its turn
    fresh = build(nano, root, [None])
    other = Worker(fresh, store, Recorder())
    try:
        _, prefilled = other.call(lambda: other.switch(saved.id[:6]))
        assert prefilled == 0 and fresh.session.tokens == agent.session.tokens
        assert fresh.transcript.to_json() == agent.transcript.to_json()
        agent.policy.plan.append(None)
        other.submit("e poi?")
        other.wait_idle()
        agent.run("e poi?", Recorder())
    finally:
        other.close()
    # the same next turn (a compaction included, when the context is still past the soft limit)
    assert fresh.transcript.to_json() == agent.transcript.to_json()
    assert fresh.session.tokens == agent.session.tokens


def test_soft_compaction_with_the_model_writing_the_summary(nano: Engine, tmp_path: Path) -> None:
    agent = build(nano, tmp_path, [None, None, None])
    first = filler(260)  # longer than the tail keeps (10% of CTX)
    agent.run(first, Recorder())
    before = len(agent.session.tokens)
    assert compaction.soft_due(before, CTX)
    events = Recorder()
    result = agent.run("e adesso?", events)
    assert result.finish in ("stop", "length")
    statuses = [s for s in events.of("status") if "COMPACT" in s]
    assert statuses[0] == f"COMPACTING (soft: {before}/{CTX} tokens)"
    assert_summary_streamed(agent, events)
    # the long first turn did not fit in the tail: the rebuilt context is the summary and the new turn
    assert [e.text for e in agent.transcript.entries if e.kind == "user"] == ["e adesso?"]
    assert_well_formed(agent)
    assert len(agent.session.tokens) < before
    summary = agent.transcript.summary
    assert compaction.soft_due(len(agent.session.tokens), CTX)  # the system prompt alone is most of CTX
    save_and_switch_back(nano, agent, tmp_path, tmp_path / "kv", title=first[:TITLE_CHARS])
    # the next turn did not compact again: the whole conversation fit in the tail, nothing to free
    assert agent.transcript.summary == summary
    assert [e.text for e in agent.transcript.entries if e.kind == "user"] == ["e adesso?", "e poi?"]


def test_hard_compaction_with_the_model_writing_the_summary(nano: Engine, tmp_path: Path) -> None:
    (tmp_path / "big.txt").write_text("parola " * 75)  # 150 tokens: they fit only once the context is compacted
    agent = build(nano, tmp_path, [reply("t", "Reading.", ("bash", {"command": "cat big.txt"})), None, None])
    events = Recorder()
    first = filler(300)
    result = agent.run(first, events)
    assert (result.finish in ("stop", "length"), result.rounds) == (True, 1)
    [compacting] = [s for s in events.of("status") if s.startswith("COMPACTING")]
    assert compacting.startswith("COMPACTING (hard: ")
    assert_summary_streamed(agent, events)
    tools = agent.transcript.entries[0]
    assert tools.kind == "tools" and tools.results[0].endswith("\n" + "parola " * 75)  # the result, not an error
    assert_well_formed(agent)
    assert len(agent.session.tokens) < CTX - HARD_RESERVE
    save_and_switch_back(nano, agent, tmp_path, tmp_path / "kv", title=first[:TITLE_CHARS])
