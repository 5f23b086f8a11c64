"""`dwarfstar convert --dspark`: a checkpoint's DSpark drafter (V4 Flash 0731, PRO 0813) -> ds4's support file.

The checkpoint is test_convert's tiny model in the official layout with a random 3-stage drafter under
`mtp.{0,1,2}.`, stored as the real one is (FP8 block-scaled attention, shared-expert and main_proj
matrices, packed FP4 routed experts, BF16 router and heads). Expected values are decoded by
test_convert's own FP8/FP4 decoders and named from the spec's tables (test_convert's GGUF -> official
table for a stage's block, the heads restated here from the sources' list), never by the converter's
helpers; the support file's names and shapes are the loader's (`dspark_tensors`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import gguf as gguf_py
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_convert import (
    TINY_ARGS,
    TINY_CONFIG,
    fp4_reference,
    fp8_reference,
    official_names,
    run_cli,
    save_tiny_transformers_model,
    write_official_checkpoint,
)

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.convert.hf import convert_checkpoint
from dwarfstar.gguf.constants import GGMLType
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.dspark import DSparkArgs, dspark_tensors, support_metadata
from dwarfstar.model.loader import open_model
from dwarfstar.sampling import GREEDY, Sampler
from dwarfstar.speculative.dspark import DSparkDraft, open_dspark
from dwarfstar.train.params import write_f32

D = DSparkArgs(block_size=5, markov_rank=32, noise_token_id=128799, target_layers=(3, 4, 5), stages=3)
DSPARK_CONFIG = {
    "dspark_block_size": 5,
    "dspark_markov_rank": 32,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [3, 4, 5],
}
# The heads: support-file name -> official checkpoint name (the sources' tensor list, ds4's support template).
HEAD_NAMES = {
    "mtp.2.hc_head_fn.weight": "mtp.2.hc_head_fn",
    "mtp.2.hc_head_scale.weight": "mtp.2.hc_head_scale",
    "mtp.2.hc_head_base.weight": "mtp.2.hc_head_base",
    "mtp.2.norm.weight": "mtp.2.norm.weight",
    "mtp.0.main_proj.weight": "mtp.0.main_proj.weight",
    "mtp.0.main_norm.weight": "mtp.0.main_norm.weight",
    "mtp.2.markov_head.markov_w1.weight": "mtp.2.markov_head.markov_w1.weight",
    "mtp.2.markov_head.markov_w2.weight": "mtp.2.markov_head.markov_w2.weight",
    "mtp.2.confidence_head.proj.weight": "mtp.2.confidence_head.proj.weight",
}
FP8_STORED = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight")
FP8_STORED += ("shared_experts.w1.weight", "shared_experts.w2.weight", "shared_experts.w3.weight", "main_proj.weight")
BF16_STORED = ("ffn.gate.weight", "main_norm.weight", "markov_w1.weight", "markov_w2.weight", "proj.weight")
# ds4's Q8_0 file: these are Q8_0 in the support file as in the trunk (the experts too under q8_0)
Q8_0_LEAVES = {"attn_q_a", "attn_q_b", "attn_kv", "attn_output_a", "attn_output_b", "main_proj"}
Q8_0_LEAVES |= {f"ffn_{p}_shexp" for p in ("gate", "up", "down")} | {"markov_w1", "markov_w2", "proj"}
Q8_0_LEAVES |= {"ffn_gate_inp"}  # the stages' routers, as ds4's quantizer writes them (the trunk's stay F16)
EXPERT_LEAVES = {f"ffn_{p}_exps" for p in ("gate", "up", "down")}


def drafter_sources(name: str) -> list[str]:
    """A support-file tensor's official checkpoint names: a stage's block as the trunk's layer k."""
    if name in HEAD_NAMES:
        return [HEAD_NAMES[name]]
    stage, leaf = name.removeprefix("mtp.").split(".", 1)
    return [n.replace(f"layers.{stage}.", f"mtp.{stage}.", 1) for n in official_names(f"blk.{stage}.{leaf}")]


def small_e8m0(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Scales 2^-7 .. 2^-3, so three random stages stay finite."""
    return torch.randint(120, 125, shape, dtype=torch.uint8, generator=generator).view(torch.float8_e8m0fnu)


def random_drafter(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the drafter's checkpoint tensors as stored, support-file name -> float32 values they decode to)."""
    generator = torch.Generator().manual_seed(seed)
    stored: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    for spec in dspark_tensors(TINY_ARGS, D):
        names = drafter_sources(spec.name)
        shape = spec.shape[1:] if len(names) > 1 else spec.shape
        pieces = []
        for name in names:
            scale_name = name.replace(".weight", ".scale")
            if ".experts." in name:
                packed = torch.randint(-128, 128, (shape[0], shape[1] // 2), dtype=torch.int8, generator=generator)
                stored[name], stored[scale_name] = packed, small_e8m0((shape[0], shape[1] // 32), generator)
                pieces.append(fp4_reference(packed, stored[scale_name]))
            elif name.endswith(FP8_STORED):
                weight = (torch.randn(shape, generator=generator) * 16).to(torch.float8_e4m3fn)
                stored[name], stored[scale_name] = (
                    weight,
                    small_e8m0((-(-shape[0] // 128), -(-shape[1] // 128)), generator),
                )
                pieces.append(fp8_reference(weight, stored[scale_name]))
            elif name.endswith(BF16_STORED):
                stored[name] = (torch.randn(shape, generator=generator) * 0.5).to(torch.bfloat16)
                pieces.append(stored[name].float())
            else:
                stored[name] = torch.randn(shape, generator=generator) * 0.5
                pieces.append(stored[name])
        values[spec.name] = torch.stack(pieces) if len(pieces) > 1 else pieces[0]
    return stored, values


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """(the tiny official checkpoint, the same with a DSpark drafter, the drafter's expected values)."""
    root = tmp_path_factory.mktemp("dspark-hf")
    plain, drafted = root / "plain", root / "drafted"
    plain.mkdir()
    drafted.mkdir()
    write_official_checkpoint(plain, save_tiny_transformers_model(root / "hf", seed=0))
    for shard in plain.glob("*.safetensors"):  # the drafter replaces the NextN block under mtp.*
        save_file({k: v for k, v in load_file(shard).items() if not k.startswith("mtp.")}, drafted / shard.name)
    stored, values = random_drafter(seed=5)
    save_file(stored, drafted / "model-00003-of-00003.safetensors")
    config = json.loads((plain / "config.json").read_text())
    config["compress_ratios"] = [*TINY_CONFIG["compress_ratios"], 0, 0, 0]  # one window-only entry per stage
    (drafted / "config.json").write_text(json.dumps(config | DSPARK_CONFIG))
    return plain, drafted, values


@pytest.fixture(scope="module")
def converted_f32(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("dspark-f32")
    convert_checkpoint(checkpoints[1], out / "trunk.gguf", "f32", dspark=out / "support.gguf")
    return out / "trunk.gguf", out / "support.gguf"


# -- the support file ------------------------------------------------------------------------------------------


def test_the_support_file_holds_the_drafter_exactly(checkpoints, converted_f32) -> None:
    values = checkpoints[2]
    support = GGUFFile(converted_f32[1])
    assert sorted(support.tensors) == sorted(values) and len(values) == 81
    for name, info in support.tensors.items():
        assert info.ggml_type == GGMLType.F32, name
        assert torch.equal(support.tensor(name), values[name]), name
    meta = support.metadata
    assert meta["general.architecture"] == "deepseek4-dspark"
    assert meta["general.name"] == "drafted DSpark support"
    assert (meta["dspark.block_size"], meta["dspark.markov_rank"], meta["dspark.noise_token_id"]) == (5, 32, 128799)
    assert list(meta["dspark.target_layer_ids"]) == [3, 4, 5]
    assert meta["dspark.stage_count"] == meta["dspark.n_layers"] == 3


def expected_type(name: str, ndim: int, outtype: str) -> GGMLType:
    leaf = name.split(".")[-2]
    if ndim == 1 or outtype == "f32":
        return GGMLType.F32
    if outtype == "q8_0-mxfp4" and leaf in EXPERT_LEAVES:
        return GGMLType.MXFP4
    if outtype in ("q8_0", "q8_0-mxfp4") and leaf in Q8_0_LEAVES | EXPERT_LEAVES:
        return GGMLType.Q8_0
    return GGMLType.F16  # the HC matrices, as in the trunk


@pytest.mark.parametrize("outtype", ["q8_0", "q8_0-mxfp4"])
def test_quantized_support_files_follow_the_trunks_types(checkpoints, tmp_path: Path, outtype: str) -> None:
    """Every tensor in the type its trunk role gets, which the drafter's loader takes; Q8_0 values are
    what gguf-py's Q8_0 makes of the checkpoint's, MXFP4 experts the FP4 values exactly, F16 and F32
    the values rounded once."""
    values = checkpoints[2]
    convert_checkpoint(checkpoints[1], tmp_path / "trunk.gguf", outtype, dspark=tmp_path / "support.gguf")
    d, opened, _ = open_dspark(open_model(tmp_path / "trunk.gguf"), tmp_path / "support.gguf")
    opened.close()
    assert d == D
    support = GGUFFile(tmp_path / "support.gguf")
    assert support.metadata["general.file_type"] == (7 if outtype == "q8_0" else 38)
    for name, info in support.tensors.items():
        kind = expected_type(name, len(info.shape), outtype)
        assert info.ggml_type == kind, name
        want = values[name]
        if kind == GGMLType.Q8_0:
            source = want.numpy()
            want = torch.from_numpy(gguf_py.quants.dequantize(gguf_py.quants.quantize(source, kind), kind))
        elif kind == GGMLType.F16:
            want = want.half()
        assert torch.equal(support.tensor(name), want.to(support.tensor(name).dtype)), name


def drafter_outputs(trunk: Path, support: Path) -> tuple[torch.Tensor, torch.Tensor, list[int], list[float]]:
    """The drafter's block after 12 context positions of random target streams: (collapsed rows, logits,
    greedy drafts, each row's confidence)."""
    model = open_model(trunk)
    draft = DSparkDraft(ReferenceModel(model, qat=False), model, support)
    try:
        generator = torch.Generator().manual_seed(11)
        streams = [torch.randn(12, TINY_ARGS.hc_mult, TINY_ARGS.dim, generator=generator) for _ in D.target_layers]
        state = draft.new_state()
        draft.feed(streams, state)
        anchor = 4242
        collapsed, logits = draft.forward.block(anchor, state)
        drafts, _ = draft.propose(anchor, state, D.block_size, Sampler(GREEDY))
        previous = [anchor, *drafts[:-1]]
        confidence = [draft.heads.confidence_of(collapsed[i], draft.heads.markov(p)[0]) for i, p in enumerate(previous)]
        return collapsed, logits, drafts, confidence
    finally:
        draft.close()


def test_the_converted_drafter_drafts_as_one_written_from_the_source_tensors(
    checkpoints, converted_f32, tmp_path: Path
) -> None:
    """The support file loads (`open_dspark`, reference backend) and its drafter computes bit for bit what
    a drafter from a support file written directly from the checkpoint's decoded tensors computes."""
    trunk, support = converted_f32
    direct = tmp_path / "direct.gguf"
    write_f32(direct, support_metadata(D, "direct"), list(dspark_tensors(TINY_ARGS, D)), checkpoints[2])
    collapsed, logits, drafts, confidence = drafter_outputs(trunk, support)
    want_collapsed, want_logits, want_drafts, want_confidence = drafter_outputs(trunk, direct)
    assert torch.isfinite(logits).all() and logits.abs().max() > 0
    assert torch.equal(collapsed, want_collapsed) and torch.equal(logits, want_logits)
    assert drafts == want_drafts and len(drafts) == D.block_size
    assert confidence == want_confidence


# -- the trunk, the note, bad input ------------------------------------------------------------------------------


def test_the_trunk_is_byte_identical_with_and_without_dspark(checkpoints, tmp_path: Path, monkeypatch, capsys) -> None:
    drafted = checkpoints[1]
    assert run_cli(monkeypatch, "convert", str(drafted), str(tmp_path / "alone.gguf"), "--outtype", "q8_0") == 0
    err = capsys.readouterr().err
    assert "has a DSpark drafter" in err and "--dspark FILE" in err
    assert "mtp.0.* (" in err  # the skipped drafter is still listed
    argv = [str(drafted), str(tmp_path / "with.gguf"), "--outtype", "q8_0", "--dspark", str(tmp_path / "d.gguf")]
    assert run_cli(monkeypatch, "convert", *argv) == 0
    out, err = capsys.readouterr()
    assert "DSpark drafter" not in err and "mtp." not in err  # nothing skipped, no hint
    assert re.search(r"wrote .*d\.gguf \(q8_0, 81 tensors\)", out), out
    assert (tmp_path / "with.gguf").read_bytes() == (tmp_path / "alone.gguf").read_bytes()


def variant(
    base: Path,
    dst: Path,
    config: Callable[[dict], dict] = lambda c: c,
    tensors: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> Path:
    """A copy of checkpoint `base` with its config and its shards' tensors changed (unchanged shards linked)."""
    dst.mkdir()
    for shard in base.glob("*.safetensors"):
        stored = load_file(shard) if tensors else {}
        changed = tensors(dict(stored)) if tensors else stored
        if changed.keys() != stored.keys() or any(changed[k] is not stored[k] for k in stored):
            save_file(changed, dst / shard.name)
        else:
            (dst / shard.name).symlink_to(shard)
    (dst / "config.json").write_text(json.dumps(config(json.loads((base / "config.json").read_text()))))
    return dst


def without(name: str) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    return lambda stored: {k: v for k, v in stored.items() if k != name}


def bad_expert_id(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An out-of-range hash-routing id in the trunk: found while writing it, after the support file."""
    key = "layers.2.ffn.gate.tid2eid"
    if key in stored:
        stored[key] = stored[key].clone()
        stored[key][5, 1] = TINY_ARGS.n_routed_experts
    return stored


@pytest.mark.parametrize(
    ("source", "config", "tensors", "support", "message"),
    [
        ("plain", None, None, "d.gguf", r"has no DSpark drafter: its config\.json has no dspark_\* keys"),
        ("drafted", None, None, "out.gguf", r"--dspark .*out\.gguf is the output path too"),
        ("drafted", None, None, "sub/../out.gguf", r"is the output path too"),
        ("drafted", None, without("mtp.1.attn.wkv.weight"), "d.gguf", r"no tensor 'mtp\.1\.attn\.wkv\.weight'"),
        ("drafted", {"dspark_markov_rank": None}, None, "d.gguf", r"has no 'dspark_markov_rank'"),
        ("drafted", {"dspark_target_layer_ids": [3, 4, 6]}, None, "d.gguf", r"layers \[3, 4, 6\]; the target has 6"),
        ("drafted", {"compress_ratios": [0, 0, 4, 128, 4, 128, 0, 4, 0]}, None, "d.gguf", r"must be 0"),
        ("drafted", None, bad_expert_id, "d.gguf", r"expert ids 0\.\.8, outside 0\.\.7"),
    ],
)
def test_bad_input_is_one_named_error_and_leaves_no_file(
    checkpoints, tmp_path: Path, monkeypatch, capsys, source, config, tensors, support, message
) -> None:
    base = checkpoints[0] if source == "plain" else checkpoints[1]
    if config or tensors:
        changes = config or {}
        base = variant(
            base,
            tmp_path / "src",
            lambda c: {k: v for k, v in (c | changes).items() if v is not None},
            tensors,
        )
    out = tmp_path / "out"
    code = run_cli(monkeypatch, "convert", str(base), str(out / "out.gguf"), "--dspark", str(out / support))
    err = capsys.readouterr().err
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.search(message, errors[0]), err
    assert "Traceback" not in err
    assert list(out.rglob("*.gguf*")) == []
