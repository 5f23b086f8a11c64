"""The agent's view_image tool, on the tiny model with the tiny vision encoder (reference backend) and
scripted replies: offered only with an encoder, the image's block in the prompt after its result's line,
the next turn reusing the KV through it, a path outside the workspace asked for first, every bad
file a tool error the model reads; a session with an image saved and resumed in a new agent (its next
turn reuses the KV through the block and replies as the unsaved one), its saved image altered or
missing a clear error, refused without a vision encoder, and the image file gone with its last session."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import Recorder, reply
from PIL import Image

from dwarfstar.agent.files import Workspace
from dwarfstar.agent.loop import Agent
from dwarfstar.agent.policy import SampledPolicy, ScriptedPolicy
from dwarfstar.agent.store import IMAGES, SessionError, SessionStore
from dwarfstar.agent.tools import Toolbox
from dwarfstar.agent.transcript import Transcript, system_text
from dwarfstar.agent.worker import Worker
from dwarfstar.console.chat import ThinkMode
from dwarfstar.engine.load import Engine, load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError
from dwarfstar.kvcache import kvfile
from dwarfstar.kvcache.kvfile import ModelIdentity
from dwarfstar.kvcache.kvstore import tokens_key
from dwarfstar.model.image_spans import content_ids
from dwarfstar.model.synthetic import VISION_PRESETS, write_synthetic_vision
from dwarfstar.model.vision import VISION_TINY
from dwarfstar.prompt.images import digest
from dwarfstar.sampling import SamplingParams

CTX = 4096


@pytest.fixture(scope="module")
def seeing(tiny_model_file, tmp_path_factory) -> Engine:
    """The tiny model with the tiny vision encoder."""
    encoder = tmp_path_factory.mktemp("agent-vision") / "encoder.gguf"
    write_synthetic_vision(encoder, VISION_TINY, seed=1, router=VISION_PRESETS["vision-tiny"][1])
    return load_engine(EngineSpec(tiny_model_file(0), "reference", ctx=CTX, vision=encoder))


def picture(path: Path, seed: int = 1, size: tuple[int, int] = (60, 40)) -> Path:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format="PNG")
    return path


def agent_on(engine: Engine, root: Path, replies: list[str], vision: bool = True) -> Agent:
    return Agent(
        tokenizer=engine.tokenizer,
        backend=engine.backend,
        ctx=CTX,
        policy=ScriptedPolicy(engine.tokenizer, engine.backend.args.eos_token_id, replies),
        toolbox=Toolbox(Workspace(root), vision=vision),
        transcript=Transcript(system_text(str(root), ""), ThinkMode.THINK),
        max_tokens=256,
        images=engine.images if vision else None,
    )


def view(path: str) -> str:
    return reply("look", "", ("view_image", {"path": path}))


def names(toolbox: Toolbox) -> list[str]:
    return [t["function"]["name"] for t in toolbox.tools]


def test_view_image_is_offered_only_with_a_vision_encoder(seeing: Engine, tmp_path: Path) -> None:
    picture(tmp_path / "cat.png")
    blind = agent_on(seeing, tmp_path, [], vision=False)
    assert "view_image" not in names(blind.toolbox)
    assert '"view_image"' not in seeing.tokenizer.decode(blind.head_ids(blind.transcript))
    # a model that calls it anyway reads why it cannot
    outcome = blind.toolbox.call("view_image", {"path": "cat.png"})
    assert outcome.error and outcome.image is None and "without a vision encoder" in outcome.text
    sighted = agent_on(seeing, tmp_path, [])
    assert names(sighted.toolbox)[-1] == "view_image"
    assert '"view_image"' in seeing.tokenizer.decode(sighted.head_ids(sighted.transcript))
    with pytest.raises(DwarfStarError, match="exactly when the agent has a vision encoder"):
        Agent(
            tokenizer=seeing.tokenizer, backend=seeing.backend, ctx=CTX, policy=sighted.policy,
            toolbox=Toolbox(Workspace(tmp_path), vision=True), transcript=sighted.transcript, max_tokens=8,
        )  # fmt: skip


def test_a_viewed_image_is_in_the_prompt_and_the_next_turn_reuses_it(seeing: Engine, tmp_path: Path) -> None:
    data = picture(tmp_path / "cat.png").read_bytes()
    agent = agent_on(seeing, tmp_path, [view("cat.png"), "seen</think>A cat.", "again</think>Still a cat."])
    events = Recorder()
    first = agent.run("What is in cat.png?", events)
    assert (first.finish, first.rounds) == ("stop", 1)
    (_, outcome), *_ = events.of("tool_end")
    assert not outcome.error and outcome.text == f"cat.png: image/png, {len(data)} bytes"
    tools = agent.transcript.entries[2]
    assert tools.kind == "tools" and tools.images[0].data == data
    # the session ran the block: its ids are the image's, right after the result's line
    (span,) = agent.session.images
    vocab = seeing.tokenizer.vocab_size
    held = list(agent.session.tokens)
    assert held[span.offset : span.stop] == content_ids(digest(data), span.length, vocab)
    assert seeing.tokenizer.decode(held[: span.offset]).endswith(f"{outcome.text}\n")
    assert all(t < vocab for t in held[: span.offset] + held[span.stop :])
    ids, (rendered,) = agent.transcript_prompt()
    assert held == ids and (rendered.offset, rendered.length) == (span.offset, span.length)
    assert rendered.rows.equal(span.rows)
    # the next turn keeps the KV through the block: only the new user turn is computed
    encoded = seeing.images.encoded
    second = agent.run("And now?", Recorder())
    assert second.finish == "stop" and second.reused == len(held) and second.reused > span.stop
    assert second.prefilled == len(agent.transcript_ids()) - len(held) - len(agent.transcript.entries[-1].ids) - 1
    assert seeing.images.encoded == encoded and agent.session.images == [span]


def test_slot_characters_in_other_results_place_no_image(seeing: Engine, tmp_path: Path) -> None:
    picture(tmp_path / "cat.png")
    (tmp_path / "odd.txt").write_text("private \ue0000\ue001 use\n")
    script = reply("look", "", ("read", {"path": "odd.txt"}), ("view_image", {"path": "cat.png"}))
    agent = agent_on(seeing, tmp_path, [script, "ok</think>Done."])
    assert agent.run("look", Recorder()).finish == "stop"
    assert len(agent.session.images) == 1
    vocab = seeing.tokenizer.vocab_size
    text = seeing.tokenizer.decode([t for t in agent.session.tokens if t < vocab])
    assert "private \ufffd0\ufffd use" in text


def test_an_image_outside_the_workspace_is_asked_for(tmp_path: Path) -> None:
    inner = tmp_path / "work"
    inner.mkdir()
    outside = picture(tmp_path / "out.png")
    asked: list[str] = []
    answers = [False, True]
    toolbox = Toolbox(Workspace(inner, confirm=lambda q: asked.append(q) or answers.pop(0)), vision=True)
    refused = toolbox.call("view_image", {"path": "../out.png"})
    assert refused.error and refused.image is None and "refused" in refused.text
    assert asked == [f"the agent wants to view {outside}, outside the workspace {inner}; allow?"]
    allowed = toolbox.call("view_image", {"path": str(outside)})
    assert not allowed.error and allowed.image.data == outside.read_bytes()
    assert allowed.text.startswith(f"{outside}: image/png")
    # without anyone to ask (--plain) it is refused
    plain = Toolbox(Workspace(inner), vision=True).call("view_image", {"path": str(outside)})
    assert plain.error and "outside the workspace" in plain.text
    toolbox.close()


def test_bad_image_files_are_tool_errors_the_model_reads(seeing: Engine, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a picture\n")
    good = picture(tmp_path / "good.png").read_bytes()
    (tmp_path / "broken.png").write_bytes(good[: len(good) // 2])
    (tmp_path / "pics").mkdir()
    paths = ["missing.png", "notes.txt", "broken.png", "pics"]
    script = reply("look", "", *[("view_image", {"path": p}) for p in paths])
    agent = agent_on(seeing, tmp_path, [script, "hm</think>They are unreadable."])
    events = Recorder()
    assert agent.run("look at them", events).finish == "stop"
    outcomes = [outcome for _, outcome in events.of("tool_end")]
    assert all(o.error and o.image is None for o in outcomes)
    texts = [o.text for o in outcomes]
    assert texts[0] == f"error: no such file: {tmp_path / 'missing.png'}"
    assert texts[1] == f"error: {tmp_path / 'notes.txt'} is not a PNG, JPEG, WebP or GIF image"
    assert texts[2].startswith("error: the image/png data is not a readable image")
    assert texts[3] == f"error: {tmp_path / 'pics'} is a directory; use list"
    assert agent.session.images == [] and agent.transcript.images == []
    shown = seeing.tokenizer.decode(agent.session.tokens)
    assert all(text in shown for text in texts)


def open_store(engine: Engine, agent: Agent, directory: Path) -> SessionStore:
    return SessionStore(directory, engine.backend.args, ModelIdentity.of(engine.model), agent.ctx,
                        agent.session.chunk, engine.tokenizer, engine.backend.new_state)  # fmt: skip


def saved_session(engine: Engine, root: Path, store_dir: Path) -> tuple[Agent, SessionStore, str]:
    """An agent that viewed cat.png in one turn, and the store it saved the session in; returns its id."""
    agent = agent_on(engine, root, [view("cat.png"), "seen</think>A cat."])
    store = open_store(engine, agent, store_dir)
    worker = Worker(agent, store, Recorder())
    try:
        worker.submit("look")
        worker.wait_idle()
        assert worker.last_result.finish == "stop"
        saved = worker.call(worker.save)
    finally:
        worker.close()
    return agent, store, saved.id


def greedy(engine: Engine, agent: Agent) -> None:
    agent.policy = SampledPolicy(SamplingParams(temperature=0), engine.backend.args.eos_token_id)
    agent.max_tokens = 12


def test_a_session_with_images_saves_and_resumes_through_its_image(seeing: Engine, tmp_path: Path) -> None:
    data = picture(tmp_path / "cat.png").read_bytes()
    agent, store, sid = saved_session(seeing, tmp_path, tmp_path / "kv")
    # the image is kept once, by the SHA-256 of its bytes; the KV file's key writes its ids apart
    [listed] = store.sessions()
    assert listed.problem is None and listed.tokens == len(agent.session.tokens)
    sha = hashlib.sha256(data).hexdigest()
    assert (store.directory / IMAGES / sha).read_bytes() == data
    head = kvfile.read_head(store.directory / listed.kv_name)
    vocab = seeing.tokenizer.vocab_size
    assert head.key == tokens_key(seeing.tokenizer.decode_bytes, vocab, agent.session.tokens) and b"\xff" in head.key
    # a new agent (a new Session, nothing of the first one's) resumes it from disk
    resumed = agent_on(seeing, tmp_path, [])
    worker = Worker(resumed, store, Recorder())
    try:
        _, prefilled = worker.call(lambda: worker.switch(sid[:6]))
    finally:
        worker.close()
    assert prefilled == 0 and resumed.session.tokens == agent.session.tokens
    assert resumed.transcript.to_json() == agent.transcript.to_json()
    (part,) = resumed.transcript.images
    assert (part.data, part.media_type, part.where) == (data, "image/png", str(tmp_path / "cat.png"))
    (span,), (known,) = agent.session.images, resumed.session.images
    assert (known.offset, known.length) == (span.offset, span.length) and known.rows.equal(span.rows)
    # the next turn reuses everything through the block, and its greedy reply is the unsaved session's
    greedy(seeing, agent)
    greedy(seeing, resumed)
    held = len(agent.session.tokens)
    expected, got = agent.run("And now?", Recorder()), resumed.run("And now?", Recorder())
    assert (got.reused, got.prefilled) == (expected.reused, expected.prefilled) == (held, got.prefilled)
    assert got.prefilled == len(resumed.transcript_ids()) - held - len(resumed.transcript.entries[-1].ids) - 1
    assert resumed.transcript.entries[-1].ids == agent.transcript.entries[-1].ids
    assert resumed.session.tokens == agent.session.tokens
    # a cut behind the block replays it: the resumed session knows its rows
    cut = span.stop + 3
    resumed.session.truncate(cut)
    agent.session.truncate(cut)
    assert resumed.session.tokens == agent.session.tokens[:cut]
    assert torch.allclose(resumed.session.logits, agent.session.logits, atol=1e-4)


def test_a_saved_image_altered_or_missing_is_a_clear_error(seeing: Engine, tmp_path: Path) -> None:
    picture(tmp_path / "cat.png")
    _, store, sid = saved_session(seeing, tmp_path, tmp_path / "kv")
    [path] = (store.directory / IMAGES).iterdir()
    resumed = agent_on(seeing, tmp_path, [])
    worker = Worker(resumed, store, Recorder())
    try:
        path.write_bytes(picture(tmp_path / "dog.png", seed=2).read_bytes())
        [listed] = store.sessions()
        assert listed.problem == f"its image {path} was altered (the SHA-256 of its bytes is not its name)"
        with pytest.raises(SessionError, match=f"cannot be used: its image {path} was altered"):
            worker.call(lambda: worker.switch(sid))
        path.unlink()
        with pytest.raises(SessionError, match=f"cannot be used: its image {path} is missing"):
            worker.call(lambda: worker.switch(sid))
    finally:
        worker.close()
    assert resumed.session.tokens == [] and resumed.transcript.entries == []


def test_an_agent_without_vision_refuses_a_session_with_images(seeing: Engine, tmp_path: Path) -> None:
    picture(tmp_path / "cat.png")
    _, store, sid = saved_session(seeing, tmp_path, tmp_path / "kv")
    blind = agent_on(seeing, tmp_path, [], vision=False)
    worker = Worker(blind, store, Recorder())
    try:
        with pytest.raises(DwarfStarError, match=r"needs a vision encoder \(--vision FILE\)"):
            worker.call(lambda: worker.switch(sid))
        store.strip(sid)  # rebuilt by prefill: refused all the same, before anything changes
        with pytest.raises(DwarfStarError, match=r"needs a vision encoder \(--vision FILE\)"):
            worker.call(lambda: worker.switch(sid))
    finally:
        worker.close()
    assert blind.transcript.entries == [] and worker.identity.id is None


def test_an_image_file_goes_with_the_last_session_naming_it(seeing: Engine, tmp_path: Path) -> None:
    picture(tmp_path / "cat.png")
    _, store, first = saved_session(seeing, tmp_path, tmp_path / "kv")
    _, _, second = saved_session(seeing, tmp_path, tmp_path / "kv")
    assert first != second and len(list((store.directory / IMAGES).iterdir())) == 1
    store.strip(first)  # the text stays, and needs its image
    store.delete(second)
    [path] = (store.directory / IMAGES).iterdir()
    store.delete(first)
    assert not path.exists() and store.sessions() == []
