"""`dwarfstar quantize` and `dwarfstar quality`: ds4's recipes on whole files, and bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dwarfstar.cli import main
from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import GGMLType, ValueType
from dwarfstar.gguf.quantize import quantize
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model.config import flash_compress_ratios
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, TINY_K, write_synthetic_model
from dwarfstar.quant.imatrix import Imatrix, ImatrixError, write_imatrix
from dwarfstar.quant.recipes import RecipeError, quantize_model, recipe_types

T = GGMLType
# tiny-k with 4 experts: K-quant-sized rows, and half the quantizing work for the suite
SMALL = TINY_K.with_(n_routed_experts=4)


def run_cli(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["dwarfstar", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("quant") / "tiny-k-f32.gguf"
    write_synthetic_model(path, SMALL, layout="f32", seed=0)
    return path


@pytest.fixture(scope="module")
def skewed_imatrix(f32_model: Path) -> Imatrix:
    gen = torch.Generator().manual_seed(0)
    with GGUFFile(f32_model) as gguf:
        entries = {
            name: torch.randn(info.shape[0] * info.shape[2], generator=gen).mul(1.5).exp()
            for name, info in gguf.tensors.items()
            if name.endswith("_exps.weight")
        }
    return Imatrix(entries, chunks=3, dataset="prompts.jsonl", source="skewed.dat")


def test_recipes_put_ds4_types_on_the_tensors() -> None:
    args = TINY_K.with_(n_layers=8, compress_ratios=flash_compress_ratios(8))
    experts = {
        "q2": [(T.IQ2_XXS, T.Q2_K)] * 8,
        "q2-q4": [(T.IQ2_XXS, T.Q2_K)] * 2 + [(T.Q4_K, T.Q4_K)] * 6,  # the last six layers
        "q4": [(T.Q4_K, T.Q4_K)] * 8,
        "q8": [(T.Q8_0, T.Q8_0)] * 8,
    }
    fixed = {
        "token_embd.weight": T.F16,
        "output.weight": T.Q8_0,
        "output_hc_fn.weight": T.F16,
        "output_norm.weight": T.F32,
        "blk.2.hc_attn_fn.weight": T.F16,
        "blk.2.hc_attn_scale.weight": T.F32,
        "blk.2.attn_q_a.weight": T.Q8_0,
        "blk.2.attn_output_b.weight": T.Q8_0,
        "blk.2.attn_kv_a_norm.weight": T.F32,
        "blk.2.attn_compressor_kv.weight": T.F16,
        "blk.2.indexer.attn_q_b.weight": T.F16,
        "blk.2.ffn_gate_inp.weight": T.F16,
        "blk.2.ffn_down_shexp.weight": T.Q8_0,
        "blk.1.ffn_gate_tid2eid.weight": T.I32,
        "blk.5.exp_probs_b.bias": T.F32,
    }
    for recipe, per_layer in experts.items():
        types = recipe_types(args, recipe)
        for layer, (gate_up, down) in enumerate(per_layer):
            assert types[f"blk.{layer}.ffn_gate_exps.weight"] == gate_up
            assert types[f"blk.{layer}.ffn_up_exps.weight"] == gate_up
            assert types[f"blk.{layer}.ffn_down_exps.weight"] == down
        assert {name: types[name] for name in fixed} == fixed


def test_recipe_errors_are_clear() -> None:
    with pytest.raises(RecipeError, match="unknown recipe 'q3'.*q2, q2-q4, q4, q8"):
        recipe_types(TINY_K, "q3")
    with pytest.raises(RecipeError, match="multiples of 256.*64 wide"):
        recipe_types(TINY, "q4")  # hidden 64 cannot hold K-quant super-blocks
    assert recipe_types(TINY, "q8")["blk.0.ffn_down_exps.weight"] == T.Q8_0


def test_quantize_streams_the_recipe_with_the_imatrix(f32_model: Path, skewed_imatrix: Imatrix, tmp_path) -> None:
    out = tmp_path / "q2.gguf"
    quantize_model(f32_model, out, "q2", skewed_imatrix)
    src, dst = GGUFFile(f32_model), open_model(out)  # open_model validates every tensor
    planned = recipe_types(SMALL, "q2")
    assert {name: info.ggml_type for name, info in dst.gguf.tensors.items()} == planned
    # metadata and tokenizer carried over, the recipe and imatrix stated
    for key, value in src.metadata.items():
        assert dst.gguf.metadata[key] == value, key
    assert dst.gguf.metadata["quantize.recipe"] == "q2"
    assert dst.gguf.metadata["quantize.imatrix.file"] == "skewed.dat"
    assert dst.gguf.metadata["quantize.imatrix.chunks_count"] == 3
    assert dst.gguf.metadata_types["quantize.imatrix.entries_count"][0] == ValueType.UINT64
    # each expert got its own slice of the imatrix; float tensors went through the plain encoders
    name = "blk.4.ffn_down_exps.weight"
    values = src.tensor(name)
    importance = skewed_imatrix.entries[name].reshape(values.shape[0], 1, values.shape[2])
    np.testing.assert_array_equal(
        dst.gguf.raw(name).reshape(values.shape[0], -1),
        quantize(values, T.Q2_K, importance).reshape(values.shape[0], -1),
    )
    np.testing.assert_array_equal(dst.gguf.raw("blk.0.attn_norm.weight"), src.raw("blk.0.attn_norm.weight"))
    np.testing.assert_array_equal(
        dst.gguf.raw("token_embd.weight"), quantize(src.tensor("token_embd.weight"), T.F16).reshape(-1)
    )
    dst.close()
    src.close()


def test_requantizing_to_the_same_type_copies_bytes(f32_model: Path, tmp_path) -> None:
    q8 = tmp_path / "q8.gguf"
    quantize_model(f32_model, q8, "q8")
    again = tmp_path / "q8-again.gguf"
    quantize_model(q8, again, "q8")
    with GGUFFile(q8) as a, GGUFFile(again) as b:
        assert all(np.array_equal(a.raw(name), b.raw(name)) for name in a.tensors)


def test_quantize_cli_rejects_bad_input(f32_model: Path, tmp_path, monkeypatch, capsys) -> None:
    assert run_cli(monkeypatch, "quantize", str(f32_model), str(tmp_path / "x.gguf"), "--recipe", "q3") == 2
    assert "unknown recipe 'q3'" in capsys.readouterr().err

    other = tmp_path / "llama.gguf"
    with GGUFWriter(other, {"general.architecture": (ValueType.STRING, "llama")}) as writer:
        writer.add_tensor("token_embd.weight", (4, 32), T.F32)
        writer.write_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    assert run_cli(monkeypatch, "quantize", str(other), str(tmp_path / "y.gguf"), "--recipe", "q2") == 2
    assert "not a DeepSeek V4 model" in capsys.readouterr().err
    with pytest.raises(ModelFileError):
        quantize_model(other, tmp_path / "y.gguf", "q2")

    # an imatrix made for a deeper model, and one made for narrower experts
    for entries, problem in (
        ({"blk.9.ffn_up_exps.weight": torch.ones(4 * 256)}, "not a tensor of this model"),
        ({"blk.0.ffn_up_exps.weight": torch.ones(4 * 64)}, "has 256 values.*needs 1024"),
    ):
        dat = tmp_path / "other.dat"
        write_imatrix(dat, Imatrix(entries))
        argv = ("quantize", str(f32_model), str(tmp_path / "z.gguf"), "--recipe", "q2", "--imatrix", str(dat))
        assert run_cli(monkeypatch, *argv) == 2
        assert problem.split(".*")[0] in capsys.readouterr().err
        with pytest.raises(ImatrixError, match=problem):
            quantize_model(f32_model, tmp_path / "z.gguf", "q2", Imatrix(entries))
    assert not list(tmp_path.glob("[xyz].gguf*"))  # nothing half-written is left behind


def test_quality_orders_the_recipes(f32_model: Path, tmp_path, monkeypatch, capsys) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"id": "btree", "prompt": "Explain B-tree insertion, including splits and the root case."})
        + "\n"
        + json.dumps({"id": "haiku", "prompt": "Write a haiku about a lighthouse keeper."})
        + "\n"
    )
    figures = {}
    for recipe in ("q8", "q4"):
        path = tmp_path / f"{recipe}.gguf"
        quantize_model(f32_model, path, recipe)
        assert run_cli(monkeypatch, "quality", str(f32_model), str(path), "--prompts", str(prompts), "--json") == 0
        figures[recipe] = json.loads(capsys.readouterr().out)
    q8, q4 = figures["q8"], figures["q4"]
    assert [p["id"] for p in q8["prompts"]] == ["btree", "haiku"]
    assert q8["overall"]["positions"] == sum(p["positions"] for p in q8["prompts"])
    # 8-bit experts stay closer to the f32 model than 4-bit ones (both share the Q8_0/F16 rest)
    assert 0 < q8["overall"]["kl"] < q4["overall"]["kl"]
    assert q8["overall"]["top1"] >= q4["overall"]["top1"]
    assert q8["overall"]["ppl_ref"] == pytest.approx(q4["overall"]["ppl_ref"])
    # the same model against itself: no divergence at all
    assert run_cli(monkeypatch, "quality", str(f32_model), str(f32_model), "--prompts", str(prompts)) == 0
    overall = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert overall[0] == "overall" and float(overall[2]) == 0 and float(overall[3]) == 1
