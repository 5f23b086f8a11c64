"""Images in the in-process chat (`run --vision FILE --image PATH`, `/image`): the block sits where the
message's image is, its ids come from the image's bytes, the next turn reuses the KV through it, a
different image at the same place is never taken for it, and bad input is a clear error."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from test_cli_front import cli

from dwarfstar.console.chat import Chat, ThinkMode
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.synthetic import TINY
from dwarfstar.sampling import GREEDY


def picture(path, seed: int, size=(300, 200)):
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model_file, tiny_vision_file):
    return tmp_path_factory.mktemp("chat-images"), tiny_model_file(0), tiny_vision_file


@pytest.fixture(scope="module")
def engine(files):
    _, model, encoder = files
    return load_engine(EngineSpec(model, "reference", ctx=2048, vision=encoder))


def chat(engine) -> Chat:
    return Chat(engine, engine.backend, ctx=2048, system="", mode=ThinkMode.NOTHINK, params=GREEDY, max_tokens=4)


def test_an_image_block_sits_before_the_message_text(engine, files):
    root = files[0]
    talk = chat(engine)
    plain_ids = talk.prompt_ids(pending="What is this?")
    talk.attach(picture(root / "a.png", 1))
    ids, (span,) = talk.prompt(pending="What is this?")
    vocab = engine.tokenizer.vocab_size
    block = ids[span.offset : span.stop]
    assert all(i >= vocab for i in block) and all(i < vocab for i in ids[: span.offset] + ids[span.stop :])
    # the same prompt with the block taken out is the prompt without the image
    assert ids[: span.offset] + ids[span.stop :] == plain_ids
    assert span.rows.shape == (len(block), TINY.dim) and span.attend is not None


def test_the_next_turn_reuses_the_kv_through_the_image(engine, files):
    root = files[0]
    talk = chat(engine)
    talk.attach(picture(root / "a.png", 1))
    first = talk.ask("What is this?")
    second = talk.ask("And the colours?")
    assert second.kept == first.prompt_tokens + len(first.ids) + (first.finish == "stop")
    assert engine.images.encoded >= 1


def test_a_saved_chat_with_an_image_goes_on_as_the_unsaved_one(engine, files, tmp_path):
    """save keeps the image by its digest beside the state; load reads it back, teaches the restored
    state the block's rows, and the next turn reuses as much and replies as the chat never saved."""
    talk = chat(engine)
    talk.attach(picture(files[0] / "a.png", 1))
    talk.ask("What is this?")
    talk.save(tmp_path / "saved")
    unsaved = talk.ask("And the colours?")
    loaded = chat(engine)
    loaded.load(tmp_path / "saved")
    resumed = loaded.ask("And the colours?")
    assert (resumed.kept, resumed.ids) == (unsaved.kept, unsaved.ids) and resumed.kept > loaded.session.images[0].stop
    _, (span,) = loaded.prompt()
    loaded.session.truncate(span.stop + 2)  # a cut behind the block replays it from the learnt rows
    talk.session.truncate(span.stop + 2)
    assert torch.equal(loaded.session.logits, talk.session.logits)


def test_a_saved_chat_whose_image_changed_or_without_vision_is_refused(engine, files, tmp_path):
    talk = chat(engine)
    talk.attach(picture(files[0] / "a.png", 1))
    talk.ask("What is this?")
    talk.save(tmp_path / "saved")
    blind = load_engine(EngineSpec(files[1], "reference", ctx=2048))
    with pytest.raises(DwarfStarError, match="holds images: start with --vision"):
        chat(blind).load(tmp_path / "saved")
    [image] = (tmp_path / "saved.images").iterdir()
    image.write_bytes(image.read_bytes() + b"x")
    with pytest.raises(DwarfStarError, match="was altered"):
        chat(engine).load(tmp_path / "saved")
    image.unlink()
    with pytest.raises(DwarfStarError, match="is missing"):
        chat(engine).load(tmp_path / "saved")


def test_another_image_of_the_same_size_is_not_reused(engine, files):
    root = files[0]
    talk = chat(engine)
    talk.attach(picture(root / "a.png", 1))
    ids_a, spans_a = talk.prompt(pending="Describe.")
    talk.complete(ids_a, False, images=spans_a)
    logits_a = talk.session.logits.clone()
    talk.images = []
    talk.attach(picture(root / "b.png", 2))
    ids_b, spans_b = talk.prompt(pending="Describe.")
    stats = talk.complete(ids_b, False, images=spans_b)
    assert len(ids_a) == len(ids_b) and stats.kept == spans_b[0].offset  # reused up to the block, no further
    talk.session.truncate(len(ids_b))  # back to the prompt's end, through the image block's replay
    fresh = chat(engine)
    fresh.session.prefill(ids_b, images=spans_b)
    assert torch.equal(fresh.session.logits, talk.session.logits)  # the same state as a fresh prefill
    assert not torch.equal(logits_a, fresh.session.logits)  # and the image changed the answer


def test_bad_images_and_text_are_clear_errors(engine, files, tmp_path):
    talk = chat(engine)
    with pytest.raises(DwarfStarError, match="cannot read the image"):
        talk.attach(tmp_path / "missing.png")
    (tmp_path / "notes.txt").write_text("not an image")
    with pytest.raises(DwarfStarError, match="not a PNG, JPEG, WebP or GIF"):
        talk.attach(tmp_path / "notes.txt")
    broken = io.BytesIO()
    Image.new("RGB", (40, 30)).save(broken, format="PNG")
    (tmp_path / "cut.png").write_bytes(broken.getvalue()[:60])
    with pytest.raises(DwarfStarError, match="not a readable image"):
        talk.attach(tmp_path / "cut.png")
    with pytest.raises(DwarfStarError, match="U\\+E000"):
        talk.prompt(pending="a \ue000 b")
    plain = load_engine(EngineSpec(files[1], "reference", ctx=512))
    with pytest.raises(DwarfStarError, match="--vision"):
        chat(plain).attach(files[0] / "a.png")


def test_run_with_an_image(files, monkeypatch, capsys):
    root, model, encoder = files
    image = picture(root / "c.png", 3)
    argv = ["run", "-m", str(model), "--backend", "reference", "--ctx", "2048", "--tokens", "3", "--temp", "0"]
    code, out, err = cli(monkeypatch, capsys, *argv, "--vision", str(encoder), "--image", str(image), "-p", "Hi")
    assert code == 0, err
    assert "prefill" in err
    code, _, err = cli(monkeypatch, capsys, *argv, "--image", str(image), "-p", "Hi")
    assert code == 2 and "--image needs a vision encoder" in err
