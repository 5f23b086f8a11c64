"""A state restored from a ds4 payload lands in a fixed slot of the backend's KV cache.

Kernels are specialised on integer arguments divisible by 16, and a captured decode step bakes in
the addresses of a block's arrays, so every slot's page table reaches the whole context (a multiple
of `ROW_STEP` rows), the pool behind it is preallocated, and a payload read back is written into a
slot's pages rather than bringing arrays of its own.
"""

from __future__ import annotations

import io

import torch

from dwarfstar.backends.triton import load_backend
from dwarfstar.kvcache.payload import read_payload, write_payload
from dwarfstar.model.loader import open_model
from dwarfstar.model.pages import PAGE_ROWS
from dwarfstar.model.state import ROW_STEP, SplitRows

PROMPT = list(range(3, 3 + 41))  # 41 tokens: ratio-4 layers hold 10 rows, not a multiple of 64


def row_arrays(state) -> list[torch.Tensor]:
    """Every tensor holding rows; with QAT rounding the KV rows are a SplitRows of two tensors."""
    layers = range(state.cache.args.n_layers)
    parts = [array for il in layers for name, array in state.parts(il).items() if name.endswith("_rows")]
    return [t for rows in parts for t in ((rows.exact, rows.rest) if isinstance(rows, SplitRows) else (rows,))]


def test_a_state_read_from_a_payload_uses_a_slot_of_the_cache(tiny_model_file) -> None:
    backend = load_backend(open_model(tiny_model_file(0)), device="cpu")
    state = backend.new_state()
    backend.forward(PROMPT, state, all_logits=False)
    buffer = io.BytesIO()
    write_payload(buffer, state, backend.args, ctx=1024, chunk=64)
    restored = read_payload(buffer.getvalue(), backend.args, 1024, 64, backend.new_state)
    assert restored.cache is state.cache and restored.slot != state.slot
    for ratio in restored.cache.ratios:
        reach = restored.row_pages(ratio).table.shape[1] * PAGE_ROWS
        assert reach % ROW_STEP == 0 and reach >= backend.max_seq_len // ratio
    pointers = [rows.data_ptr() for rows in row_arrays(restored)]
    want = backend.forward([7], state, all_logits=False)
    got = backend.forward([7], restored, all_logits=False)
    assert [rows.data_ptr() for rows in row_arrays(restored)] == pointers  # nothing moved or grew
    assert torch.equal(want, got)
