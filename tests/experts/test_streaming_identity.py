"""Streamed experts give logits bit-identical to resident ones, at every cache budget.

The budgets are 1, 2 and 10 experts per layer (one cache shared by all layers, as ds4's is) and
the whole model; a prefill longer than the smallest cache (so the chunk's experts load in waves)
and decode steps after it. The reference backend; its resident MoE reads the same file bytes.
"""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.experts.attach import reference_expert
from dwarfstar.experts.layout import ExpertLayout
from dwarfstar.experts.policy import make_policy
from dwarfstar.experts.source import StreamingExperts
from dwarfstar.experts.store import ExpertStore
from dwarfstar.model.loader import open_model

PROMPT = [0, 17, 4242, 99, 12001, 7, 7, 7, 300, 55555, 1234, 8, 9, 10, 11, 40000, 2, 3, 600, 601]
DECODE = [77, 1000, 5, 64000, 123]


def run(model: ReferenceModel) -> list[torch.Tensor]:
    state = model.new_state()
    out = [model.forward(PROMPT, state, all_logits=True)]
    for token in DECODE:
        out.append(model.forward([token], state, all_logits=False))
    return out


@pytest.fixture(scope="module", params=["tiny_k_path", "nano_path"])
def model_file(request):
    return open_model(request.getfixturevalue(request.param))


@pytest.fixture(scope="module")
def resident(model_file) -> list[torch.Tensor]:
    return run(ReferenceModel(model_file))


@pytest.mark.parametrize("per_layer", [1, 2, 10, None], ids=["1", "2", "10", "full"])
@pytest.mark.parametrize("policy", ["ds4", "lfu", "lru"])
def test_streamed_logits_equal_resident(model_file, resident, per_layer, policy):
    args = model_file.args
    layout = ExpertLayout.of(model_file.gguf, args)
    capacity = (per_layer or args.n_routed_experts) * args.n_layers
    store = ExpertStore(layout, capacity, make_policy(policy, layout.total_experts))
    model = ReferenceModel(model_file)
    model.experts = StreamingExperts(store, reference_expert)
    try:
        streamed = run(model)
    finally:
        store.close()
    for got, want in zip(streamed, resident, strict=True):
        assert torch.equal(got, want)
    stats = store.stats
    assert stats.tokens == len(PROMPT) + len(DECODE)
    assert len(store.where) <= store.capacity
    assert stats.misses * layout.max_expert_bytes >= stats.bytes_read > 0
    if capacity >= layout.total_experts:  # nothing is ever evicted: one read per distinct expert used
        assert stats.misses == len(store.where)
    else:  # these models have 8 experts a layer: 1 or 2 per layer must re-read
        assert stats.misses > store.capacity
