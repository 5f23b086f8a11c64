"""MLX attention is really sparse: a query reads its raw window and only the compressed rows it may.

On the tiny model (raw window 8, indexer top-4, ratio-4 layers 2 and 4, ratio-128 layers 3 and 5)
a decode step at position 300 has 75 ratio-4 rows and 2 ratio-128 rows. Each attention call is
recorded at `ops.sink_attention`, the one place keys reach the attention: a ratio-4 layer must hand
it window + top_k rows per query (gathered by the indexer's choice), a ratio-128 layer window + its
2 rows, a window-only layer the 8 window rows; and the logits must still be the reference's, which
attends over all rows under a top-k mask.
"""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.mlx import attention, ops
from dwarfstar.backends.mlx.model import MLXModel
from dwarfstar.backends.mlx.parity import compare_logits
from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_synthetic_model

PROMPT = torch.randint(3, 120000, (301,), generator=torch.Generator().manual_seed(11)).tolist()
EXACT_REL = 1e-5  # QAT off: fp32 summation order only (test_mlx_model.py)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_synthetic_model(path, TINY, seed=2)
    model = open_model(path)
    return ReferenceModel(model, qat=False), MLXModel(model, qat=False)


def record_attention(monkeypatch) -> list[tuple[int, ...]]:
    """Make every `ops.sink_attention` call append the shape of the keys it was given."""
    shapes, real = [], ops.sink_attention

    def recording(q, kv, mask, sinks):
        shapes.append(tuple(kv.shape))
        return real(q, kv, mask, sinks)

    monkeypatch.setattr(ops, "sink_attention", recording)
    return shapes


def test_decode_attends_to_window_plus_top_k_rows(models, monkeypatch):
    reference, model = models
    args = model.args
    state = model.new_state()
    model.forward(PROMPT[:-1], state, all_logits=False)
    shapes = record_attention(monkeypatch)
    got = model.forward(PROMPT[-1:], state)
    position = len(PROMPT) - 1
    expected = []
    for layer in args.layers:
        ratio = layer.compress_ratio
        if ratio == 4:
            assert (position + 1) // ratio > args.index_topk  # the indexer really has to choose
            expected.append((1, args.window + args.index_topk, args.head_dim))  # per query, gathered
        else:
            expected.append((args.window + (position + 1) // ratio if ratio else args.window, args.head_dim))
    assert shapes == expected
    want = reference.forward(PROMPT, reference.new_state())[-1:]
    diff = compare_logits(want, got)
    assert diff.max_rel < EXACT_REL and diff.top1_agreement == 1.0, diff


@pytest.mark.parametrize("block", [1, 5])
def test_prefill_in_query_blocks_matches_reference(models, monkeypatch, block):
    """Blocks of queries see the same rows as one block: band masks and selections cut at any row."""
    reference, model = models
    monkeypatch.setattr(attention, "QUERY_BLOCK", block)
    shapes = record_attention(monkeypatch)
    prompt = PROMPT[:37]  # 9 ratio-4 rows: queries past position 19 choose 4 of them
    got = model.forward(prompt, model.new_state())
    assert len(shapes) == model.args.n_layers * -(-len(prompt) // block)
    # a block of B queries reads at most window + B - 1 raw rows plus its top-k (no ratio-128 row yet)
    args = model.args
    assert max(s[-2] for s in shapes) <= args.window + block - 1 + args.index_topk
    diff = compare_logits(reference.forward(prompt, reference.new_state()), got)
    assert diff.max_rel < EXACT_REL and diff.top1_agreement == 1.0, diff
