"""The backend-owned KV cache: fixed slots, the raw-window ring, snapshots and forks over slots."""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.loader import open_model
from dwarfstar.model.state import ROW_STEP, KVCache, SplitRows, TorchStorage, layer_compressors
from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.session.payload import PayloadError, read_payload, write_payload

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
    # every row part holds the whole context, in multiples of ROW_STEP
    rows = a.part(2, "attn_rows")
    assert rows.shape[0] % ROW_STEP == 0 and rows.shape[0] >= 1000 // 4
    pointer = rows.data_ptr()
    c = kv.new_state()  # a third sequence opens a second block; the first block's arrays stay put
    assert len(kv.blocks) == 2 and a.part(2, "attn_rows").data_ptr() == pointer
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
    rows = compact.part(ratio4, "attn_rows")
    nope = TINY.head_dim - TINY.rope_dim
    assert isinstance(rows, SplitRows) and rows.exact.dtype == torch.bfloat16 and rows.exact.shape[-1] == nope
    assert rows.rest.dtype == torch.float32 and compact.part(ratio4, "indexer_rows").dtype == torch.bfloat16
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
