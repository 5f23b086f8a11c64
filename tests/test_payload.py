"""The DSV4 payload: ds4's published sizes, a byte-exact round trip, and refusal of foreign payloads."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.kvcache.payload import PayloadError, payload_nbytes, read_payload, write_payload
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_synthetic_model

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.mark.parametrize("csv_name", ["m4_max_speed.csv", "m2_ultra_speed.csv"])
def test_sizes_match_ds4_speed_bench(csv_name):
    """ds4's bench reports kvcache_bytes for real Flash sessions; our layout must give the same sizes."""
    rows = list(csv.DictReader(open(SHARED / "fixtures/ds4" / csv_name, encoding="utf-8-sig")))
    assert rows
    flash = ModelArgs.flash()
    for row in rows:
        assert payload_nbytes(flash, int(row["ctx_tokens"])) == int(row["kvcache_bytes"]), row


def test_flash_size_formula():
    flash = ModelArgs.flash()
    for n in (128, 4096, 65536):
        assert payload_nbytes(flash, n) == 23_995_788 + 13_764 * n


@pytest.fixture(scope="module")
def tiny_state(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "tiny.gguf"
    write_synthetic_model(path, TINY, seed=1)
    model = ReferenceModel(open_model(path))
    state = model.new_state()
    model.forward(list(range(1000, 1301)), state, all_logits=False)
    return model, state


def encode(state, ctx=4096, chunk=64) -> bytes:
    buf = io.BytesIO()
    write_payload(buf, state, TINY, ctx, chunk)
    return buf.getvalue()


def test_round_trip_is_byte_exact_and_continues_identically(tiny_state):
    model, state = tiny_state
    data = encode(state)
    assert len(data) == payload_nbytes(TINY, 301)
    loaded = read_payload(data, TINY, 4096, 64, model.new_state)
    assert encode(loaded) == data
    a = model.forward([5, 6, 7], loaded)
    b = model.forward([5, 6, 7], read_payload(data, TINY, 4096, 64, model.new_state))
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: b"XXXX" + d[4:], "not a DSV4 session payload"),
        (lambda d: d[:-10], "needs"),
        (lambda d: d + b"\0", "needs"),
        (lambda d: d[:20], "needs"),
        (lambda d: d[:30], "header alone"),
    ],
    ids=["magic", "truncated", "trailing", "cut-after-header", "cut-in-header"],
)
def test_corrupt_payloads_are_refused(tiny_state, mutate, message):
    with pytest.raises(PayloadError, match=message):
        read_payload(mutate(encode(tiny_state[1])), TINY, 4096, 64, tiny_state[0].new_state)


def test_foreign_payloads_are_refused_with_the_reason(tiny_state):
    data, new_state = encode(tiny_state[1]), tiny_state[0].new_state
    with pytest.raises(PayloadError, match="prefill chunk 64, this session uses 128"):
        read_payload(data, TINY, 4096, 128, new_state)
    with pytest.raises(PayloadError, match="written for context 4096"):
        read_payload(data, TINY, 2048, 64, new_state)
    with pytest.raises(PayloadError, match="another model: head_dim"):
        read_payload(data, TINY.with_(head_dim=64), 4096, 64, new_state)


def test_short_state_without_compressed_rows_round_trips(tiny_state):
    """Under 128 tokens the ratio-128 layers have no rows yet; the payload still holds the frontier."""
    model, _ = tiny_state
    state = model.new_state()
    model.forward(list(range(1000, 1010)), state, all_logits=False)
    data = encode(state)
    assert len(data) == payload_nbytes(TINY, 10)
    assert encode(read_payload(data, TINY, 4096, 64, model.new_state)) == data
