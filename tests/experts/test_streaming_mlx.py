"""MLX (exact packing, where MLX runs) with streamed experts: logits bit-identical to its resident
experts at 1, 2 and 10 experts per layer and full, prefill and decode; a streamed model does not
pack the routed experts at load, so its memory is smaller by at least their size."""

from __future__ import annotations

import numpy as np
import pytest

from dwarfstar.experts.layout import ExpertLayout
from dwarfstar.experts.policy import make_policy
from dwarfstar.experts.store import ExpertStore
from dwarfstar.model.loader import open_model

mx = pytest.importorskip("mlx.core", reason="MLX is not installed here")

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


def active_bytes_after_a_call(model_file, routed_experts: bool, capacity: int) -> int:
    """MLX's allocated bytes once a model is loaded and has run one call (lazy arrays evaluated)."""
    from dwarfstar.backends.mlx.model import MLXModel
    from dwarfstar.backends.mlx.streaming import MLXStreamedExperts

    mx.clear_cache()
    before = mx.get_active_memory()
    model = MLXModel(model_file, packing="exact", routed_experts=routed_experts)
    store = None
    if not routed_experts:
        layout = ExpertLayout.of(model_file.gguf, model_file.args)
        store = ExpertStore(layout, capacity, make_policy("ds4", layout.total_experts))
        model.experts = MLXStreamedExperts(store, "exact")
    try:
        model.forward(PROMPT[:4], model.new_state(), all_logits=False)
        return mx.get_active_memory() - before
    finally:
        if store is not None:
            store.close()


def test_streaming_does_not_pack_every_expert(model_file):
    from dwarfstar.backends.mlx.model import MLXModel

    assert MLXModel(model_file, packing="exact", routed_experts=False).experts is None
    layout = ExpertLayout.of(model_file.gguf, model_file.args)
    resident = active_bytes_after_a_call(model_file, True, 0)
    streamed = active_bytes_after_a_call(model_file, False, 2 * model_file.args.n_layers)
    # the resident exact packing holds every routed expert at least at its file size (Q2_K as float32)
    assert resident - streamed >= layout.routed_bytes


def test_block_experts_stack_as_the_resident_tensor(model_file):
    """The Metal packing (GGUF blocks, read in place): a stack of single streamed experts holds the
    same blocks, shape and expert count as the resident [E, out, in] tensor (the kernels need Metal,
    the stacking does not)."""
    from dwarfstar.backends.mlx.metal import BlockMatrix
    from dwarfstar.backends.mlx.weights import concat_experts
    from dwarfstar.model.tensors import EXPERTS, layer_tensor

    gguf = model_file.gguf
    for name in EXPERTS:
        info = gguf.tensors[layer_tensor(1, name)]
        whole = BlockMatrix.from_gguf(gguf.raw(info.name), info.ggml_type, info.shape)
        slab = info.nbytes // info.shape[0]
        singles = [
            BlockMatrix.from_gguf(gguf.raw(info.name)[e * slab : (e + 1) * slab], info.ggml_type, (1, *info.shape[1:]))
            for e in range(info.shape[0])
        ]
        stacked = concat_experts(singles)
        assert (stacked.experts, stacked.rows, stacked.cols) == (whole.experts, whole.rows, whole.cols)
        assert np.array_equal(np.array(stacked.blocks), np.array(whole.blocks))
