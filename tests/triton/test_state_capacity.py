"""A state restored from a ds4 payload keeps the invariant graph capture relies on.

Kernels are specialised on integer arguments divisible by 16, and a captured decode step bakes in
its buffers' addresses, so the Triton backend keeps every row buffer's capacity a multiple of 64
(`ROW_CAPACITY_STEP`). A payload holds exactly a state's rows: read back, its buffers have capacity
n, which the backend must regrow to the step before its first launch.
"""

from __future__ import annotations

import io

import torch

from dwarfstar.backends.triton import load_backend
from dwarfstar.backends.triton.model import ROW_CAPACITY_STEP
from dwarfstar.model.loader import open_model
from dwarfstar.session.payload import read_payload, write_payload

PROMPT = list(range(3, 3 + 41))  # 41 tokens: ratio-4 layers hold 10 rows, not a multiple of 64


def capacities(state) -> list[int]:
    return [c.rows.data.shape[0] for layer in state.layers for c in (layer.compressor, layer.indexer) if c is not None]


def test_rows_read_from_a_payload_are_regrown_to_the_capacity_step(tiny_model_file) -> None:
    backend = load_backend(open_model(tiny_model_file(0)), device="cpu")
    state = backend.new_state()
    backend.forward(PROMPT, state, all_logits=False)
    buffer = io.BytesIO()
    write_payload(buffer, state, backend.args, ctx=1024, chunk=64)
    restored = read_payload(buffer.getvalue(), backend.args, 1024, 64)
    assert any(c % ROW_CAPACITY_STEP for c in capacities(restored))  # the payload breaks the invariant
    want = backend.forward([7], state, all_logits=False)
    got = backend.forward([7], restored, all_logits=False)
    assert all(c % ROW_CAPACITY_STEP == 0 for c in capacities(restored))
    assert torch.equal(want, got)
