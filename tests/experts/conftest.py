"""Fixtures of the expert-streaming tests: small model files with quantized experts."""

from __future__ import annotations

from pathlib import Path

import pytest

from dwarfstar.model.bundled import default_model_path
from dwarfstar.model.synthetic import TINY_K, write_synthetic_model


@pytest.fixture(scope="session")
def tiny_k_path(tmp_path_factory) -> Path:
    """tiny-k in ds4's layout: IQ2_XXS gate/up and Q2_K down experts, as the q2 files store them."""
    path = tmp_path_factory.mktemp("tiny-k") / "tiny-k.gguf"
    write_synthetic_model(path, TINY_K, layout="ds4", seed=3)
    return path


@pytest.fixture(scope="session")
def nano_path() -> Path:
    """The bundled trained nano model (Q8_0 experts)."""
    return default_model_path()
