"""Models with MXFP4 routed experts: the synthetic ds4-mxfp4 layout, the mxfp4 recipe, and the reference
backend running them against the same experts expanded to F32 up front."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.gguf.constants import GGMLType
from dwarfstar.gguf.dequant import MXFP4ScaleError, dequantize
from dwarfstar.gguf.quantize import quantize
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.quant.recipes import quantize_model

MX = GGMLType.MXFP4
ARGS = TINY.with_(n_layers=2, compress_ratios=TINY.compress_ratios[:2], n_hash_layers=1)
PROMPT = [5, 17, 300, 42, 7, 9]


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mxfp4") / "tiny-mxfp4.gguf"
    write_synthetic_model(path, ARGS, layout="ds4-mxfp4", seed=3)
    return path


def rewrite(src: Path, dst: Path, change) -> None:
    """A copy of `src` whose tensors are `change(name, ggml_type, raw)` -> (type, bytes)."""
    with GGUFFile(src) as gguf, GGUFWriter(dst, gguf.typed_metadata()) as writer:
        new = {name: change(name, info.ggml_type, gguf.raw(name)) for name, info in gguf.tensors.items()}
        for name, (ggml_type, _) in new.items():
            writer.add_tensor(name, gguf.tensors[name].shape, ggml_type)
        for name, (_, data) in new.items():
            writer.write_tensor(name, [data])


def greedy(path: Path, steps: int = 3) -> tuple[torch.Tensor, list[int]]:
    model = ReferenceModel(open_model(path))
    state = model.new_state()
    logits, tokens = [model.forward(PROMPT, state)], []
    for _ in range(steps):
        tokens.append(int(state.logits.argmax()))
        logits.append(model.forward([tokens[-1]], state))
    return torch.cat(logits), tokens


def test_synthetic_layout_puts_every_routed_expert_in_mxfp4(mxfp4_model: Path) -> None:
    with GGUFFile(mxfp4_model) as gguf:
        types = {name: info.ggml_type for name, info in gguf.tensors.items() if name.endswith("_exps.weight")}
    assert len(types) == 3 * ARGS.n_layers and set(types.values()) == {MX}


def test_reference_runs_mxfp4_experts_as_their_f32_expansion(mxfp4_model: Path, tmp_path: Path) -> None:
    def expand(name, ggml_type, raw):
        if ggml_type != MX:
            return ggml_type, raw
        return GGMLType.F32, dequantize(raw, MX, raw.size // 17 * 32).numpy()

    f32_experts = tmp_path / "f32-experts.gguf"
    rewrite(mxfp4_model, f32_experts, expand)
    logits, tokens = greedy(mxfp4_model)
    want_logits, want_tokens = greedy(f32_experts)
    assert tokens == want_tokens
    assert torch.isfinite(logits).all() and torch.equal(logits, want_logits)


def test_nan_exponent_in_an_expert_is_a_named_error(mxfp4_model: Path, tmp_path: Path) -> None:
    def damage(name, ggml_type, raw):
        if name != "blk.1.ffn_down_exps.weight":
            return ggml_type, raw
        raw = raw.copy()
        raw.reshape(-1, 17)[5, 0] = 0xFF
        return ggml_type, raw

    damaged = tmp_path / "damaged.gguf"
    rewrite(mxfp4_model, damaged, damage)
    with pytest.raises(MXFP4ScaleError, match="0xFF"):
        greedy(damaged, steps=0)


def test_mxfp4_recipe_quantizes_other_experts_and_copies_mxfp4(mxfp4_model: Path, tmp_path: Path) -> None:
    f32 = tmp_path / "f32.gguf"
    write_synthetic_model(f32, ARGS, layout="f32", seed=4)
    out, again = tmp_path / "mx.gguf", tmp_path / "mx-again.gguf"
    quantize_model(f32, out, "mxfp4")
    quantize_model(mxfp4_model, again, "mxfp4")
    name = "blk.0.ffn_gate_exps.weight"
    with GGUFFile(f32) as src, GGUFFile(out) as dst:
        assert dst.tensors[name].ggml_type == MX
        assert np.array_equal(dst.raw(name).reshape(-1), quantize(src.tensor(name), MX).reshape(-1))
    with GGUFFile(mxfp4_model) as a, GGUFFile(again) as b:
        assert all(np.array_equal(a.raw(n), b.raw(n)) for n in a.tensors)
