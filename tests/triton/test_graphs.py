"""CUDA-graph decode steps against the eager kernels (needs a CUDA or ROCm device)."""

from __future__ import annotations

import pytest
import torch

from dwarfstar.backends.triton.backend import TritonBackend
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_synthetic_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA or ROCm device")


def test_graph_steps_equal_eager_steps_across_emission_shapes(tmp_path):
    """Decode from position 120 to 140: ratio-4 rows every 4th step, the first ratio-128 row at 127;
    then a snapshot restore, which writes into the state's slot: the same graphs replay."""
    path = tmp_path / "tiny.gguf"
    write_synthetic_model(path, TINY, seed=5)
    model = open_model(path)
    eager = TritonBackend.from_model_file(model, device="cuda", graphs=False)
    graphed = TritonBackend.from_model_file(model, device="cuda")
    prompt = torch.randint(3, 120000, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    s_eager, s_graph = eager.new_state(), graphed.new_state()
    eager.forward(prompt, s_eager)
    graphed.forward(prompt, s_graph)
    tokens = []
    for _ in range(20):
        token = int(s_eager.logits.argmax())
        tokens.append(token)
        want = eager.forward([token], s_eager)
        got = graphed.forward([token], s_graph)
        assert torch.equal(got, want), s_eager.pos
    assert graphed.graphs.captured, "no step was replayed from a graph"
    snap = s_graph.snapshot()
    first = [graphed.forward([t], s_graph) for t in tokens[:6]]
    captured = len(graphed.graphs.captured)
    s_graph.restore(snap)
    again = [graphed.forward([t], s_graph) for t in tokens[:6]]
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    assert len(graphed.graphs.captured) == captured
