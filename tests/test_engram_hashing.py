"""V4.1's Engram row ids (dwarfstar/engram/hashing.py) against the published facts: the compressed
vocabulary's size (99,092, config.json's `engram_compressed_vocab_size`), the tables' row counts
(384,006,168 and 384,016,682, ds4's GGUF), the multipliers the reference draws, and row ids worked out
independently from the specification (shared/spec/RELEASES_2026.md), with image positions and prefill
split anywhere."""

from __future__ import annotations

import numpy as np
import pytest

from dwarfstar.engram.hashing import (
    COLUMNS,
    EngramHash,
    compressed_token_map,
    engram_multipliers,
    engram_primes,
)
from dwarfstar.model.bundled import default_model_path
from dwarfstar.tokenizer.tokenizer import Tokenizer

LAYERS = (1, 14)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def engram(tokenizer) -> EngramHash:
    token_map = compressed_token_map(tokenizer)
    size = int(token_map.max()) + 1
    return EngramHash(token_map, {L: engram_multipliers(L, size) for L in LAYERS}, engram_primes(LAYERS))


def test_the_compressed_vocabulary_is_v41s(tokenizer, engram):
    token_map = engram.token_map
    assert token_map.shape == (129280,) and int(token_map.max()) + 1 == 99092
    assert engram.pad == 2 and list(token_map[:3]) == [0, 1, 2]
    same = {int(token_map[tokenizer.encode(text)[0]]) for text in (" The", "the", "THE", " the")}
    spaces = {int(token_map[tokenizer.encode(text)[0]]) for text in (" ", "  ", "\n")}
    assert len(same) == 1 and len(spaces) == 1 and same != spaces
    # ids are numbered by first appearance: each new compressed id is one more than the largest before it
    firsts = np.maximum.accumulate(token_map.astype(np.int64))
    assert (np.diff(firsts) <= 1).all()


def test_the_primes_make_ds4s_table_sizes():
    primes = engram_primes(LAYERS)
    assert [int(primes[L].sum()) for L in LAYERS] == [384_006_168, 384_016_682]
    every = np.concatenate([primes[L] for L in LAYERS])
    assert len(set(every.tolist())) == 48 and (every > 16_000_000).all()
    assert all(all(int(p) % d for d in range(2, int(p**0.5) + 1)) for p in every)  # each is prime
    assert primes[1][:3].tolist() == [16000057, 16000079, 16000081] and primes[1].max() < primes[14].min()


def test_the_multipliers_are_the_references_draws(engram):
    assert engram.multipliers[1].tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert engram.multipliers[14].tolist() == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    for m in engram.multipliers.values():
        assert (m % 2 == 1).all() and (m < (2**63 - 1) // 99092).all()  # odd, and id * m fits in int64


def test_row_ids_of_a_worked_example(engram):
    """'<bos>The world.' ([0, 671, 2058, 16], compressed [0, 237, 1751, 16]): rows computed by hand from the
    specification with the real constants (the research note's worked example)."""
    tokens = [0, 671, 2058, 16]
    assert engram.token_map[tokens].tolist() == [0, 237, 1751, 16]
    one, fourteen = engram.rows(1, tokens), engram.rows(14, tokens)
    assert one.shape == (4, COLUMNS)
    assert one[0, :3].tolist() == [5702652, 24393184, 39183301] and one[0, [8, 16]].tolist() == [131476717, 257520185]
    assert one[1, [0, 8, 23]].tolist() == [13754019, 130858473, 377641892]
    assert one[2, [0, 23]].tolist() == [1470853, 377308039]
    assert one[3, [0, 8, 16, 23]].tolist() == [8037296, 134414133, 268591272, 374115734]
    assert fourteen[:, 0].tolist() == [14361964, 6110045, 2651674, 15254499] and fourteen[3, 23] == 370512191
    for layer, rows in ((1, one), (14, fourteen)):  # each column's rows lie in its own range of the table
        start = engram.offsets(layer)
        assert ((rows >= start) & (rows < start + engram.primes[layer])).all()


def test_the_look_back_stops_at_an_image_position(engram, tokenizer):
    image = tokenizer.vocab_size + 5  # an image block's id
    rows = engram.rows(1, [0, 671, image, 16, 19923])
    assert rows[2:, 0].tolist() == [4299726, 9733066, 12279125]
    assert (rows[3] == engram.rows(1, [16])[0]).all()  # after an image, as at the sequence's start


@pytest.mark.parametrize("start", [0, 1, 2, 3, 4, 7, 11])
def test_a_prefill_split_anywhere_looks_up_the_same_rows(engram, tokenizer, start):
    tokens = tokenizer.encode("Quel ramo del lago di Como, che volge a mezzogiorno")
    tokens[5] = tokenizer.vocab_size + 1
    assert (engram.rows(14, tokens, start) == engram.rows(14, tokens)[start:]).all()
