"""DeepSeek V4.1's config (issue 33): Flash's layer modes, ds4's `deepseek41.*` keys, the tensor list, and
the layouts the config refuses. Expected values are the published config's (shared/spec/RELEASES_2026.md)."""

from __future__ import annotations

import json

import pytest

from dwarfstar.errors import ConfigError
from dwarfstar.gguf.constants import GGMLType, ValueType
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model.config_v41 import LayerMode, ModelArgs41, layer_plan
from dwarfstar.model.synthetic_v41 import V41_TINY
from dwarfstar.model.tensors_v41 import expected_tensors41

FLASH41 = ModelArgs41()


def test_flash_layer_modes_follow_the_spec_table() -> None:
    """§0's table: 0-1 window; 2, 8, 14 full at ratio 2; 20 full at ratio 1 and builds candidates; 24, 28,
    32, 36 reindex inside them; every other layer reuses the latest source."""
    modes = {spec.index: spec for spec in FLASH41.layers}
    assert [modes[i].mode for i in (0, 1)] == [LayerMode.WINDOW] * 2
    assert {i for i, s in modes.items() if s.mode == LayerMode.FULL} == {2, 8, 14, 20}
    assert {i for i, s in modes.items() if s.mode == LayerMode.REINDEX} == {24, 28, 32, 36}
    assert {i for i, s in modes.items() if s.builds_candidates} == {20}
    assert {i for i, s in modes.items() if s.uses_candidates} == {24, 28, 32, 36}
    assert {i for i, s in modes.items() if s.engram} == {1, 14}
    assert [modes[i].compress_ratio for i in (2, 19, 20, 39)] == [2, 2, 1, 1]
    assert (modes[3].kv_source, modes[3].index_source) == (2, 2)
    assert (modes[25].kv_source, modes[25].index_source) == (20, 24)
    assert (modes[39].kv_source, modes[39].index_source) == (20, 36)
    assert [s.has_gate for s in (modes[2], modes[20])] == [True, False]
    assert modes[0].rope_theta == 10000 and not modes[0].yarn
    assert modes[21].rope_theta == 160000 and modes[21].yarn


def test_the_scaled_layout_at_40_layers_is_flash() -> None:
    plan = layer_plan(40)
    assert plan.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20
    assert plan.kv_source_layers == (2, 8, 14, 20)
    assert plan.index_source_layers == (2, 8, 14, 20, 24, 28, 32, 36)
    assert (plan.candidate_source_layer, plan.engram_layers) == (20, (1, 14))
    small = ModelArgs41().with_plan(layer_plan(4))  # every owner kind in 4 layers
    assert [s.mode for s in small.layers] == ["window", "window", "full", "full"]


# §4: every deepseek41.* key ds4's converter writes (the quantizer's own keys aside)
U32_KEYS = """vocab_size hidden_size moe_intermediate_size num_hidden_layers num_attention_heads num_key_value_heads
head_dim qk_rope_head_dim q_lora_rank o_lora_rank o_groups n_routed_experts n_shared_experts num_experts_per_tok
max_position_embeddings sliding_window index_n_heads index_head_dim index_topk candidate_source_layer_id
candidate_topk_blocks candidate_block_size hc_mult hc_sinkhorn_iters rope_theta compress_rope_theta""".split()
F32_KEYS = "rms_norm_eps hc_eps swiglu_limit routed_scaling_factor".split()
STRING_KEYS = "scoring_func hidden_act topk_method".split()
ROPE_KEYS = "factor beta_fast beta_slow original_max_position_embeddings".split()


def test_metadata_keys_and_types_are_ds4s() -> None:
    meta = FLASH41.to_gguf_metadata()
    expected = {"general.architecture", "deepseek41.config", "deepseek41.norm_topk_prob"}
    expected |= {f"deepseek41.{k}" for k in U32_KEYS + F32_KEYS + STRING_KEYS}
    expected |= {f"deepseek41.rope_scaling.{k}" for k in ROPE_KEYS}
    expected |= {f"deepseek41.{k}" for k in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids")}
    expected |= {f"deepseek41.engram.{k}" for k in ("encoding", "layer_ids", "rows", "compressed_vocab_size", "pad_id")}
    assert set(meta) == expected
    assert all(meta[f"deepseek41.{k}"][0] == ValueType.UINT32 for k in U32_KEYS)
    assert all(meta[f"deepseek41.{k}"][0] == ValueType.FLOAT32 for k in F32_KEYS)
    assert all(meta[f"deepseek41.rope_scaling.{k}"][0] == ValueType.FLOAT32 for k in ROPE_KEYS)
    assert meta["deepseek41.norm_topk_prob"] == (ValueType.BOOL, True)
    assert meta["deepseek41.engram.encoding"] == (ValueType.STRING, "e4m3_e8m0_32_row264")
    assert meta["deepseek41.engram.rows"] == (ValueType.ARRAY, (ValueType.UINT32, [384006168, 384016682]))
    assert meta["deepseek41.hidden_size"] == (ValueType.UINT32, 5120)
    assert meta["deepseek41.compress_ratios"][1][1] == [0, 0] + [2] * 18 + [1] * 20
    config = json.loads(meta["deepseek41.config"][1])
    assert config["model_type"] == "deepseek_v41"
    text = config["text_config"]
    assert (text["engram_n_heads"], text["engram_head_dim"], text["engram_max_ngram_size"]) == (8, 256, 4)
    assert (text["engram_vocab_size"], text["engram_compressed_vocab_size"]) == (16000000, 99092)


@pytest.mark.parametrize("args", [FLASH41, V41_TINY], ids=["flash", "tiny"])
def test_metadata_round_trips_through_a_file(args: ModelArgs41, tmp_path) -> None:
    path = tmp_path / "meta.gguf"
    with GGUFWriter(path, args.to_gguf_metadata()) as writer:
        writer.add_tensor("x", (32,), GGMLType.F32)
        writer.write_tensor("x", bytes(128))
    with GGUFFile(path) as gguf:
        back = ModelArgs41.from_gguf_metadata(gguf.metadata)
    assert back == args
    assert back.norm_eps == 1e-20  # the f32 key reads back as the decimal written


def plain(typed: dict) -> dict:
    """Metadata as a reader returns it: arrays as their items."""
    return {k: v[1] if t == ValueType.ARRAY else v for k, (t, v) in typed.items()}


def test_config_json_must_agree_with_the_typed_keys() -> None:
    meta = plain(FLASH41.to_gguf_metadata())
    config = json.loads(meta["deepseek41.config"])
    config["text_config"]["hidden_size"] = 4096
    meta["deepseek41.config"] = json.dumps(config)
    with pytest.raises(ConfigError, match="config says hidden_size = 4096, but its typed key says 5120"):
        ModelArgs41.from_gguf_metadata(meta)


def test_missing_key_is_named() -> None:
    meta = plain(FLASH41.to_gguf_metadata())
    del meta["deepseek41.candidate_block_size"]
    with pytest.raises(ConfigError, match="missing required key 'deepseek41.candidate_block_size'"):
        ModelArgs41.from_gguf_metadata(meta)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"compress_ratios": (0, 0) + (2,) * 18 + (1,) * 19 + (4,)}, "must be 0, 1 or 2, got \\[4\\]"),
        # layer 21 (ratio 2) would read layer 20's ratio-1 rows
        ({"compress_ratios": (0, 0) + (2,) * 18 + (1, 2) + (1,) * 18}, "layer 21 .* kv source 20, whose ratio is 1"),
        # layers 2-7 compressed but the first source is 8
        (
            {"kv_source_layers": (8, 14, 20), "index_source_layers": (8, 14, 20, 24, 28, 32, 36)},
            "layer 2 .* no kv and index source comes at or before it",
        ),
        ({"kv_source_layers": (2, 8, 14, 20, 21)}, "kv sources \\[21\\] are not index sources"),
        ({"candidate_source_layer": 24}, "candidate source 24 is not a kv source"),
        ({"engram_n_heads": 4}, "Engram must be 2 layers of 4-grams, 8 heads of 256 dims"),
        ({"engram_layers": (1, 14, 20), "engram_rows": (1, 2, 3)}, "got 3 layers"),
        ({"engram_layers": (14, 1)}, "must be distinct, ascending"),
        ({"index_source_layers": (1, 2, 8, 14, 20)}, "name a window-only"),
    ],
)
def test_bad_layouts_are_named(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelArgs41(**changes)


def test_flash_tensor_count_is_ds4s() -> None:
    """§4: 3 + 40·25 + (4·4 + 3) + 8·2 + 2·3 + 2 = 1046 tensors, the tables last, as I8 [rows, 264]."""
    specs = list(expected_tensors41(FLASH41))
    assert len(specs) == 1046
    assert [(s.name, s.shape) for s in specs[-2:]] == [
        ("blk.1.engram_embd.weight", (384006168, 264)),
        ("blk.14.engram_embd.weight", (384016682, 264)),
    ]
    shapes = {s.name: s.shape for s in specs}
    assert shapes["blk.14.engram_kv.weight"] == (25600, 6144)
    assert shapes["blk.2.attn_compressor_gate.weight"] == (512, 5120)
    assert "blk.20.attn_compressor_gate.weight" not in shapes  # ratio 1: no gate
    assert shapes["blk.24.indexer.attn_q_b.weight"] == (4096, 1280)
    assert "blk.24.indexer.attn_k.weight" not in shapes  # reindex: keys are layer 20's
    assert shapes["blk.0.ffn_down_exps.weight"] == (384, 5120, 2304)
    assert shapes["blk.0.attn_output_a.weight"] == (8192, 4096)
    assert "output_hc_fn.weight" not in shapes
