"""Streaming detokenization: whole characters only, and the same text as a one-shot decode."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dwarfstar.tokenizer import IncrementalDetokenizer, Tokenizer
from dwarfstar.tokenizer.bytelevel import byte_to_char
from dwarfstar.tokenizer.vocab import bundled_tokenizer_json

VOCAB_SIZE = 129280
no_fixture_reset = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_tokenizer_json(bundled_tokenizer_json(), VOCAB_SIZE)


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_emoji_spread_over_tokens_is_released_whole(tok: Tokenizer) -> None:
    ids = tok.encode("🦜")
    assert len(ids) > 1  # the parrot needs several byte-level tokens
    chunks = stream(tok, ids)
    assert chunks[:-2] == [""] * (len(ids) - 1)
    assert chunks[-2:] == ["🦜", ""]


def test_pending_bytes_and_flush(tok: Tokenizer) -> None:
    first = tok.token_id(byte_to_char()[0xE2])  # the lead byte of a three-byte character, alone
    detok = IncrementalDetokenizer(tok)
    assert detok.push(first) == ""
    assert detok.pending_bytes == tok.token_bytes(first)
    assert detok.flush() == "\ufffd"
    assert detok.pending_bytes == b""


@no_fixture_reset
@given(text=st.text(st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_stream_of_valid_text_never_breaks_characters(text: str, tok: Tokenizer) -> None:
    chunks = stream(tok, tok.encode(text))
    assert "".join(chunks) == text
    assert not any("\ufffd" in chunk for chunk in chunks) or "\ufffd" in text


# Single-byte tokens for every non-ASCII byte: lead bytes, continuation bytes and never-valid bytes.
BYTE_TOKENS = st.sampled_from([byte_to_char()[b] for b in range(0x80, 0x100)])


@no_fixture_reset
@given(data=st.data())
def test_stream_of_arbitrary_ids_equals_one_shot_decode(data: st.DataObject, tok: Tokenizer) -> None:
    pieces = data.draw(st.lists(st.one_of(BYTE_TOKENS.map(tok.token_id), st.integers(0, VOCAB_SIZE - 1)), max_size=40))
    chunks = stream(tok, pieces)
    assert "".join(chunks) == tok.decode(pieces)
    assert tok.decode(pieces) == tok.decode_bytes(pieces).decode("utf-8", errors="replace")


@no_fixture_reset
@given(text=st.text(max_size=40), split=st.integers(0, 40))
def test_push_many_equals_single_pushes(text: str, split: int, tok: Tokenizer) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    grouped = detok.push_many(ids[:split]) + detok.push_many(ids[split:]) + detok.flush()
    assert grouped == "".join(stream(tok, ids))
