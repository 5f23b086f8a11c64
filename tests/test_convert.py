"""`dwarfstar convert`: Hugging Face checkpoints (transformers and official layouts) -> ds4-layout GGUF.

The expected values come from the source files and from the spec's tables, restated here (the GGUF ->
checkpoint name table, an element-by-element FP8/FP4 decoder, the type policy), so the tests do not
trust the converter's own helpers.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import gguf as gguf_py
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dwarfstar.cli import main
from dwarfstar.convert import hf
from dwarfstar.convert.checkpoint import Checkpoint
from dwarfstar.convert.hf import convert_checkpoint, plan_conversion
from dwarfstar.convert.hf_config import model_args_from_hf_config
from dwarfstar.errors import ConfigError, DwarfStarError, ModelFileError
from dwarfstar.gguf.constants import GGMLType
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.tensors import expected_tensors

N_EXPERTS = 8
TINY_CONFIG = dict(
    vocab_size=129280,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=6,
    num_attention_heads=4,
    head_dim=128,
    q_lora_rank=32,
    n_routed_experts=N_EXPERTS,
    num_experts_per_tok=2,
    o_groups=2,
    o_lora_rank=32,
    index_n_heads=16,
    index_head_dim=64,
    index_topk=4,
    sliding_window=8,
    compress_ratios=[0, 0, 4, 128, 4, 128],
    num_hash_layers=3,
    partial_rotary_factor=32 / 128,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)
# The same model as ModelArgs, spelled out by hand: both config dialects must parse to exactly this.
TINY_ARGS = ModelArgs(
    n_layers=6,
    dim=64,
    n_heads=4,
    head_dim=128,
    rope_dim=32,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=32,
    n_routed_experts=N_EXPERTS,
    n_activated_experts=2,
    moe_inter_dim=32,
    n_hash_layers=3,
    window=8,
    compress_ratios=(0, 0, 4, 128, 4, 128),
    index_n_heads=16,
    index_head_dim=64,
    index_topk=4,
)

# Spec §4.3: GGUF name -> official checkpoint name (`{i}` = layer, `{e}` = expert).
_GLOBAL_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_hc_fn.weight": "hc_head_fn",
    "output_hc_scale.weight": "hc_head_scale",
    "output_hc_base.weight": "hc_head_base",
    "output_norm.weight": "norm.weight",
    "output.weight": "head.weight",
}
_LAYER_NAMES = {
    **{f"hc_{k}_{p}.weight": f"hc_{k}_{p}" for k in ("attn", "ffn") for p in ("fn", "scale", "base")},
    "attn_norm.weight": "attn_norm.weight",
    "attn_q_a.weight": "attn.wq_a.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight",
    "attn_q_b.weight": "attn.wq_b.weight",
    "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_sinks.weight": "attn.attn_sink",
    "attn_output_a.weight": "attn.wo_a.weight",
    "attn_output_b.weight": "attn.wo_b.weight",
    "attn_compressor_ape.weight": "attn.compressor.ape",
    "attn_compressor_kv.weight": "attn.compressor.wkv.weight",
    "attn_compressor_gate.weight": "attn.compressor.wgate.weight",
    "attn_compressor_norm.weight": "attn.compressor.norm.weight",
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "indexer_compressor_ape.weight": "attn.indexer.compressor.ape",
    "indexer_compressor_kv.weight": "attn.indexer.compressor.wkv.weight",
    "indexer_compressor_gate.weight": "attn.indexer.compressor.wgate.weight",
    "indexer_compressor_norm.weight": "attn.indexer.compressor.norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight",
    "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
    "ffn_gate_exps.weight": "ffn.experts.{e}.w1.weight",
    "ffn_up_exps.weight": "ffn.experts.{e}.w3.weight",
    "ffn_down_exps.weight": "ffn.experts.{e}.w2.weight",
    "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
    "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
}
# Spec §8.11: what transformers' save_pretrained calls the official names it renames.
_TRANSFORMERS_GLOBALS = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "head.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


def official_names(gguf_name: str) -> list[str]:
    if gguf_name in _GLOBAL_NAMES:
        return [_GLOBAL_NAMES[gguf_name]]
    _, layer, suffix = gguf_name.split(".", 2)
    pattern = f"layers.{layer}.{_LAYER_NAMES[suffix]}"
    return [pattern.format(e=e) for e in range(N_EXPERTS)] if "{e}" in pattern else [pattern]


def transformers_key(official: str) -> str:
    if official in _TRANSFORMERS_GLOBALS:
        return _TRANSFORMERS_GLOBALS[official]
    return "model." + official.replace(".attn.kv_norm.", ".attn.norm.")  # the save_pretrained quirk


def expected_values(gguf_name: str, tensors: dict[str, torch.Tensor], key=transformers_key) -> torch.Tensor:
    parts = [tensors[key(name)] for name in official_names(gguf_name)]
    return torch.stack(parts) if gguf_name.endswith("_exps.weight") else parts[0]


def as_stored_in_gguf(args: ModelArgs) -> ModelArgs:
    """GGUF keeps float hyperparameters as f32."""
    floats = {f.name: float(np.float32(getattr(args, f.name))) for f in dataclasses.fields(args) if f.type == "float"}
    return dataclasses.replace(args, **floats)


def save_tiny_transformers_model(directory: Path, seed: int, **overrides) -> dict[str, torch.Tensor]:
    """A random tiny DeepseekV4ForCausalLM written by save_pretrained; returns the saved tensors."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**{**TINY_CONFIG, **overrides}))
    with torch.no_grad():
        for param in model.parameters():  # the default init leaves norms at 1 and biases at 0
            param.normal_()
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                buffer.random_(0, N_EXPERTS)
    model.save_pretrained(directory)
    return load_file(directory / "model.safetensors")


def run_cli(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["dwarfstar", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    directory = tmp_path_factory.mktemp("hf")
    return directory, save_tiny_transformers_model(directory, seed=0)


@pytest.fixture(scope="module")
def hf_f32_gguf(hf_model, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    convert_checkpoint(hf_model[0], out, "f32")
    return out


# -- (a) transformers layout, F32: bit-exact ----------------------------------------------------------


def test_transformers_checkpoint_converts_bit_exact(hf_model, hf_f32_gguf: Path) -> None:
    _, saved = hf_model
    gguf = GGUFFile(hf_f32_gguf)
    assert list(gguf.tensors) == [spec.name for spec in expected_tensors(TINY_ARGS)]
    for name, info in gguf.tensors.items():
        expected = expected_values(name, saved)
        assert info.ggml_type == (GGMLType.I32 if "tid2eid" in name else GGMLType.F32), name
        assert torch.equal(gguf.tensor(name), expected.to(gguf.tensor(name).dtype)), name
    # tid2eid really carries the ids (I32), not a float copy
    assert torch.equal(gguf.tensor("blk.1.ffn_gate_tid2eid.weight").long(), saved["model.layers.1.ffn.gate.tid2eid"])


def test_metadata_round_trips_to_the_same_model_args(hf_model, hf_f32_gguf: Path) -> None:
    meta = GGUFFile(hf_f32_gguf).metadata
    assert ModelArgs.from_gguf_metadata(meta) == as_stored_in_gguf(TINY_ARGS)
    assert meta["general.name"] == hf_model[0].name
    assert meta["general.file_type"] == 0  # LLAMA_FTYPE_ALL_F32
    assert meta["general.quantization_version"] == 2
    assert len(meta["tokenizer.ggml.tokens"]) == 129280
    assert meta["tokenizer.ggml.tokens"][0] == "<｜begin▁of▁sentence｜>"


# -- (b) official layout: FP8 block scales, packed FP4 experts, bf16, an MTP block to skip ---------


def fp8_reference(weight: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Element (r, c) times the scale of its block x block block (V4: 128, V4.1: 32)."""
    rows = torch.arange(weight.shape[0]) // block
    cols = torch.arange(weight.shape[1]) // block
    return weight.float() * scale.float()[rows[:, None], cols[None, :]]


def fp4_reference(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Decode e2m1 codes from their bit fields: low nibble = even column, scale per 32 columns."""
    byte = packed.view(torch.uint8).long()
    codes = torch.empty(byte.shape[0], byte.shape[1] * 2, dtype=torch.long)
    codes[:, 0::2], codes[:, 1::2] = byte & 0xF, byte >> 4
    sign = 1.0 - 2.0 * ((codes >> 3) & 1)
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).float()
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, (1 + 0.5 * mantissa) * 2.0 ** (exponent - 1).float())
    cols = torch.arange(codes.shape[1]) // 32
    return sign * magnitude * scale.float()[:, cols]


def random_e8m0(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    return torch.randint(118, 131, shape, dtype=torch.uint8, generator=generator).view(torch.float8_e8m0fnu)


_FP8_OFFICIAL = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight")
_FP8_OFFICIAL += ("shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight", "head.weight")


def write_official_checkpoint(directory: Path, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tiny model renamed to official names and stored the official way; returns name -> f32 values."""
    generator = torch.Generator().manual_seed(1)
    stored: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    for spec in expected_tensors(TINY_ARGS):
        for name in official_names(spec.name):
            tensor = saved[transformers_key(name)]
            if ".experts." in name:
                out_dim, in_dim = tensor.shape
                packed = torch.randint(-128, 128, (out_dim, in_dim // 2), dtype=torch.int8, generator=generator)
                stored[name], stored[name.replace(".weight", ".scale")] = (
                    packed,
                    random_e8m0((out_dim, in_dim // 32), generator),
                )
                values[name] = fp4_reference(packed, stored[name.replace(".weight", ".scale")])
            elif name.endswith(_FP8_OFFICIAL):
                blocks = (-(-tensor.shape[0] // 128), -(-tensor.shape[1] // 128))  # edge blocks are partial
                weight, scale = (tensor * 16).to(torch.float8_e4m3fn), random_e8m0(blocks, generator)
                stored[name], stored[name.replace(".weight", ".scale")] = weight, scale
                values[name] = fp8_reference(weight, scale)
            elif name in ("embed.weight",) or name.endswith("ffn.gate.weight"):
                stored[name] = tensor.to(torch.bfloat16)
                values[name] = stored[name].float()
            else:
                stored[name] = values[name] = tensor
    stored["mtp.0.enorm.weight"] = torch.ones(64)
    stored["mtp.0.e_proj.weight"] = torch.ones(64, 64)
    # two shards, like the real checkpoint, with each expert's weight and scale in different files
    names = sorted(stored)
    save_file({n: stored[n] for n in names[::2]}, directory / "model-00001-of-00002.safetensors")
    save_file({n: stored[n] for n in names[1::2]}, directory / "model-00002-of-00002.safetensors")
    config = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        **{k: v for k, v in TINY_CONFIG.items() if k not in ("rope_parameters", "partial_rotary_factor")},
        "compress_ratios": [*TINY_CONFIG["compress_ratios"], 0],  # the trailing MTP entry
        "qk_rope_head_dim": 32,
        "num_key_value_heads": 1,
        "n_shared_experts": 1,
        "num_nextn_predict_layers": 1,
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0"},
    }
    (directory / "config.json").write_text(json.dumps(config))
    return values


def test_official_checkpoint_dequantizes_fp8_and_fp4(hf_model, tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "official"
    src.mkdir()
    values = write_official_checkpoint(src, hf_model[1])
    out = tmp_path / "official.gguf"
    monkeypatch.setattr(hf, "PIECE_VALUES", 4096)  # stream every matrix in many bands of rows
    plan = convert_checkpoint(src, out, "f32")
    gguf = GGUFFile(out)
    assert ModelArgs.from_gguf_metadata(gguf.metadata) == as_stored_in_gguf(TINY_ARGS)
    assert list(gguf.tensors) == [spec.name for spec in expected_tensors(TINY_ARGS)]
    for name in gguf.tensors:
        expected = expected_values(name, values, key=lambda official: official)
        assert torch.equal(gguf.tensor(name), expected.to(gguf.tensor(name).dtype)), name
    assert any("mtp.0.* (2)" in note for note in plan.notes), plan.notes
    assert any("bundled DeepSeek V4 tokenizer" in note for note in plan.notes), plan.notes


def test_scaled_weights_read_in_row_bands(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    fp8 = (torch.randn(300, 200, generator=generator) * 30).to(torch.float8_e4m3fn)  # partial blocks both ways
    fp8_scale = random_e8m0((3, 2), generator)
    fp4 = torch.randint(-128, 128, (300, 32), dtype=torch.int8, generator=generator)
    fp4_scale = random_e8m0((300, 2), generator)
    save_file(
        {"a.weight": fp8, "a.scale": fp8_scale, "b.weight": fp4, "b.scale": fp4_scale}, tmp_path / "x.safetensors"
    )
    checkpoint = Checkpoint(tmp_path)
    a, b = checkpoint.tensors["a.weight"], checkpoint.tensors["b.weight"]
    assert b.shape == (300, 64)
    for rows in (slice(None), slice(0, 128), slice(128, 256), slice(256, 300)):
        assert torch.equal(checkpoint.read(a, rows), fp8_reference(fp8, fp8_scale)[rows])
        assert torch.equal(checkpoint.read(b, rows), fp4_reference(fp4, fp4_scale)[rows])


# -- (c) output types ---------------------------------------------------------------------------------

# ds4's Q8_0 file (spec §4.3): these are Q8_0 (here routed experts too), other matrices F16, 1-D tensors
# F32, tid2eid I32.
_Q8_0_TENSORS = {"output.weight", "attn_q_a.weight", "attn_q_b.weight", "attn_kv.weight", "attn_output_a.weight"}
_Q8_0_TENSORS |= {"attn_output_b.weight"} | {
    f"ffn_{p}_{kind}.weight" for p in ("gate", "up", "down") for kind in ("shexp", "exps")
}


def expected_type(name: str, shape: tuple[int, ...], outtype: str) -> GGMLType:
    suffix = name.split(".", 2)[2] if name.startswith("blk.") else name
    if "tid2eid" in name:
        return GGMLType.I32
    if len(shape) == 1 or outtype == "f32":
        return GGMLType.F32
    if outtype == "q8_0" and suffix in _Q8_0_TENSORS and shape[-1] % 32 == 0:
        return GGMLType.Q8_0
    return GGMLType.F16


def test_cli_f16_output_types_and_values(hf_model, tmp_path: Path, monkeypatch, capsys) -> None:
    src, saved = hf_model
    out = tmp_path / "tiny-f16.gguf"
    assert run_cli(monkeypatch, "convert", str(src), str(out), "--outtype", "f16") == 0
    assert "wrote" in capsys.readouterr().out
    gguf = GGUFFile(out)
    assert gguf.metadata["general.file_type"] == 1  # LLAMA_FTYPE_MOSTLY_F16
    for name, info in gguf.tensors.items():
        assert info.ggml_type == expected_type(name, info.shape, "f16"), name
        expected = expected_values(name, saved)
        if info.ggml_type == GGMLType.F16:
            expected = expected.half()
        assert torch.equal(gguf.tensor(name), expected.to(gguf.tensor(name).dtype)), name


def test_q8_0_layout_falls_back_to_f16_for_short_rows(tmp_path: Path) -> None:
    # moe_intermediate_size 48: the down projections' rows (48 values) are not whole Q8_0 blocks
    saved = save_tiny_transformers_model(tmp_path / "hf48", seed=2, moe_intermediate_size=48)
    out = tmp_path / "tiny-q8_0.gguf"
    plan = convert_checkpoint(tmp_path / "hf48", out, "q8_0")
    gguf = GGUFFile(out)
    assert gguf.metadata["general.file_type"] == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    types = {name: info.ggml_type for name, info in gguf.tensors.items()}
    for name, info in gguf.tensors.items():
        assert types[name] == expected_type(name, info.shape, "q8_0"), name
    assert types["blk.3.ffn_gate_exps.weight"] == GGMLType.Q8_0
    assert types["blk.3.ffn_down_exps.weight"] == types["blk.3.ffn_down_shexp.weight"] == GGMLType.F16
    assert types["token_embd.weight"] == types["blk.2.indexer_compressor_kv.weight"] == GGMLType.F16
    assert any("ffn_down_exps" in note and "F16" in note for note in plan.notes), plan.notes
    # the values are exactly what gguf-py's Q8_0 (a port of ggml's reference quantizer) makes of the source
    for name in ("output.weight", "blk.3.ffn_gate_exps.weight", "blk.4.ffn_down_shexp.weight"):
        source = expected_values(name, saved).numpy()
        kind = gguf.tensors[name].ggml_type
        oracle = gguf_py.quants.dequantize(gguf_py.quants.quantize(source, kind), kind)
        assert np.array_equal(gguf.tensor(name).numpy(), oracle), name


# -- (d) errors ---------------------------------------------------------------------------------------


def copy_checkpoint(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors")
    config = config if config is not None else json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_missing_tensor_is_named(hf_model, tmp_path: Path) -> None:
    src, saved = hf_model
    tensors = {k: v for k, v in saved.items() if k != "model.layers.4.attn.wq_b.weight"}
    broken = copy_checkpoint(src, tmp_path / "broken", tensors)
    with pytest.raises(ModelFileError, match=r"'layers\.4\.attn\.wq_b\.weight'.*blk\.4\.attn_q_b\.weight"):
        plan_conversion(broken)


def test_missing_expert_and_wrong_shape_are_named(hf_model, tmp_path: Path) -> None:
    src, saved = hf_model
    tensors = {k: v for k, v in saved.items() if k != "model.layers.5.ffn.experts.7.w2.weight"}
    broken = copy_checkpoint(src, tmp_path / "no-expert", tensors)
    with pytest.raises(ModelFileError, match=r"layers\.5\.ffn\.experts\.7\.w2\.weight.*blk\.5\.ffn_down_exps"):
        plan_conversion(broken)
    tensors = {**saved, "model.layers.0.attn.wkv.weight": torch.zeros(64, 64)}
    broken = copy_checkpoint(src, tmp_path / "bad-shape", tensors)
    with pytest.raises(ModelFileError, match=r"model\.layers\.0\.attn\.wkv\.weight.*\[64, 64\].*\[128, 64\]"):
        plan_conversion(broken)


def test_out_of_range_expert_id_leaves_no_file(hf_model, tmp_path: Path) -> None:
    src, saved = hf_model
    tid2eid = saved["model.layers.2.ffn.gate.tid2eid"].clone()
    tid2eid[5, 1] = N_EXPERTS
    broken = copy_checkpoint(src, tmp_path / "bad-ids", {**saved, "model.layers.2.ffn.gate.tid2eid": tid2eid})
    out = tmp_path / "bad.gguf"
    with pytest.raises(ModelFileError, match=r"expert ids 0\.\.8, outside 0\.\.7"):
        convert_checkpoint(broken, out, "f16")
    assert list(tmp_path.glob("bad.gguf*")) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": None}, "missing required key 'hidden_size'"),
        ({"hidden_size": "64"}, "hidden_size must be an integer"),
        ({"num_key_value_heads": 2}, "num_key_value_heads must be 1"),
        ({"scoring_func": "softmax"}, "scoring_func must be 'sqrtsoftplus'"),
        ({"layer_types": ["sliding_attention"] * 5 + ["dense"]}, "layer_types entry 'dense'"),
        ({"layer_types": ["sliding_attention"] * 5}, "layer_types has 5 entries for num_hidden_layers=6"),
        ({"mlp_layer_types": ["moe", "hash_moe"] + ["moe"] * 4}, "must start with all the 'hash_moe' layers"),
        ({"rope_parameters": {"compress": {"rope_type": "linear"}}}, "rope type 'linear'"),
        ({"num_attention_heads": 3}, "do not split into 2 output groups"),
    ],
)
def test_bad_config_is_a_config_error(hf_model, change: dict, message: str) -> None:
    config = json.loads((hf_model[0] / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    with pytest.raises(ConfigError, match=message):
        model_args_from_hf_config(config)


def test_transformers_config_parses_to_the_tiny_args(hf_model) -> None:
    config = json.loads((hf_model[0] / "config.json").read_text())
    assert model_args_from_hf_config(config) == TINY_ARGS


def test_tokenizer_must_match_the_vocab(hf_model, tmp_path: Path) -> None:
    src = tmp_path / "small-tokenizer"
    src.mkdir()
    (src / "config.json").write_text((hf_model[0] / "config.json").read_text())
    tokenizer = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}, "added_tokens": []}
    (src / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match=r"has 2 token ids, but config.json says vocab_size=129280"):
        plan_conversion(src)


def test_unknown_outtype_is_rejected(hf_model) -> None:
    with pytest.raises(DwarfStarError, match="unknown output type 'q4_k'"):
        plan_conversion(hf_model[0], "q4_k")


@pytest.mark.parametrize(
    ("setup", "argv", "message"),
    [
        ("none", ["{tmp}/nowhere", "{tmp}/out.gguf"], "checkpoint directory .*nowhere does not exist"),
        ("empty", ["{tmp}/src", "{tmp}/out.gguf"], "no config.json in"),
        ("config", ["{tmp}/src", "{tmp}/out.gguf"], r"no \*\.safetensors files in"),
        ("config", ["{tmp}/src", "{tmp}/out.gguf", "--outtype", "q2"], "unknown output type 'q2'"),
        ("bad-config", ["{tmp}/src", "{tmp}/out.gguf"], "missing required key 'vocab_size'"),
    ],
)
def test_cli_errors_exit_2_without_traceback(
    hf_model, tmp_path: Path, monkeypatch, capsys, setup: str, argv: list[str], message: str
) -> None:
    if setup != "none":
        (tmp_path / "src").mkdir()
    if setup == "config":
        (tmp_path / "src" / "config.json").write_text((hf_model[0] / "config.json").read_text())
    if setup == "bad-config":
        (tmp_path / "src" / "config.json").write_text(json.dumps({"hidden_size": 64}))
    code = run_cli(monkeypatch, "convert", *(arg.format(tmp=tmp_path) for arg in argv))
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ")
    assert re.search(message, err), err
    assert "Traceback" not in err
    assert not (tmp_path / "out.gguf").exists()


def test_official_fp4_experts_convert_to_mxfp4_without_loss(hf_model, tmp_path: Path) -> None:
    """q8_0-mxfp4: the routed experts become MXFP4 blocks that decode to the checkpoint's FP4 values exactly
    (whatever the block's largest code), the rest is the q8_0 layout."""
    src = tmp_path / "official"
    src.mkdir()
    values = write_official_checkpoint(src, hf_model[1])
    out = tmp_path / "mxfp4.gguf"
    convert_checkpoint(src, out, "q8_0-mxfp4")
    gguf = GGUFFile(out)
    experts = [name for name in gguf.tensors if name.endswith("_exps.weight")]
    assert experts and all(gguf.tensors[name].ggml_type == GGMLType.MXFP4 for name in experts)
    for name in experts:
        assert torch.equal(gguf.tensor(name), expected_values(name, values, key=lambda official: official)), name
    assert gguf.tensors["blk.0.attn_q_a.weight"].ggml_type == GGMLType.Q8_0


def test_a_checkpoint_with_a_dspark_drafter_converts_its_trunk_alone(hf_model, tmp_path: Path) -> None:
    """V4 Flash 0731 and PRO 0813 keep the trunk and put a 3-stage DSpark drafter under mtp.0-2: their
    config has one compress ratio per stage after the layers', `dspark_*` keys, and still
    `num_nextn_predict_layers` 1. The GGUF is the same trunk, marked as of the release whose effort
    table the prompt follows; the plan names the drafter it skipped."""
    from safetensors.torch import load_file

    src = tmp_path / "plain"
    src.mkdir()
    write_official_checkpoint(src, hf_model[1])
    drafted = tmp_path / "drafted"
    drafted.mkdir()
    for shard in src.glob("*.safetensors"):
        tensors = {k: v for k, v in load_file(shard).items() if not k.startswith("mtp.")}
        save_file(tensors, drafted / shard.name)
    stages = {f"mtp.{k}.{leaf}": torch.ones(8, 8) for k in range(3) for leaf in ("attn.wkv.weight", "hc_attn_base")}
    stages |= {"mtp.0.main_proj.weight": torch.ones(64, 192), "mtp.2.markov_head.markov_w1.weight": torch.ones(8, 32)}
    save_file(stages, drafted / "model-00003-of-00003.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["compress_ratios"] = [*TINY_CONFIG["compress_ratios"], 0, 0, 0]
    config |= {"dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_markov_rank": 32}
    config["dspark_target_layer_ids"] = [3, 4, 5]
    (drafted / "config.json").write_text(json.dumps(config))
    plan = convert_checkpoint(drafted, tmp_path / "drafted.gguf", "f32")
    convert_checkpoint(src, tmp_path / "plain.gguf", "f32")
    got, want = GGUFFile(tmp_path / "drafted.gguf"), GGUFFile(tmp_path / "plain.gguf")
    drafted_args, plain_args = ModelArgs.from_gguf_metadata(got.metadata), ModelArgs.from_gguf_metadata(want.metadata)
    assert (drafted_args.reasoning_efforts, plain_args.reasoning_efforts) == ("0731", "preview")
    assert drafted_args.with_(reasoning_efforts="preview") == plain_args
    assert list(got.tensors) == list(want.tensors)
    assert all(torch.equal(got.tensor(name), want.tensor(name)) for name in want.tensors)
    for stage, count in (("mtp.0.*", 3), ("mtp.1.*", 2), ("mtp.2.*", 3)):
        assert any(f"{stage} ({count})" in note for note in plan.notes), plan.notes
