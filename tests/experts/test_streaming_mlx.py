"""MLX (exact packing, where MLX runs) with streamed experts: logits bit-identical to its resident
experts at 1, 2 and 10 experts per layer and full, prefill and decode."""

from __future__ import annotations

import numpy as np
import pytest

from dwarfstar.backends.mlx import mlx_available
from dwarfstar.experts.layout import ExpertLayout
from dwarfstar.experts.policy import make_policy
from dwarfstar.experts.store import ExpertStore
from dwarfstar.model.loader import open_model

pytestmark = pytest.mark.skipif(not mlx_available(), reason="MLX is not installed here")

PROMPT = [0, 17, 4242, 99, 12001, 7, 7, 7, 300, 55555, 1234, 8, 9, 10, 11, 40000, 2, 3, 600, 601]
DECODE = [77, 1000, 5]


def run(model) -> list[np.ndarray]:
    state = model.new_state()
    out = [model.forward(PROMPT, state, all_logits=True).numpy()]
    for token in DECODE:
        out.append(model.forward([token], state, all_logits=False).numpy())
    return out


@pytest.fixture(scope="module")
def model_file(tiny_k_path):
    return open_model(tiny_k_path)


@pytest.fixture(scope="module")
def resident(model_file) -> list[np.ndarray]:
    from dwarfstar.backends.mlx.model import MLXModel

    return run(MLXModel(model_file, packing="exact"))


@pytest.mark.parametrize("per_layer", [1, 2, 10, None], ids=["1", "2", "10", "full"])
def test_mlx_streamed_logits_equal_resident(model_file, resident, per_layer):
    from dwarfstar.backends.mlx.model import MLXModel
    from dwarfstar.backends.mlx.streaming import MLXStreamedExperts

    args = model_file.args
    layout = ExpertLayout.of(model_file.gguf, args)
    store = ExpertStore(layout, (per_layer or args.n_routed_experts) * args.n_layers, make_policy("ds4", 48))
    model = MLXModel(model_file, packing="exact")
    model.experts = MLXStreamedExperts(store, "exact")
    try:
        streamed = run(model)
    finally:
        store.close()
    for got, want in zip(streamed, resident, strict=True):
        assert np.array_equal(got, want)
    assert set(model.experts.packed) <= set(store.where)  # an evicted expert's packed copy is gone
    assert store.stats.misses >= len(store.where) > 0
