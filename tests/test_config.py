"""ModelArgs: presets, GGUF metadata round trip with llama.cpp's value types, clear errors, YaRN."""

from __future__ import annotations

import math

import pytest

from dwarfstar.errors import ConfigError
from dwarfstar.gguf.constants import ValueType
from dwarfstar.model.config import ModelArgs, yarn_inv_freq


def plain(meta: dict) -> dict:
    """Metadata as a GGUF reader returns it: plain values, arrays as lists."""
    return {key: (value[1] if vtype == ValueType.ARRAY else value) for key, (vtype, value) in meta.items()}


def test_flash_layer_pattern():
    flash = ModelArgs.flash()
    kinds = [layer.compress_ratio for layer in flash.layers]
    assert kinds[:2] == [0, 0]
    assert kinds.count(4) == 21 and kinds.count(128) == 20
    assert [layer.hash_routed for layer in flash.layers[:4]] == [True, True, True, False]
    assert flash.layer(0).rope_theta == 10000 and not flash.layer(0).yarn
    assert flash.layer(2).rope_theta == 160000 and flash.layer(2).yarn


def test_pro_preset_has_no_window_only_layer():
    pro = ModelArgs.pro()
    assert pro.n_layers == 61 and pro.dim == 7168
    assert [layer.compress_ratio for layer in pro.layers[:4]] == [128, 128, 4, 128]
    assert sum(layer.compress_ratio == 128 for layer in pro.layers) == 31


@pytest.mark.parametrize("args", [ModelArgs.flash(), ModelArgs.pro()], ids=["flash", "pro"])
def test_metadata_round_trip(args):
    assert ModelArgs.from_gguf_metadata(plain(args.to_gguf_metadata())) == args


def test_metadata_value_types_follow_llama_cpp():
    meta = ModelArgs.flash().to_gguf_metadata()
    assert meta["deepseek4.block_count"][0] == ValueType.UINT32
    assert meta["deepseek4.context_length"][0] == ValueType.UINT32
    assert meta["deepseek4.rope.scaling.original_context_length"][0] == ValueType.UINT32
    assert meta["deepseek4.hyper_connection.epsilon"][0] == ValueType.FLOAT32
    assert meta["deepseek4.expert_gating_func"] == (ValueType.UINT32, 4)
    assert meta["deepseek4.rope.scaling.type"] == (ValueType.STRING, "yarn")
    item_type, clamps = meta["deepseek4.swiglu_clamp_exp"][1]
    assert item_type == ValueType.FLOAT32 and len(clamps) == 43
    assert len(meta["deepseek4.swiglu_clamp_shexp"][1][1]) == 43


def test_wrong_architecture_is_named():
    meta = plain(ModelArgs.flash().to_gguf_metadata())
    meta["general.architecture"] = "llama"
    with pytest.raises(ConfigError, match="not a DeepSeek V4 model.*'llama'"):
        ModelArgs.from_gguf_metadata(meta)


def test_missing_key_is_named():
    meta = plain(ModelArgs.flash().to_gguf_metadata())
    del meta["deepseek4.attention.q_lora_rank"]
    with pytest.raises(ConfigError, match="missing required key 'deepseek4.attention.q_lora_rank'"):
        ModelArgs.from_gguf_metadata(meta)


def test_wrong_value_type_is_named():
    meta = plain(ModelArgs.flash().to_gguf_metadata())
    meta["deepseek4.embedding_length"] = "4096"
    with pytest.raises(ConfigError, match="embedding_length.*must be a number"):
        ModelArgs.from_gguf_metadata(meta)


def test_invalid_shapes_are_rejected():
    with pytest.raises(ConfigError, match="compress ratios must be 0, 4 or 128"):
        ModelArgs(n_layers=2, compress_ratios=(0, 16))
    with pytest.raises(ConfigError, match="output groups"):
        ModelArgs(n_heads=6, o_groups=4)
    with pytest.raises(ConfigError, match="power of two"):
        ModelArgs(index_head_dim=96)


def test_yarn_ramp_matches_flash_constants():
    """Spec §1.3: pairs 0..15 keep base^(-2i/64), pairs >= 25 are divided by 16, linear blend between."""
    flash = ModelArgs.flash()
    freqs = yarn_inv_freq(flash, flash.layer(2))
    base = [160000 ** (-2 * i / 64) for i in range(32)]
    assert all(math.isclose(freqs[i], base[i], rel_tol=1e-12) for i in range(16))
    assert all(math.isclose(freqs[i], base[i] / 16, rel_tol=1e-12) for i in range(25, 32))
    mid = (20 - 15) / (25 - 15)
    assert math.isclose(freqs[20], base[20] * (1 - mid) + base[20] / 16 * mid, rel_tol=1e-12)
    window_only = yarn_inv_freq(flash, flash.layer(0))
    assert window_only == [10000 ** (-2 * i / 64) for i in range(32)]
