"""A route of Triton stages (Triton's interpreter on the CPU here, so marked slow): each stage loads
only its slice, and the route's logits are the one-process Triton logits bit for bit."""

from __future__ import annotations

import pytest
import torch
from conftest import CTX, Cluster

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec

PROMPT = [0, 17, 42, 7, 99, 1000, 5, 31]


@pytest.mark.slow
def test_triton_route_matches_one_process(tiny_model_file, tmp_path):
    path = tiny_model_file(0)
    cluster = Cluster(path, ["0:3", "3:output"], tmp_path, cli=True, backend="triton")
    try:
        single = load_engine(EngineSpec(path, "triton", ctx=CTX)).backend
        alone = single.new_state()
        want = single.forward(PROMPT, alone, all_logits=True)
        cluster.connect(load_engine(EngineSpec(path, "triton", ctx=CTX, layers=(0, 3))))
        local = cluster.route.local
        assert local.layer_range == range(0, 3) and local.w.output is None and sorted(local.w.layers) == [0, 1, 2]
        routed = cluster.backend.new_state()
        assert torch.equal(cluster.backend.forward(PROMPT, routed, all_logits=True), want)
        assert torch.equal(cluster.backend.forward([5], routed, False), single.forward([5], alone, False))
    finally:
        cluster.close()
