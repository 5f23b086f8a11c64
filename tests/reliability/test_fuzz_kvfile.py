"""The KV-file loader under mutated real files: headers, CRCs, sections and truncations. Every
reader either returns a result or raises its named error (KVFileError, PayloadError); the store
never raises at all (a bad file is a miss), and whatever it loads is the state that was saved.

Half the cases get their CRC recomputed after the mutation, so the damage reaches the parsers behind
the checksum (payload header, row counts, tool map) instead of stopping at the checksum compare.
"""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from fuzz_support import FUZZ, mutated, tally
from hypothesis import given
from hypothesis import strategies as st

from dwarfstar.kvcache import kvfile
from dwarfstar.kvcache.kvfile import FIXED, FileHeader, KVFileError, ModelIdentity
from dwarfstar.kvcache.kvpolicy import KVCacheOptions, SaveReason
from dwarfstar.kvcache.kvstore import KVStore
from dwarfstar.kvcache.payload import PayloadError, read_payload
from dwarfstar.model.state import KVCache, TorchStorage
from dwarfstar.model.synthetic import TINY
from dwarfstar.session.accounting import random_state

CTX, CHUNK, TOKENS = 1024, 64, 96
IDENTITY = ModelIdentity(32, bytes(range(32)))
OPTIONS = KVCacheOptions(min_tokens=8)


def render(tokens) -> bytes:
    return repr(list(tokens)).encode()


def open_store(directory) -> KVStore:
    return KVStore(directory, TINY, IDENTITY, CTX, CHUNK, render, OPTIONS)


@pytest.fixture(scope="module")
def seed(tmp_path_factory):
    state = random_state(TINY, TOKENS)
    tools = {"call_1": render(state.tokens[:3]).decode()[1:-1]}  # a tool map whose DSML is in the key
    path = open_store(tmp_path_factory.mktemp("kv")).save(state, SaveReason.COLD, tool_map=tools)
    return path.name, path.read_bytes(), state


def with_crc_recomputed(data: bytes) -> bytes:
    try:
        header = FileHeader.unpack(data[: FIXED.size])
    except KVFileError:
        return data
    crc = zlib.crc32(data[FIXED.size :], zlib.crc32(header.checksummed()))
    return data[:20] + struct.pack("<I", crc) + data[24:]


def test_the_seed_loads(seed, tmp_path):
    name, data, state = seed
    (tmp_path / name).write_bytes(data)
    hit = open_store(tmp_path).lookup(render(state.tokens) + b" more")
    assert hit is not None and hit.state.tokens == state.tokens and hit.tool_map


HEAD_BYTES = 600  # header, key and the payload's own header


@FUZZ
@given(data=st.data())
def test_mutated_files_load_or_fail_by_name(seed, tmp_path, data):
    name, original, state = seed
    case = data.draw(mutated(original, hot=HEAD_BYTES))
    forged = data.draw(st.booleans())
    if forged:
        case = with_crc_recomputed(case)
    path = tmp_path / name
    path.write_bytes(case)
    outcomes = []
    for read in (kvfile.read_head, kvfile.read_tool_map):
        try:
            read(path)
            outcomes.append("ok")
        except KVFileError:
            outcomes.append("refused")
    try:
        ckpt = kvfile.read_checkpoint(path)
        read_payload(ckpt.payload, TINY, CTX, CHUNK, KVCache(TINY, CTX, TorchStorage()).new_state)
        outcomes.append("loaded")
    except (KVFileError, PayloadError):
        outcomes.append("refused")
    hit = open_store(tmp_path).lookup(render(state.tokens) + b" more")  # never raises
    if hit is not None and not forged:  # damage the CRC catches never reaches a session
        assert hit.state.tokens == state.tokens and torch.equal(hit.state.logits, state.logits)
    tally("kv file", "loaded by the store" if hit is not None else "a miss")
    for reader, outcome in zip(("read_head", "read_tool_map", "read_checkpoint+payload"), outcomes, strict=True):
        tally(f"kv file {reader}", outcome)
    path.unlink(missing_ok=True)


def test_a_tool_map_behind_a_damaged_length_is_refused(seed, tmp_path):
    """Found by the fuzzer: a key length past the end made read_tool_map seek out of range (OSError or
    ValueError instead of CorruptFile), which escaped the store's tool-map checks."""
    name, original, _state = seed
    path = tmp_path / name
    for key_len in (2**32 - 1, 2**31):
        path.write_bytes(original[:48] + struct.pack("<I", key_len) + original[52:])
        with pytest.raises(kvfile.CorruptFile, match="truncated"):
            kvfile.read_tool_map(path)


def test_an_unknown_save_reason_loads_as_unknown(seed, tmp_path):
    """Found by the fuzzer: a reason byte outside SaveReason (under a valid CRC) made lookup raise."""
    name, original, state = seed
    (tmp_path / name).write_bytes(with_crc_recomputed(original[:5] + bytes([9]) + original[6:]))
    hit = open_store(tmp_path).lookup(render(state.tokens) + b" more")
    assert hit is not None and hit.reason is SaveReason.UNKNOWN and hit.state.tokens == state.tokens
