"""`dwarfstar convert` of a DeepSeek V4.1 checkpoint (issue 33 item 2): a tiny checkpoint in the official
layout (config.json with `text_config` and the DSpark stages' ratios, FP8 in 32x32 blocks, packed FP4
experts, the Engram tables as FP8 rows with E8M0 scales, DSpark and vision tensors to skip) becomes ds4's
`deepseek41` file, which the loader accepts and the reference runs.

The expected values are decoded here from the stored bytes (`fp8_reference`, `fp4_reference` and the
Engram rows' own arithmetic), not by the converter's code."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_convert import fp4_reference, fp8_reference, random_e8m0, run_cli

from dwarfstar.backends.reference.v41.backend import ReferenceModel41
from dwarfstar.convert.hf import convert_checkpoint, plan_conversion
from dwarfstar.convert.names import source_names
from dwarfstar.engram.rows import ROW_VALUES
from dwarfstar.errors import ConfigError, ModelFileError
from dwarfstar.gguf.constants import GGMLType
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.dspark_v41 import dspark_tensors41
from dwarfstar.model.file_v41 import open_model41
from dwarfstar.model.synthetic_v41 import TINY_DSPARK41, V41_TINY
from dwarfstar.model.tensors_v41 import V41_ALIGNMENT, expected_tensors41
from dwarfstar.speculative.dspark_v41 import open_dspark41

ARGS = V41_TINY
DRAFTER = TINY_DSPARK41
STAGES = DRAFTER.d.stages  # DSpark stages: their ratios follow the layers' in config.json
# the drafter's heads: support-file name -> the checkpoint's (V4.1's reference: `DSparkBlock`, `DSparkMarkovHead`)
HEADS = {
    "mtp.0.main_proj.weight": "mtp.0.main_proj.weight",
    "mtp.0.main_norm.weight": "mtp.0.main_norm.weight",
    "mtp.2.norm.weight": "mtp.2.norm.weight",
    "mtp.2.markov_head.markov_w1.weight": "mtp.2.markov_head.embed.weight",
    "mtp.2.markov_head.markov_w2.weight": "mtp.2.markov_head.head.weight",
    "mtp.2.confidence_head.proj.weight": "mtp.2.confidence_head.proj.weight",
}


def drafter_names(file_name: str) -> list[str]:
    """The checkpoint names of a support-file tensor: a head's, or a stage's as the trunk's layer 0 names
    it (experts one per expert) under `mtp.{k}.`."""
    if file_name in HEADS:
        return [HEADS[file_name]]
    _, stage, suffix = file_name.split(".", 2)
    return [n.replace("layers.0.", f"mtp.{stage}.") for n in source_names(f"blk.0.{suffix}", DRAFTER.n_experts)]


FP8_NAMES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight")
FP8_NAMES += ("shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight", "head.weight")
FP8_NAMES += ("attn.indexer.wq_b.weight", "engram.wkv.weight")


def official_config(args: ModelArgs41) -> dict:
    config = json.loads(args.config_json())
    text = config["text_config"]
    text["compress_ratios"] = [*text["compress_ratios"], *[0] * STAGES]
    d = DRAFTER.d
    text |= {
        "num_nextn_predict_layers": STAGES,
        "dspark_block_size": d.block_size,
        "dspark_target_layer_ids": list(d.target_layers),
        "dspark_markov_rank": d.markov_rank,
        "dspark_noise_token_id": d.noise_token_id,
        "dspark_n_routed_experts": DRAFTER.n_experts,
        "dspark_num_experts_per_tok": DRAFTER.top_k,
    }
    text["rope_scaling"] = {"rope_type": "yarn", **{k: v for k, v in text["rope_scaling"].items() if k != "type"}}
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32], "expert_dtype": "fp4"}
    return config


def engram_reference(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Each E4M3 value times 2^(its block's E8M0 exponent - 127), a scale per 32 values."""
    exponent = scales.view(torch.uint8).float() - 127
    return values.float() * torch.pow(2.0, exponent).repeat_interleave(32, dim=1)


def write_checkpoint(directory: Path, args: ModelArgs41 = ARGS, seed: int = 3) -> dict[str, torch.Tensor]:
    """A random V4.1 checkpoint stored the official way; returns official name -> expected f32 values
    (and, for each Engram table, `<name>.rows`: its 264-byte rows)."""
    gen = torch.Generator().manual_seed(seed)
    stored: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    for spec in expected_tensors41(args):
        for name in source_names(spec.name, args.n_routed_experts):
            scale_name = name.removesuffix(".weight") + ".scale"
            if name.endswith("engram.embed.weight"):
                rows = spec.shape[0]
                stored[name] = torch.randn(rows, ROW_VALUES, generator=gen).to(torch.float8_e4m3fn)
                stored[scale_name] = random_e8m0((rows, ROW_VALUES // 32), gen)
                values[name] = engram_reference(stored[name], stored[scale_name])
                raw = torch.cat((stored[name].view(torch.uint8), stored[scale_name].view(torch.uint8)), 1)
                values[name + ".rows"] = raw
                continue
            shape = spec.shape[1:] if ".experts." in name else spec.shape
            tensor = torch.randn(shape, generator=gen) * 0.1
            if ".experts." in name:
                packed = torch.randint(-128, 128, (shape[0], shape[1] // 2), dtype=torch.int8, generator=gen)
                stored[name], stored[scale_name] = packed, random_e8m0((shape[0], shape[1] // 32), gen)
                values[name] = fp4_reference(packed, stored[scale_name])
            elif name.endswith(FP8_NAMES):
                blocks = (-(-shape[0] // 32), -(-shape[1] // 32))
                stored[name], stored[scale_name] = (tensor * 16).to(torch.float8_e4m3fn), random_e8m0(blocks, gen)
                values[name] = fp8_reference(stored[name], stored[scale_name], block=32)
            elif name == "embed.weight" or name.endswith(("ffn.gate.weight", "compressor.wkv.weight")):
                stored[name] = tensor.to(torch.bfloat16)
                values[name] = stored[name].float()
            else:
                stored[name] = values[name] = tensor
    for spec in dspark_tensors41(args, DRAFTER):  # the drafter, float32 as stored
        for name in drafter_names(spec.name):
            shape = spec.shape[1:] if ".experts." in name else spec.shape
            stored[name] = values[name] = torch.randn(shape, generator=gen) * 0.1
    stored["vision.blocks.0.attn.wqkv.weight"] = torch.ones(8, 8)
    names = sorted(stored)
    save_file({n: stored[n] for n in names[::2]}, directory / "model-00001-of-00002.safetensors")
    save_file({n: stored[n] for n in names[1::2]}, directory / "model-00002-of-00002.safetensors")
    (directory / "config.json").write_text(json.dumps(official_config(args)))
    return values


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    src = tmp_path_factory.mktemp("v41-hf")
    return src, write_checkpoint(src)


@pytest.fixture(scope="module")
def converted(checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("v41-out") / "v41.gguf"
    convert_checkpoint(checkpoint[0], out, "f32")
    return out


def test_the_config_reads_to_the_tiny_args(checkpoint) -> None:
    config = json.loads((checkpoint[0] / "config.json").read_text())
    assert ModelArgs41.from_hf_config(config) == ARGS  # the DSpark stages' ratios are not the trunk's


def test_every_tensor_converts_to_its_decoded_values(checkpoint, converted) -> None:
    values = checkpoint[1]
    with GGUFFile(converted) as gguf:
        assert gguf.alignment == V41_ALIGNMENT
        for spec in expected_tensors41(ARGS):
            info = gguf.tensors[spec.name]
            names = source_names(spec.name, ARGS.n_routed_experts)
            if spec.name.endswith("engram_embd.weight"):
                assert info.ggml_type == GGMLType.I8
                raw = np.asarray(gguf.raw(spec.name)).reshape(spec.shape)
                assert np.array_equal(raw, values[names[0] + ".rows"].numpy())
                continue
            expected = torch.stack([values[n] for n in names]) if len(names) > 1 else values[names[0]]
            got = gguf.tensor(spec.name)
            assert torch.equal(got, expected), spec.name


def test_the_converted_file_loads_and_runs(checkpoint, converted) -> None:
    model = open_model41(converted)  # the hash tables computed for the config agree with its table rows
    try:
        assert model.args == ARGS
        table = model.engram[ARGS.engram_layers[0]]
        name = f"layers.{ARGS.engram_layers[0]}.engram.embed.weight"
        backend = ReferenceModel41.from_file(model, engram_cache_bytes=0)
        store = backend.transformer.ops.store
        rows = np.array([0, 5, table.rows - 1])
        assert np.array_equal(store.rows(ARGS.engram_layers[0], rows[None, :])[0], checkpoint[1][name][rows].numpy())
        logits = backend.forward([0, 100, 2000, 30000], backend.new_state())
        assert logits.shape == (4, ARGS.vocab_size) and torch.isfinite(logits).all()
    finally:
        model.close()


def test_notes_name_what_is_not_converted(checkpoint) -> None:
    plan = plan_conversion(checkpoint[0], "q8_0")
    notes = " ".join(plan.notes)
    assert "DSpark drafter (mtp.*): --dspark FILE writes it" in notes
    assert "mtp.0" in notes and "vision.blocks" in notes  # skipped: the drafter without --dspark, the tower
    assert "bundled DeepSeek V4 tokenizer" in notes
    types = {t.name: t.ggml_type for t in plan.tensors}
    assert types["blk.0.attn_q_a.weight"] == GGMLType.Q8_0 and types["token_embd.weight"] == GGMLType.F16
    assert types["blk.1.engram_embd.weight"] == GGMLType.I8 and types["blk.0.attn_sinks.weight"] == GGMLType.F32


def test_the_cli_writes_q8_0(checkpoint, tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "q8.gguf"
    assert run_cli(monkeypatch, "convert", str(checkpoint[0]), str(out), "--outtype", "q8_0") == 0
    assert "wrote" in capsys.readouterr().out
    model = open_model41(out)
    try:
        assert model.gguf.tensors["blk.2.ffn_gate_exps.weight"].ggml_type == GGMLType.Q8_0
    finally:
        model.close()


def _rewrite(src: Path, dst: Path, config: dict | None = None, drop: str | None = None, swap=None) -> Path:
    from safetensors.torch import load_file

    dst.mkdir()
    for path in src.glob("*.safetensors"):
        tensors = load_file(path)
        tensors = {k: v for k, v in tensors.items() if k != drop}
        if swap is not None:
            tensors = {k: swap(k, v) for k, v in tensors.items()}
        save_file(tensors, dst / path.name)
    (dst / "config.json").write_text(json.dumps(config or json.loads((src / "config.json").read_text())))
    return dst


def test_bad_checkpoints_are_named(checkpoint, tmp_path) -> None:
    src = checkpoint[0]
    config = json.loads((src / "config.json").read_text())
    short = json.loads(json.dumps(config))
    short["text_config"]["compress_ratios"] = short["text_config"]["compress_ratios"][:-1]
    with pytest.raises(ConfigError, match="compress_ratios has 14 entries; 12 layers and 3 DSpark stages need 15"):
        plan_conversion(_rewrite(src, tmp_path / "ratios", short), "f32")
    missing = json.loads(json.dumps(config))
    del missing["text_config"]["index_topk"]
    with pytest.raises(ConfigError, match="config.json text_config is missing required key 'index_topk'"):
        plan_conversion(_rewrite(src, tmp_path / "key", missing), "f32")
    with pytest.raises(ModelFileError, match="no tensor 'layers.6.engram.k_weight'"):
        plan_conversion(_rewrite(src, tmp_path / "drop", drop="layers.6.engram.k_weight"), "f32")

    def fewer_rows(key: str, value: torch.Tensor) -> torch.Tensor:
        return value[:-1] if key.startswith("layers.1.engram.embed.") else value

    with pytest.raises(ModelFileError, match=r"layers.1.engram.embed.weight' is F8_E4M3 \[2945, 256\]"):
        plan_conversion(_rewrite(src, tmp_path / "rows", swap=fewer_rows), "f32")
    greedy = json.loads(json.dumps(config))
    greedy["text_config"]["dspark_num_experts_per_tok"] = DRAFTER.n_experts + 1
    with pytest.raises(ConfigError, match="the drafter routes to 7 of 6 experts"):
        plan_conversion(_rewrite(src, tmp_path / "topk", greedy), "f32", dspark=True)


def test_dspark_writes_the_drafter_that_speculates_as_plain_greedy(checkpoint, tmp_path, monkeypatch, capsys):
    """`--dspark FILE`: the drafter's support file, its tensors the checkpoint's values under the file's names,
    loads beside the converted model, and greedy output with it is plain greedy's."""
    src, values = checkpoint
    out, support = tmp_path / "v41.gguf", tmp_path / "v41-dspark.gguf"
    convert_checkpoint(src, out, "f32", dspark=support)
    with GGUFFile(support) as gguf:
        for spec in dspark_tensors41(ARGS, DRAFTER):
            names = drafter_names(spec.name)
            expected = torch.stack([values[n] for n in names]) if len(names) > 1 else values[names[0]]
            assert torch.equal(gguf.tensor(spec.name), expected), spec.name
    model = open_model41(out)
    try:
        d, gguf, _ = open_dspark41(model, support)
        gguf.close()
        assert d == DRAFTER
    finally:
        model.close()
    texts = []
    for extra in ((), ("--dspark", str(support))):
        args = ("run", "-m", str(out), "--backend", "reference", "-p", "hello", "-n", "8", "--temp", "0", "--no-think")
        assert run_cli(monkeypatch, *args, *extra) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()
