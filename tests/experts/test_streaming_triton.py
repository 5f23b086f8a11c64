"""The Triton backend (on the GPU where there is one, else in Triton's interpreter) with streamed
experts: logits bit-identical to its resident experts, for a prefill and decode steps, with a cache
smaller than one layer's experts (the prefill's experts load in a window, copied out one by one) and
with every expert cached (one gather per call). The routed experts are never uploaded, and the
backend runs without graphs."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.triton import load_backend
from dwarfstar.backends.triton.streaming import TritonStreamedExperts
from dwarfstar.experts.layout import ExpertLayout
from dwarfstar.experts.policy import make_policy
from dwarfstar.experts.store import ExpertStore
from dwarfstar.model.loader import open_model

PROMPT = [0, 17, 4242, 99, 12001, 7, 300, 55555]
DECODE = [77, 1000]


def run(backend) -> list[torch.Tensor]:
    state = backend.new_state()
    out = [backend.forward(PROMPT, state, all_logits=True)]
    for token in DECODE:
        out.append(backend.forward([token], state, all_logits=False))
    return out


@pytest.fixture(scope="module")
def model_file(tiny_k_path):
    return open_model(tiny_k_path)


@pytest.fixture(scope="module")
def resident(model_file) -> list[torch.Tensor]:
    return run(load_backend(model_file, max_seq_len=64))


@pytest.mark.parametrize("per_layer", [1, None], ids=["1", "full"])
def test_triton_streamed_logits_equal_resident(model_file, resident, per_layer):
    args = model_file.args
    layout = ExpertLayout.of(model_file.gguf, args)
    backend = load_backend(model_file, max_seq_len=64, stream_experts=True)
    assert backend.graphs is None
    assert all(lw.gate_exps is None and lw.down_exps is None for lw in backend.w.layers.values())
    store = ExpertStore(layout, (per_layer or args.n_routed_experts) * args.n_layers, make_policy("ds4", 48))
    backend.experts = TritonStreamedExperts(store, backend.device)
    try:
        streamed = run(backend)
    finally:
        store.close()
    for got, want in zip(streamed, resident, strict=True):
        assert torch.equal(got, want)
    stats = store.stats
    assert stats.tokens == len(PROMPT) + len(DECODE)
    if per_layer is None:  # every expert read once, uploaded once
        assert stats.misses == len(store.where) > 0
    else:  # 8 experts a layer in a cache of 6: re-reads
        assert stats.misses > store.capacity
    # the device pool holds the budget; the store's host copy of each uploaded expert was handed back
    pool = backend.experts.pool
    assert [p.shape[0] for p in pool] == [store.capacity] * 3
    assert all(not store.slots[slot].any() for slot in store.where.values())
