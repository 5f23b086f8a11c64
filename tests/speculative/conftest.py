"""Fixtures of the speculative-decoding tests: a small synthetic model with an MTP block, in both
file layouts, and the backends that can run it here (reference; MLX on the CPU where it imports).

The model is `tiny` cut to 4 layers (window-only, window-only, ratio 4, ratio 128) with its raw
window of 8, so a 20-token prompt and 300 generated tokens wrap the window many times and cross
the first ratio-128 boundary (position 128), at a fraction of the 6-layer model's cost.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.config import flash_compress_ratios
from dwarfstar.model.synthetic import TINY, write_synthetic_model, write_synthetic_mtp

SMALL = TINY.with_(n_layers=4, compress_ratios=flash_compress_ratios(4))
SEED = 4
PROMPT = torch.randint(3, 120000, (20,), generator=torch.Generator().manual_seed(11)).tolist()


def _backend_params() -> list:
    from dwarfstar.backends.mlx import mlx_available

    mlx = [] if mlx_available() else [pytest.mark.skip(reason="mlx does not import (pip install mlx[cpu])")]
    return [pytest.param("reference", id="reference"), pytest.param("mlx", id="mlx-cpu", marks=mlx)]


@pytest.fixture(scope="session")
def mtp_files(tmp_path_factory) -> dict[str, Path]:
    """'nextn': the model with its MTP block in-file (llama.cpp); 'plain': the same trunk without one;
    'ds4': a separate MTP file for that trunk; 'other': a separate MTP file for a wider model."""
    root = tmp_path_factory.mktemp("mtp")
    paths = {name: root / f"{name}.gguf" for name in ("nextn", "plain", "ds4", "other")}
    write_synthetic_model(paths["nextn"], SMALL, seed=SEED, in_file_mtp=True)
    write_synthetic_model(paths["plain"], SMALL, seed=SEED)
    write_synthetic_mtp(paths["ds4"], SMALL, seed=SEED)
    write_synthetic_mtp(paths["other"], SMALL.with_(dim=128), seed=SEED)
    return paths


@pytest.fixture(scope="session", params=_backend_params())
def backend_name(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def engines(mtp_files) -> Callable[[str, str], object]:
    """engines(backend, file) -> the engine over that file, loaded once per session."""
    from dwarfstar.engine.load import load_engine

    cache: dict[tuple[str, str], object] = {}

    def get(backend: str, file: str = "nextn"):
        if (backend, file) not in cache:
            cache[backend, file] = load_engine(EngineSpec(mtp_files[file], backend=backend, ctx=1024))
        return cache[backend, file]

    return get


@pytest.fixture(scope="session")
def seeing(tmp_path_factory):
    """The bundled model with a random vision encoder of its width (its image router biases random too)."""
    from dataclasses import replace

    from dwarfstar.engine.load import load_engine
    from dwarfstar.engine.spec import EngineSpec
    from dwarfstar.model.bundled import default_model_path
    from dwarfstar.model.synthetic import write_synthetic_vision
    from dwarfstar.model.vision import VISION_TINY
    from dwarfstar.model.vision_file import RouterShape

    encoder = tmp_path_factory.mktemp("nano-vision") / "encoder.gguf"
    write_synthetic_vision(encoder, replace(VISION_TINY, out_dim=96), seed=3, router=RouterShape(6, 8, 2))
    return load_engine(EngineSpec(default_model_path(), "reference", ctx=512, vision=encoder))
