"""Disk KV cache: checkpoints that continue exactly, damaged and foreign files, crash safety, the save
points, and an eviction policy that keeps what agent workloads reuse."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.cli import _register_commands, app
from dwarfstar.gguf.constants import GGMLType
from dwarfstar.kvcache import kvfile
from dwarfstar.kvcache.kvfile import ModelIdentity
from dwarfstar.kvcache.kvpolicy import (
    ASSISTANT_TOKEN,
    USER_TOKEN,
    ContinuedSchedule,
    KVCacheOptions,
    SaveReason,
    chat_anchor_pos,
    cold_save_point,
    store_len,
)
from dwarfstar.kvcache.kvstore import KVStore
from dwarfstar.kvcache.payload import payload_nbytes
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.session.accounting import random_state, state_footprint
from dwarfstar.session.session import Session
from dwarfstar.tokenizer.tokenizer import Tokenizer

PROMPT = torch.randint(3, 120000, (301,), generator=torch.Generator().manual_seed(11)).tolist()
TOL = 1e-5
CTX, CHUNK = 1024, 64
OPTS = KVCacheOptions(min_tokens=64, budget_bytes=1 << 30)
LOGGER = "dwarfstar.kvcache.kvstore"


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return ((a - b).abs().max() / b.abs().max()).item() < TOL


# -- a real model: checkpoints must continue exactly ------------------------------------------------
@pytest.fixture(scope="module")
def model_path(tiny_model_file):
    return tiny_model_file(2)


@pytest.fixture(scope="module")
def backend(model_path):
    return ReferenceModel(open_model(model_path), qat=False)


@pytest.fixture(scope="module")
def identity(model_path):
    return ModelIdentity.of(open_model(model_path))


@pytest.fixture(scope="module")
def render(model_path):
    return Tokenizer.from_gguf(model_path).decode_bytes


@pytest.fixture(scope="module")
def reference_logits(backend):
    return backend.forward(PROMPT, backend.new_state())


@pytest.fixture(scope="module")
def saved(tmp_path_factory, backend, identity, render):
    """A directory with the prompt's first 128 tokens (cold) and first 256 (evict), from a live session."""
    directory = tmp_path_factory.mktemp("kv")
    store = KVStore(directory, TINY, identity, CTX, CHUNK, render, OPTS)
    session = Session(backend, ctx=CTX, chunk=CHUNK)
    session.prefill(PROMPT[:128])
    short = store.save(session.state, SaveReason.COLD)
    session.prefill(PROMPT[128:256])
    long = store.save(session.state, SaveReason.EVICT)
    return SimpleNamespace(dir=directory, short=short.name, long=long.name)


@pytest.fixture
def cache(tmp_path, saved):
    """A private copy of the saved directory."""
    directory = tmp_path / "kv"
    shutil.copytree(saved.dir, directory)
    return SimpleNamespace(dir=directory, short=directory / saved.short, long=directory / saved.long)


def test_saved_checkpoint_continues_like_an_uninterrupted_run(cache, backend, identity, render, reference_logits):
    store = KVStore(cache.dir, TINY, identity, CTX, CHUNK, render, OPTS)  # a fresh open of the directory
    hit = store.lookup(render(PROMPT))
    assert hit is not None and hit.n_tokens == 256 and hit.key == render(PROMPT[:256])
    assert hit.reason == SaveReason.EVICT and hit.path == cache.long
    assert close(hit.state.logits, reference_logits[255])
    session = Session(backend, ctx=CTX, chunk=CHUNK)
    session.state = hit.state
    assert close(session.prefill(PROMPT[256:]), reference_logits[-1])
    assert session.stats.computed == len(PROMPT) - 256  # the cached tokens were not run again
    # the file holds exactly the payload the accounting predicts, plus header, key and identity
    size = cache.long.stat().st_size
    assert size == kvfile.FIXED.size + len(hit.key) + payload_nbytes(TINY, 256) + kvfile.IDENTITY.size


def test_lookup_takes_the_longest_prefix_and_counts_hits(cache, identity, render):
    clock = Clock()
    store = KVStore(cache.dir, TINY, identity, CTX, CHUNK, render, OPTS, clock=clock)
    assert store.lookup(render(PROMPT[:200])).n_tokens == 128  # the 256-token key is not a prefix
    clock.t += 100
    assert store.lookup(render(PROMPT[:256])).n_tokens == 256
    assert store.lookup(render(PROMPT[:256])).n_tokens == 256
    assert store.lookup(render(PROMPT[:127])) is None
    assert store.lookup(render([5] + PROMPT[1:])) is None
    headers = {e.path: e.header for e in store.entries()}
    assert (headers[cache.short].hits, headers[cache.long].hits) == (1, 2)
    assert headers[cache.long].last_used == clock.t
    # counting hits rewrites header fields outside the checksum: the files still load
    assert store.lookup(render(PROMPT)).n_tokens == 256


@pytest.mark.parametrize("where", ["key", "payload", "identity"])
def test_flipped_byte_is_caught_the_file_removed_and_a_shorter_one_serves(cache, identity, render, caplog, where):
    data = bytearray(cache.long.read_bytes())
    header = kvfile.FileHeader.unpack(bytes(data[: kvfile.FIXED.size]))
    at = {"key": kvfile.FIXED.size + 10, "payload": header.payload_end - 1000, "identity": len(data) - 5}[where]
    data[at] ^= 0x10
    cache.long.write_bytes(data)
    with caplog.at_level(logging.INFO, LOGGER):
        store = KVStore(cache.dir, TINY, identity, CTX, CHUNK, render, OPTS)
        hit = store.lookup(render(PROMPT))
    assert hit is not None and hit.n_tokens == 128
    assert not cache.long.exists()
    assert any("corrupt" in r.message and cache.long.name in r.message for r in caplog.records)


@pytest.mark.parametrize("keep", [30, kvfile.FIXED.size + 200, -20000, -1])
def test_truncated_file_is_removed(cache, identity, render, caplog, keep):
    data = cache.long.read_bytes()
    cache.long.write_bytes(data[:keep])
    with caplog.at_level(logging.INFO, LOGGER):
        store = KVStore(cache.dir, TINY, identity, CTX, CHUNK, render, OPTS)
        assert store.lookup(render(PROMPT)).n_tokens == 128
    assert not cache.long.exists()
    assert any("corrupt" in r.message for r in caplog.records)


@pytest.fixture(scope="module")
def other_model_identity(tmp_path_factory):
    path = tmp_path_factory.mktemp("m2") / "tiny3.gguf"
    write_synthetic_model(path, TINY, seed=3)  # same shape, other weights
    return ModelIdentity.of(open_model(path))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("model", "another model"),
        ("ctx", "context"),
        ("chunk", "prefill chunk"),
        ("strict quant", "strict quant"),
        ("shape", "another model"),
    ],
)
def test_foreign_files_are_refused_with_the_reason_and_kept(
    cache, identity, other_model_identity, render, caplog, change, reason
):
    args, ident, ctx, chunk, opts = TINY, identity, CTX, CHUNK, OPTS
    if change == "model":
        ident = other_model_identity
    elif change == "ctx":
        ctx = 512
    elif change == "chunk":
        chunk = 32
    elif change == "strict quant":
        ident, opts = dataclasses.replace(identity, quant_bits=2), dataclasses.replace(OPTS, strict_quant=True)
    else:
        args = TINY.with_(head_dim=64)
    with caplog.at_level(logging.INFO, LOGGER):
        store = KVStore(cache.dir, args, ident, ctx, chunk, render, opts)
        assert store.lookup(render(PROMPT)) is None
    assert cache.long.exists() and cache.short.exists()
    refusals = [e.refusal for e in store.entries()]
    assert len(refusals) == 2 and all(reason in r for r in refusals), refusals
    assert any(reason in r.message for r in caplog.records)


def test_cross_quant_and_larger_context_reuse_is_allowed(cache, identity, render):
    other_quant = dataclasses.replace(identity, quant_bits=2)
    assert KVStore(cache.dir, TINY, other_quant, CTX, CHUNK, render, OPTS).lookup(render(PROMPT)).n_tokens == 256
    assert KVStore(cache.dir, TINY, identity, 2 * CTX, CHUNK, render, OPTS).lookup(render(PROMPT)).n_tokens == 256


def test_file_without_identity_is_refused_not_removed(cache, identity, render):
    data = bytearray(cache.long.read_bytes()[: -kvfile.IDENTITY.size])
    data[6] &= ~kvfile.EXT_IDENTITY  # as ds4 writes it
    cache.long.write_bytes(data)
    store = KVStore(cache.dir, TINY, identity, CTX, CHUNK, render, OPTS)
    assert store.lookup(render(PROMPT)).n_tokens == 128
    assert cache.long.exists()
    assert "no DwarfStar identity" in {e.path: e.refusal for e in store.entries()}[cache.long]


def test_model_identity_ignores_expert_quantization_only(model_path, identity, other_model_identity):
    model = open_model(model_path)
    tensors = {
        name: dataclasses.replace(info, ggml_type=GGMLType.IQ2_XXS) if "_exps" in name else info
        for name, info in model.gguf.tensors.items()
    }
    requantized = ModelIdentity.of(
        SimpleNamespace(args=model.args, gguf=SimpleNamespace(tensors=tensors, raw=model.gguf.raw))
    )
    assert identity.quant_bits == 32 and requantized.quant_bits == 2
    assert requantized.fingerprint == identity.fingerprint
    assert other_model_identity.fingerprint != identity.fingerprint


def test_tool_map_and_visible_key_round_trip(tmp_path, identity):
    dsml = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="bash">x</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    key = ("<｜User｜>run it<｜Assistant｜></think>" + dsml).encode()
    store = KVStore(tmp_path, TINY, identity, CTX, CHUNK, synthetic_key, OPTS)
    tools = {"call_1": dsml, "call_2": dsml, "call_elsewhere": "<｜DSML｜tool_calls>other"}
    path = store.save(synthetic(range(200)), SaveReason.EVICT, tools, key, kvfile.EXT_RESPONSES_VISIBLE)
    hit = store.lookup(key + "<｜User｜>next".encode())
    assert hit.path == path and hit.key == key
    assert hit.tool_map == {"call_1": dsml, "call_2": dsml}  # only blocks the key contains
    assert hit.key_flags == kvfile.EXT_RESPONSES_VISIBLE
    # saving the same checkpoint again leaves the file alone unless the tool map grew
    inode = path.stat().st_ino
    assert store.save(synthetic(range(200)), SaveReason.EVICT, tools, key) == path and path.stat().st_ino == inode
    assert store.save(synthetic(range(200)), SaveReason.EVICT, {**tools, "call_3": dsml}, key) == path
    assert path.stat().st_ino != inode
    assert set(store.lookup(key).tool_map) == {"call_1", "call_2", "call_3"}
    assert {e.path: e.hits for e in store.entries()}[path] == 2  # the rewrite kept the earlier hit


def test_kill_during_save_leaves_nothing_loadable(tmp_path, caplog):
    script = textwrap.dedent(f"""
        import io, time
        from dwarfstar.model.synthetic import TINY
        from dwarfstar.kvcache import kvstore
        from dwarfstar.session.accounting import random_state
        from dwarfstar.kvcache.kvfile import ModelIdentity
        from dwarfstar.kvcache.kvpolicy import KVCacheOptions, SaveReason

        def stall_halfway(out, *args):  # write half the payload, then wait to be killed
            buf = io.BytesIO()
            n = real_write(buf, *args)
            out.write(buf.getvalue()[: n // 2])
            out.out.flush()
            print("stalled", flush=True)
            time.sleep(120)

        real_write, kvstore.write_payload = kvstore.write_payload, stall_halfway
        store = kvstore.KVStore({str(tmp_path)!r}, TINY, ModelIdentity(32, bytes(32)), 1024, 64,
                                lambda t: repr(t).encode(), KVCacheOptions(min_tokens=64))
        store.save(random_state(TINY, 900), SaveReason.SHUTDOWN)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "stalled"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    (partial,) = tmp_path.iterdir()
    assert partial.name.endswith(f".kv.tmp.{proc.pid}") and partial.stat().st_size > 100_000
    # even under its final name the partial file must not load
    final = tmp_path / partial.name.split(".tmp.")[0]
    shutil.copy(partial, final)
    key = repr(random_state(TINY, 900).tokens).encode()
    with caplog.at_level(logging.INFO, LOGGER):
        store = KVStore(tmp_path, TINY, ModelIdentity(32, bytes(32)), 1024, 64, lambda t: repr(t).encode(), OPTS)
        assert store.lookup(key) is None
    assert list(tmp_path.iterdir()) == []  # the unfinished write and the copy are both gone
    assert any("unfinished write" in r.message for r in caplog.records)


# -- eviction, on synthetic states (no model run) -----------------------------------------------------
IDENT = ModelIdentity(32, bytes(range(32)))


class Clock:
    def __init__(self) -> None:
        self.t = 1_700_000_000

    def __call__(self) -> int:
        return self.t


def synthetic_key(tokens) -> bytes:
    return b"".join(b"<%d>" % t for t in tokens)


def synthetic(tokens, seed: int = 0):
    state = random_state(TINY, len(tokens), seed)
    state.tokens = list(tokens)
    return state


def file_size(tokens) -> int:
    return kvfile.FIXED.size + len(synthetic_key(tokens)) + payload_nbytes(TINY, len(tokens)) + kvfile.IDENTITY.size


def store_at(directory, budget: int, clock: Clock) -> KVStore:
    opts = dataclasses.replace(OPTS, budget_bytes=budget)
    return KVStore(directory, TINY, IDENT, CTX, CHUNK, synthetic_key, opts, clock=clock)


SYSTEM = list(range(1000, 1600))  # a 600-token shared system prompt


def conversation(i: int, length: int = 3000) -> list[int]:
    return SYSTEM + [50_000 + i] * (length - len(SYSTEM))


def ds4_score(hits: int, tokens: int, size: int) -> float:
    return (hits + 1) * tokens / size


def test_shared_prefix_survives_long_one_off_conversations(tmp_path):
    long_size = file_size(conversation(0))
    budget = file_size(SYSTEM) + 5 * long_size // 2
    # with ds4's score the fresh system-prompt file is the first victim (#444)
    assert ds4_score(0, len(SYSTEM), file_size(SYSTEM)) < ds4_score(0, 3000, long_size)
    clock = Clock()
    store = store_at(tmp_path, budget, clock)
    anchor = store.save(synthetic(SYSTEM), SaveReason.COLD)
    written = []
    for i in range(8):
        clock.t += 60
        written.append(store.save(synthetic(conversation(i), seed=i), SaveReason.EVICT))
        assert written[-1] is not None and written[-1].exists()  # never evicted right after storing
        assert store.total_bytes() <= budget
        assert anchor.exists()
    assert {e.path for e in store.entries()} == {anchor, *written[-2:]}  # the oldest one-offs went
    assert store.lookup(synthetic_key(SYSTEM + [7, 7])).n_tokens == len(SYSTEM)


def test_file_that_would_not_survive_is_not_written(tmp_path):
    clock = Clock()
    store = store_at(tmp_path, file_size(SYSTEM) + file_size(conversation(0)) + 1000, clock)
    anchor = store.save(synthetic(SYSTEM), SaveReason.COLD)
    dump = store.save(synthetic(conversation(0)), SaveReason.EVICT)
    clock.t += 60
    # a periodic snapshot of an unrelated conversation is worth less than either file: ds4 would
    # store it and evict one of them; here it is skipped and nothing moves
    assert store.save(synthetic([9] * 3000), SaveReason.CONTINUED) is None
    assert sorted(tmp_path.iterdir()) == sorted([anchor, dump])
    # too big for the budget at all (with ds4's 1% slack)
    assert store_at(tmp_path / "small", file_size(SYSTEM), clock).save(synthetic(SYSTEM), SaveReason.COLD) is None


def test_superseded_checkpoints_of_one_conversation_are_dropped(tmp_path):
    clock = Clock()
    store = store_at(tmp_path, 1 << 30, clock)
    conv = conversation(1, 2400)
    anchor = store.save(synthetic(SYSTEM), SaveReason.COLD)
    first = store.save(synthetic(conv[:1000]), SaveReason.CONTINUED)
    second = store.save(synthetic(conv[:2000]), SaveReason.CONTINUED)
    assert anchor.exists() and not first.exists() and second.exists()
    # a resumed dump (one hit, the resumption itself) is superseded by the next dump
    store.lookup(synthetic_key(conv[:2100]))
    third = store.save(synthetic(conv), SaveReason.EVICT)
    assert not second.exists() and third.exists()
    # a checkpoint resumed twice is a fork point and stays, as does one with another branch
    fork = conversation(2, 1500)
    base = store.save(synthetic(fork[:1000]), SaveReason.CONTINUED)
    store.lookup(synthetic_key(fork))
    store.lookup(synthetic_key(fork))
    store.save(synthetic(fork), SaveReason.CONTINUED)
    assert base.exists() and anchor.exists()
    # a checkpoint saved after a longer one of the same text (a rewound conversation) is a fork point
    rewound = conversation(3, 1500)
    longer = store.save(synthetic(rewound), SaveReason.EVICT)
    middle = store.save(synthetic(rewound[:1000]), SaveReason.CONTINUED)
    store.save(synthetic(rewound[:1000] + [2] * 300), SaveReason.CONTINUED)
    assert middle.exists() and longer.exists()


def test_prefixes_of_the_incoming_prompt_survive_an_evict_save(tmp_path):
    clock = Clock()
    store = store_at(tmp_path, file_size(SYSTEM) + file_size(conversation(0)) + 1000, clock)
    old = store.save(synthetic(conversation(0)), SaveReason.CONTINUED)
    clock.t += 60
    # live state of another conversation is saved before the incoming prompt is looked up on disk
    live = store.save(synthetic([7] * 3000), SaveReason.EVICT, keep_prefixes_of=synthetic_key(conversation(0) + [1]))
    assert live is None and old.exists()  # the file the lookup needs was not evicted for it
    assert store.save(synthetic([7] * 3000), SaveReason.EVICT) is not None and not old.exists()


def test_budget_holds_under_a_random_workload_and_on_open(tmp_path):
    gen = torch.Generator().manual_seed(5)
    clock = Clock()
    budget = 6 * file_size(conversation(0))
    store = store_at(tmp_path, budget, clock)
    stored = 0
    for step in range(16):
        clock.t += int(torch.randint(1, 7200, (1,), generator=gen))
        length = int(torch.randint(700, 4000, (1,), generator=gen))
        who = int(torch.randint(0, 5, (1,), generator=gen))
        reason = SaveReason(int(torch.randint(1, 5, (1,), generator=gen)))
        if step % 3 == 0:
            store.lookup(synthetic_key(conversation(who, 5000)))
        path = store.save(synthetic(conversation(who, length), seed=step), reason)
        assert path is None or path.exists()
        assert store.total_bytes() <= budget
        stored += path.stat().st_size if path else 0
    assert stored > 2 * budget and len(store.entries()) >= 3  # the budget had to be enforced
    smaller = store_at(tmp_path, 2 * file_size(conversation(0)), clock)  # eviction runs on open
    assert 0 < smaller.total_bytes() <= 2 * file_size(conversation(0))


# -- save points ----------------------------------------------------------------------------------------
def test_store_len_trims_and_aligns():
    opts = KVCacheOptions()
    assert store_len(opts, 11011) == 10240  # ds4's test vectors
    assert store_len(opts, 1695) == 1695  # aligning would fall below min: keep the whole prompt
    assert store_len(opts, 544) == 544 and store_len(opts, 4200) == 4096
    assert store_len(dataclasses.replace(opts, boundary_align_tokens=0), 1695) == 1663


def test_cold_save_point_prefers_the_chat_anchor():
    opts = KVCacheOptions()
    prompt = [5] * 700 + [USER_TOKEN] + [6] * 99 + [USER_TOKEN] + [7] * 50 + [ASSISTANT_TOKEN] + [8] * 2000
    assert chat_anchor_pos(opts, prompt) == 800  # last user marker before the first assistant
    assert cold_save_point(opts, prompt, cached_tokens=0) == 800
    assert cold_save_point(opts, prompt, cached_tokens=10) == 0  # only on a full miss
    early = [USER_TOKEN] + [5] * 3000 + [ASSISTANT_TOKEN] + [USER_TOKEN] + [6] * 100
    assert chat_anchor_pos(opts, early) == -1  # anchor below min tokens; later users do not count
    assert cold_save_point(opts, early, 0) == 2048  # len - 32 aligned down
    assert cold_save_point(opts, [5] * 300, 0) == 0  # below min
    assert cold_save_point(opts, [5] * 30001, 0) == 0  # above cold max
    assert cold_save_point(dataclasses.replace(opts, cold_max_tokens=0), prompt, 0) == 0


def test_continued_saves_on_absolute_aligned_frontiers():
    opts = KVCacheOptions()
    assert opts.continued_step == 10240
    schedule = ContinuedSchedule(opts)
    due = [n for n in range(1, 31000) if schedule.target(n)]
    assert due == [10240, 20480, 30720]
    assert schedule.target(10240, in_dsml=True) == 0
    assert schedule.next_frontier(9000) == 10240
    schedule.note_store(10240)  # a cold save that landed on the frontier suppresses the duplicate
    assert schedule.target(10240) == 0 and schedule.target(20480) == 20480
    assert schedule.next_frontier(10240) == 20480
    off = ContinuedSchedule(dataclasses.replace(opts, continued_interval_tokens=0))
    assert off.target(10240) == 0 and off.next_frontier(0) == 0


def test_options_are_validated():
    with pytest.raises(ValueError, match="cold_max"):
        KVCacheOptions(min_tokens=512, cold_max_tokens=100)
    with pytest.raises(ValueError, match="budget"):
        KVCacheOptions(budget_bytes=0)


# -- accounting and the bench -------------------------------------------------------------------------
def test_state_footprint_matches_the_spec():
    flash = state_footprint(ModelArgs.flash())
    assert flash.kv_elements_per_token == 3440 and flash.kv_bytes_per_token(2) == 6880
    # compact: 21 ratio-4 layers of 448 * 2 + 64 * 4 B KV and 128 * 2 B indexer rows, 20 ratio-128 layers
    assert flash.compact_bytes_per_token == 21 * (1152 + 256) / 4 + 20 * 1152 / 128 == 7572
    assert flash.payload_bytes_per_token == 13764 and flash.payload_fixed_bytes == 23_995_788
    assert flash.payload_bytes(65536) == payload_nbytes(ModelArgs.flash(), 65536) == 926_033_292
    assert state_footprint(ModelArgs.pro()).kv_elements_per_token == 4924
    tiny = state_footprint(TINY)
    assert tiny.payload_bytes(256) == payload_nbytes(TINY, 256)


def test_bench_kv_prints_the_figures(tmp_path):
    _register_commands()
    result = CliRunner().invoke(app, ["bench", "kv", "--tokens", "3000", "--repeat", "1", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for figure in ("6,880", "13,764", "23,995,788", "save MB/s", "load MB/s"):
        assert figure in result.output
    assert list(tmp_path.iterdir()) == []
