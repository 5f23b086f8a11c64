"""The backend-owned KV cache: fixed slots, the raw-window ring, snapshots and forks over slots."""

from __future__ import annotations

import copy
import gc
import io

import numpy as np
import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.kvcache.payload import PayloadError, read_payload, write_payload
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.loader import open_model
from dwarfstar.model.pages import PAGE_ROWS
from dwarfstar.model.state import ROW_STEP, KVCache, SplitRows, TorchStorage, layer_compressors
from dwarfstar.model.synthetic import TINY, write_synthetic_model

WINDOW = TINY.window


def cache(ctx: int = 1024, slots: int = 2) -> KVCache:
    return KVCache(TINY, ctx, TorchStorage(), block_slots=slots)


def test_the_ring_gives_the_last_window_rows_oldest_first():
    state = cache().new_state()
    rows = torch.arange(3 * WINDOW + 5, dtype=torch.float32)[:, None].expand(-1, TINY.head_dim)
    for start, end in ((0, 7), (7, WINDOW + 3), (WINDOW + 3, WINDOW + 4), (WINDOW + 4, 3 * WINDOW + 5)):
        state.store_window(0, rows[start:end], end)  # chunks that wrap the ring, one that overruns it
        state.pos = end
        want = rows[max(0, end - WINDOW) : end]
        assert torch.equal(state.raw_window(0), want), end
    assert torch.equal(state.raw_window(0, end=3 * WINDOW + 5), rows[-WINDOW:])


def test_slots_are_preallocated_reused_and_never_move():
    kv = cache(ctx=1000, slots=2)
    a, b = kv.new_state(), kv.new_state()
    assert len(kv.blocks) == 1 and kv.slots_in_use == 2
    # a slot's page table reaches the whole context, in multiples of ROW_STEP, and the block's pool
    # has a page for every entry of its tables
    table = a.row_pages(4).table
    assert table.shape[1] * PAGE_ROWS % ROW_STEP == 0 and table.shape[1] * PAGE_ROWS >= 1000 // 4
    pool = a.parts(2)["attn_rows"]
    assert pool.shape[:2] == (2 * table.shape[1], PAGE_ROWS)
    pointer = pool.data_ptr()
    c = kv.new_state()  # a third sequence opens a second block; the first block's arrays stay put
    assert len(kv.blocks) == 2 and a.parts(2)["attn_rows"].data_ptr() == pointer
    slot = b.slot
    del b
    gc.collect()
    assert kv.slots_in_use == 2
    d = kv.new_state()
    assert d.slot == slot  # the freed slot, with its frontier emptied for the new sequence
    assert torch.isinf(d.part(2, "attn_gate")).all() and not d.part(2, "attn_kv").any()
    assert c.cache is kv


def test_a_snapshot_is_refused_after_a_rewind_below_it_and_by_another_state():
    kv = cache()
    state, other = kv.new_state(), kv.new_state()
    state.pos = 40
    early = state.snapshot()
    state.pos = 100
    late = state.snapshot()
    assert state.can_restore(early) and state.can_restore(late) and not other.can_restore(early)
    with pytest.raises(ValueError, match="another state"):
        other.restore(early)
    state.restore(early)  # a rewind to 40: rows past it will be overwritten as the state advances
    assert state.pos == 40 and not state.can_restore(late)
    with pytest.raises(ValueError, match="no longer valid"):
        state.restore(late)
    state.pos = 41
    same_rows = state.snapshot()
    state.restore(early)  # 40 and 41 share every compressed row: the snapshot at 41 stays valid
    assert state.can_restore(same_rows)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv") / "tiny.gguf"
    write_synthetic_model(path, TINY, seed=3)
    return open_model(path)


def test_a_fork_is_a_separate_slot_that_keeps_the_parents_earlier_snapshots(tiny):
    model = ReferenceModel(tiny)
    parent = model.new_state()
    model.forward(list(range(50, 250)), parent, all_logits=False)
    before = parent.snapshot()
    twin = copy.deepcopy(parent)
    assert twin.slot != parent.slot and twin.pos == parent.pos and twin.tokens == parent.tokens
    for il in range(TINY.n_layers):
        for name, value in parent.host_parts(il).items():
            assert (twin.host_parts(il)[name] == value).all(), name
    model.forward([5, 6, 7], parent, all_logits=False)
    after = parent.snapshot()  # the parent moved on: its later rows are not the twin's
    assert twin.can_restore(before) and not twin.can_restore(after)
    want = model.forward([9], copy.deepcopy(twin))
    twin.restore(before)
    assert torch.equal(model.forward([9], twin), want)


def test_a_payload_longer_than_the_backends_cache_is_refused(tiny):
    short = ReferenceModel(tiny, max_seq_len=256)
    long = ReferenceModel(tiny)
    state = long.new_state()
    long.forward(list(range(300)), state, all_logits=False)
    buf = io.BytesIO()
    write_payload(buf, state, TINY, 4096, 64)
    with pytest.raises(PayloadError, match="cache holds 256"):
        read_payload(buf.getvalue(), TINY, 4096, 64, short.new_state)


def test_a_compact_cache_keeps_rounded_dims_in_bf16_and_gives_the_same_payload(tiny):
    """With QAT the KV rows' nope dims and the whole indexer rows are bf16-exact: a compact cache
    holds them in bf16 (the RoPE dims in float32), and a state copied into it gives back the same
    rows and the same payload bytes, in fewer bytes."""
    model = ReferenceModel(tiny)
    src, ctx = model.new_state(), model.cache.ctx
    model.forward(torch.randint(3, TINY.vocab_size, (150,), generator=torch.Generator().manual_seed(4)), src)
    compact = KVCache(TINY, ctx, TorchStorage(compact=True), block_slots=1).new_state()
    buf = io.BytesIO()
    write_payload(buf, src, TINY, ctx, 64)
    read_payload(buf.getvalue(), TINY, ctx, 64, lambda: compact)
    ratio4 = next(il for il in range(TINY.n_layers) if TINY.layer(il).compress_ratio == 4)
    rows = compact.parts(ratio4)["attn_rows"]
    nope = TINY.head_dim - TINY.rope_dim
    assert isinstance(rows, SplitRows) and rows.exact.dtype == torch.bfloat16 and rows.exact.shape[-1] == nope
    assert rows.rest.dtype == torch.float32 and compact.parts(ratio4)["indexer_rows"].dtype == torch.bfloat16
    for il in range(TINY.n_layers):
        want, got = src.host_parts(il), compact.host_parts(il)
        assert all((want[k] == got[k]).all() for k in want), il
    again = io.BytesIO()
    write_payload(again, compact, TINY, ctx, 64)
    assert again.getvalue() == buf.getvalue()
    assert compact.nbytes() < src.nbytes()


def test_compact_rows_at_flash_widths_take_the_bytes_of_their_layout():
    storage, flash = TorchStorage(compact=True), ModelArgs.flash()
    specs = {spec.kind: spec for layer in layer_compressors(flash) for spec in layer.values()}
    # a KV row: 448 nope dims in bf16, 64 RoPE dims in float32; an indexer row: 128 dims in bf16
    assert storage.row_nbytes(specs["attn"].dim, specs["attn"].exact_dims) == 448 * 2 + 64 * 4
    assert storage.row_nbytes(specs["indexer"].dim, specs["indexer"].exact_dims) == 128 * 2
    assert TorchStorage().row_nbytes(specs["attn"].dim, specs["attn"].exact_dims) == 512 * 4


def rows_of(state, n_layers: int) -> dict[str, torch.Tensor]:
    return {f"{il}/{k}": v for il in range(n_layers) for k, v in state.host_parts(il).items() if k.endswith("_rows")}


def test_a_fork_shares_its_parents_pages_until_one_of_them_writes_there(tiny):
    """A fork points its page tables at its parent's row pages instead of copying them. A write
    into a shared page (each continues past the fork, inside the partly filled last page) first
    gives the writer a copy of its own, so neither sees the other's rows, and each continues exactly
    as a sequence that was never forked."""
    model = ReferenceModel(tiny, kv_slots=4)
    prompt = torch.randint(3, TINY.vocab_size, (600,), generator=torch.Generator().manual_seed(5)).tolist()
    parent = model.new_state()
    model.forward(prompt, parent, all_logits=False)
    pages = model.cache.pages_in_use()
    assert pages == 3 + 1  # ratio 4: 150 rows in pages of 64; ratio 128: 4 rows
    shared_rows = rows_of(parent, TINY.n_layers)
    twin = copy.deepcopy(parent)
    assert model.cache.pages_in_use() == pages  # shared, not copied
    assert (twin.row_pages(4).host[twin.index] == parent.row_pages(4).host[parent.index]).all()
    alone = model.new_state()  # the same prompt, never forked
    model.forward(prompt, alone, all_logits=False)
    assert model.cache.pages_in_use() == 2 * pages
    # the pool's accounting: each holder counts half of a shared page, so the pair counts its rows once
    row_bytes = {4: 0, 128: 0}  # a row of every layer of the ratio, float32
    for specs in layer_compressors(TINY):
        for spec in specs.values():
            row_bytes[spec.ratio] += 4 * spec.dim
    page_bytes = PAGE_ROWS * (3 * row_bytes[4] + row_bytes[128])
    assert parent.nbytes() == twin.nbytes() and 2 * alone.nbytes() - 2 * twin.nbytes() == page_bytes

    parent_next = model.forward([11, 12], parent)
    # the parent wrote into the last page of each ratio, which it shared: it took a copy of each
    assert model.cache.pages_in_use() == 2 * pages + 2
    twin_next = model.forward([21, 22], twin)
    assert model.cache.pages_in_use() == 2 * pages + 2  # the twin now holds the old last pages alone
    assert torch.equal(parent_next, model.forward([11, 12], copy.deepcopy(alone)))
    assert torch.equal(twin_next, model.forward([21, 22], copy.deepcopy(alone)))
    for name, rows in rows_of(twin, TINY.n_layers).items():  # below the fork: the parent's rows, untouched
        assert np.array_equal(rows[: len(shared_rows[name])], shared_rows[name]), name
    used = model.cache.pages_in_use()
    del twin
    gc.collect()
    assert model.cache.pages_in_use() == used - 2  # only the pages it held alone are freed


def test_a_rewind_into_pages_a_fork_shares_copies_them_first(tiny):
    """The parent goes back below the fork (a snapshot restore) and writes other rows there: the
    pages it rewrites are copied first, so the fork's rows and continuation stay its own."""
    model = ReferenceModel(tiny, kv_slots=4)
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(3, TINY.vocab_size, (520,), generator=gen).tolist()
    other = torch.randint(3, TINY.vocab_size, (300,), generator=gen).tolist()
    parent = model.new_state()
    model.forward(prompt[:200], parent, all_logits=False)
    early = parent.snapshot()
    model.forward(prompt[200:], parent, all_logits=False)
    twin = copy.deepcopy(parent)
    want = rows_of(twin, TINY.n_layers)
    parent.restore(early)
    model.forward(other, parent, all_logits=False)  # rows 50..124 of ratio 4: pages 0 and 1, both shared
    assert rows_of(twin, TINY.n_layers).keys() == want.keys()
    for name, rows in rows_of(twin, TINY.n_layers).items():
        assert np.array_equal(rows, want[name]), name
    fresh, redone = model.new_state(), model.new_state()  # the same chunks, never forked
    for state, tail in ((fresh, prompt[200:]), (redone, other)):
        model.forward(prompt[:200], state, all_logits=False)
        model.forward(tail, state, all_logits=False)
    assert torch.equal(model.forward([7], twin), model.forward([7], fresh))
    assert torch.equal(model.forward([7], parent), model.forward([7], redone))


def test_a_fork_the_cache_puts_in_another_block_gets_copies(tiny):
    """Pools are per cache block: a fork placed in a new block (the first is full) copies the rows."""
    model = ReferenceModel(tiny, kv_slots=1)
    parent = model.new_state()
    model.forward(list(range(3, 303)), parent, all_logits=False)
    twin = copy.deepcopy(parent)
    assert twin.block != parent.block
    for name, rows in rows_of(parent, TINY.n_layers).items():
        assert np.array_equal(rows_of(twin, TINY.n_layers)[name], rows), name
    assert torch.equal(model.forward([9], twin), model.forward([9], copy.deepcopy(parent)))


def test_a_key_writes_image_ids_apart_from_any_text():
    """`tokens_key`: text decodes as text, an image id as 0xFF, hex, 0xFF (no UTF-8 text holds 0xFF);
    a prefix's key is a prefix of the key, and another image differs at its first id."""
    from dwarfstar.kvcache.kvstore import tokens_key

    def decode(tokens):
        return "".join(chr(97 + t) for t in tokens).encode()

    text, image, other = [0, 1, 2], [1000, 1001], [1000, 1002]
    key = tokens_key(decode, 26, text + image + text)
    assert key == b"abc\xff3e8\xff\xff3e9\xffabc"
    for n in range(8):
        assert key.startswith(tokens_key(decode, 26, (text + image + text)[:n]))
    assert not tokens_key(decode, 26, text + other).startswith(tokens_key(decode, 26, text + image))
    assert tokens_key(decode, 26, text) == b"abc"


def test_a_payload_keeps_image_ids_and_refuses_ids_past_them(tiny):
    from dwarfstar.model.image_spans import IMAGE_IDS

    model = ReferenceModel(tiny)
    state = model.new_state()
    model.forward([5, 6, 7], state)
    state.tokens[1] = TINY.vocab_size + 12345  # an image block's id: the payload keeps it
    buf = io.BytesIO()
    write_payload(buf, state, TINY, 4096, 64)
    assert read_payload(buf.getvalue(), TINY, 4096, 64, model.new_state).tokens == [5, TINY.vocab_size + 12345, 7]
    state.tokens[1] = IMAGE_IDS
    buf = io.BytesIO()
    write_payload(buf, state, TINY, 4096, 64)
    with pytest.raises(PayloadError, match="outside the vocabulary"):
        read_payload(buf.getvalue(), TINY, 4096, 64, model.new_state)
