"""Prefix reuse: a client resending a longer conversation prefills only the new suffix."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.model.image_spans import ImageSpan, content_ids
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.prompt.render import Prompt, render_conversation
from dwarfstar.sampling import GREEDY
from dwarfstar.session.prefix import (
    MARK_GAP,
    ReusePlan,
    checkpoint_marks,
    image_reuse,
    parts_after,
    plan_reuse,
    prefill_with_reuse,
)
from dwarfstar.session.session import Session
from dwarfstar.tokenizer.specials import Control
from dwarfstar.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "tiny.gguf"
    write_synthetic_model(path, TINY, seed=3)
    return ReferenceModel(open_model(path), qat=False), Tokenizer.from_gguf(path)


def test_second_turn_prefills_only_the_suffix(setup):
    backend, tok = setup
    session = Session(backend, ctx=2048, chunk=64)
    first = [{"role": "user", "content": "Quel ramo del lago di Como, che volge a mezzogiorno"}]
    plan = prefill_with_reuse(session, render_conversation(first), tok)
    assert plan.match == "none" and session.stats.computed == len(plan.suffix)
    first_len = len(session.tokens)
    reply = tok.decode(list(session.generate(12, GREEDY)))
    cached_len = len(session.tokens)
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "E poi?"}]
    prompt = render_conversation(second)
    before = session.stats.computed
    plan = prefill_with_reuse(session, prompt, tok)
    assert plan.keep >= first_len and plan.suffix
    # cutting back into the cache replays from the last 64-token checkpoint; keeping it all replays nothing
    replayed = 0 if plan.keep == cached_len else plan.keep - plan.keep // 64 * 64
    assert session.stats.computed - before == len(plan.suffix) + replayed
    fresh = Session(backend, ctx=2048, chunk=64)
    fresh.prefill(tok.encode_prompt(prompt.parts))
    assert torch.allclose(session.logits, fresh.logits, rtol=0, atol=1e-5 * fresh.logits.abs().max().item())


def test_text_match_keeps_tokens_that_bpe_would_merge(setup):
    backend, tok = setup
    word = "mezzogiorno"
    merged = tok.encode(word)
    split = [i for ch in word for i in tok.encode(ch)]  # same text, one token per letter
    assert len(split) > len(merged)
    prompt = Prompt((Control("<｜begin▁of▁sentence｜>"), word + " e poi"))
    cached = [tok.bos_id, *split]
    plan = plan_reuse(cached, prompt, tok)
    assert plan.match == "text" and plan.keep == len(cached)
    assert plan.suffix == tok.encode(" e poi")
    # the token match alone would have kept only BOS
    assert plan_reuse(cached[:2] + [tok.bos_id], prompt, tok).keep == 1


def test_cached_image_ids_take_the_token_match_only(setup):
    _, tok = setup
    prompt = Prompt((Control("<｜begin▁of▁sentence｜>"), "mezzogiorno e poi"))
    block = content_ids(b"image", 4, tok.vocab_size)
    # the text match would decode the cache, which it cannot: image ids have no text
    plan = plan_reuse([tok.bos_id, *block, *tok.encode("mezzogiorno")], prompt, tok)
    assert plan == ReusePlan(1, tok.encode_prompt(prompt.parts)[1:], "tokens")


def test_image_reuse_keeps_a_block_whole_or_not_at_all():
    rows = torch.zeros(4, 8)
    a, b = content_ids(b"a", 4, 1000), content_ids(b"b", 4, 1000)
    ids = [1, 2, *a, 3, 4]
    span = ImageSpan(2, rows)
    # the same image at the same place: the block is kept, nothing is left to place
    assert image_reuse([1, 2, *a, 3, 9], ids, [span]) == (7, [])
    # another image there: the match stops at the block, which is prefilled from its start
    keep, later = image_reuse([1, 2, *b, 3], ids, [span])
    assert keep == 2 and [(s.offset, s.rows) for s in later] == [(0, rows)]
    # a cache that agrees into the block (as a hash collision would) is cut back to its start
    keep, later = image_reuse([1, 2, *a[:2], 7], ids, [span])
    assert keep == 2 and [s.offset for s in later] == [0]


def test_shorter_prompt_truncates(setup):
    backend, tok = setup
    session = Session(backend, ctx=2048, chunk=64)
    long = render_conversation([{"role": "user", "content": "uno due tre quattro cinque sei"}])
    prefill_with_reuse(session, long, tok)
    short = Prompt(long.parts[:2])
    plan = prefill_with_reuse(session, short, tok)
    assert plan.suffix == [] and session.tokens == tok.encode_prompt(short.parts)


def test_parts_after_refuses_cuts_inside_characters_and_controls():
    parts = (Control("<｜User｜>"), "città")
    user = len("<｜User｜>".encode())
    assert parts_after(parts, user) == ["città"]
    assert parts_after(parts, user + 3) == ["tà"]
    assert parts_after(parts, user + 4) == ["à"]
    assert parts_after(parts, user + 5) is None  # inside the two bytes of "à"
    assert parts_after(parts, 2) is None  # inside the control token


def test_a_thinking_turns_next_request_cuts_back_to_a_message_checkpoint_and_replays_nothing(setup):
    backend, tok = setup
    session = Session(backend, ctx=2048, chunk=256)
    first = [{"role": "user", "content": "Quel ramo del lago di Como, che volge a mezzogiorno, " * 4}]
    first_ids = tok.encode_prompt(render_conversation(first, thinking=True).parts)
    assert MARK_GAP <= len(first_ids) - 1 < 256  # a mark after `<｜Assistant｜>`, no chunk checkpoint below it
    prefill_with_reuse(session, render_conversation(first, thinking=True), tok)
    reply = tok.decode(list(session.generate(12, GREEDY)))
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "E poi?"}]
    prompt = render_conversation(second, thinking=True)  # the first turn's `<think>` is closed otherwise
    before = session.stats.computed
    plan = prefill_with_reuse(session, prompt, tok)
    assert plan.keep == len(first_ids) - 1
    assert session.stats.computed - before == len(plan.suffix)  # nothing replayed
    fresh = Session(backend, ctx=2048, chunk=256)
    fresh.prefill(tok.encode_prompt(prompt.parts))
    assert torch.allclose(session.logits, fresh.logits, rtol=0, atol=1e-5 * fresh.logits.abs().max().item())


def test_marks_skip_passes_shorter_than_the_gap_and_always_end_at_the_prompt(setup):
    _, tok = setup
    user, assistant, think = (tok.token_id(t) for t in ("<｜User｜>", "<｜Assistant｜>", "<think>"))
    text = list(range(1000, 1100))
    short = [tok.bos_id, user, *text[:5], assistant, think]
    assert checkpoint_marks(ReusePlan(0, short, "none"), tok) == [9]  # one pass
    turns = [tok.bos_id, *text, user, *text, assistant, *text, user, *text[:50], assistant, think]
    # after the first and the last user token, after the last assistant token, the end
    assert checkpoint_marks(ReusePlan(0, turns, "none"), tok) == [102, 304, 355, 356]
    # cut at 300: the last user message's mark would end a 4-token pass
    assert checkpoint_marks(ReusePlan(300, turns[300:], "none"), tok) == [355, 356]
