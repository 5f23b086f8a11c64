"""The MLX backend through the engine: `--backend mlx` loads it anywhere MLX imports, `auto` only with Metal."""

from __future__ import annotations

import pytest

from dwarfstar.backends import mlx as mlx_backend
from dwarfstar.backends import registry
from dwarfstar.backends.mlx.model import MLXModel
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.session.session import Session


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_synthetic_model(path, TINY, seed=3)
    return path


def test_mlx_backend_loads_and_runs_through_the_engine(model_path, monkeypatch):
    monkeypatch.delenv(mlx_backend.PACKING_ENV, raising=False)
    loaded = load_engine(EngineSpec(model_path, backend="mlx"))
    assert loaded.backend_name == "mlx" and isinstance(loaded.backend, MLXModel)
    expected = "blocks" if mlx_backend.metal_available() else "exact"
    assert loaded.backend.packing == expected
    session = Session(loaded.backend, ctx=256, chunk=32)
    logits = session.prefill(loaded.tokenizer.encode("hello world"))
    assert logits.shape == (TINY.vocab_size,) and session.state.pos == len(session.tokens)


@pytest.mark.parametrize("metal", [True, False])
def test_auto_prefers_mlx_only_with_metal(monkeypatch, metal):
    monkeypatch.setattr(mlx_backend, "metal_available", lambda: metal)
    monkeypatch.setattr(registry.Triton, "available", lambda self: False)
    assert registry.pick_backend("auto") == ("mlx" if metal else "reference")
    assert registry.pick_backend("mlx") == "mlx"


def test_packing_override_and_unknown_packing(model_path, monkeypatch):
    monkeypatch.setenv(mlx_backend.PACKING_ENV, "affine4")
    assert mlx_backend.default_packing() == "affine4"
    with pytest.raises(DwarfStarError, match="unknown MLX weight packing 'q3'"):
        MLXModel(open_model(model_path), packing="q3")
