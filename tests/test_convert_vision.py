"""`dwarfstar convert --vision`: a checkpoint's vision encoder -> ds4's encoder GGUF (sources: RELEASES_2026.md).

The Vision-Exp checkpoint is test_convert's tiny official model (6 layers, 8 experts, 3 hash-routed,
one MTP layer) with a random `VISION_TINY`-sized encoder added as the real one stores it: flat
`vision_*` config keys, BF16 encoder tensors under their checkpoint names, F32 router biases (`bias_vl`
of every layer and the MTP layer, the hash layers' text `bias`). The V4.1 one is an encoder alone
under a nested `vision_config`, its language model's size in `text_config`, with `bias_vl` tensors the
encoder file must leave out. Expected args, names and metadata are restated here from the spec; the
encoder's tensor names and shapes are the loader's (`VisionArgs.tensor_shapes`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf as gguf_py
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_convert import run_cli, save_tiny_transformers_model, write_official_checkpoint
from test_convert_dspark import variant, without

from dwarfstar.backends.reference.vision import TorchVisionOps
from dwarfstar.convert.vision import convert_vision
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.model.vision import PatchGrid, VisionArgs, VisionEncoder
from dwarfstar.model.vision_file import RouterShape, open_vision

EXP_ARGS = VisionArgs(
    family="vision-exp", n_layers=2, dim=64, n_heads=4, inter_dim=96, out_dim=64, patch=14, downsample=3,
    norm_eps=1e-6, rope_theta=10000.0, max_tokens=384, min_pixels=147456, max_wh_ratio=8,
)  # fmt: skip
EXP_KEYS = {  # spec §0's flat keys; the aligner's width is the language model's hidden_size (64)
    "vision_n_layers": 2,
    "vision_dim": 64,
    "vision_n_heads": 4,
    "vision_inter_dim": 96,
    "vision_patch_size": 14,
    "vision_rope_theta": 10000.0,
    "vision_downsample_ratio": 3,
    "vision_max_n_token": 384,
    "vision_min_pixels": 147456,
    "vision_max_wh_ratio": 8,
}
# ds4's sidecar: every layer's and the MTP layer's image bias, the 3 hash layers' text bias
EXP_BIASES = [f"layers.{i}.ffn.gate.bias_vl" for i in range(6)] + ["mtp.0.ffn.gate.bias_vl"]
EXP_BIASES += [f"layers.{i}.ffn.gate.bias" for i in range(3)]
V41_ARGS = VisionArgs(
    family="v4.1-flash", n_layers=2, dim=64, n_heads=4, inter_dim=96, out_dim=80, patch=14, downsample=3,
    norm_eps=1e-6, rope_theta=10000.0, max_tokens=1024, min_pixels=295936, max_wh_ratio=0, image_token_id=129264,
)  # fmt: skip
V41_CONFIG = {
    "model_type": "deepseek_v41",
    "image_token_id": 129264,
    "text_config": {
        "model_type": "deepseek_v41_text",
        "hidden_size": 80,
        "num_hidden_layers": 4,
        "n_routed_experts": 12,
    },
    "vision_config": {  # min_pixels left out (transformers' default, 544²), max_wh_ratio null: no limit
        "model_type": "deepseek_v41_vision",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 96,
        "patch_size": 14,
        "rope_theta": 10000,
        "downsample_ratio": 3,
        "max_image_tokens": 1024,
        "max_wh_ratio": None,
    },
}


def random_encoder(args: VisionArgs, seed: int) -> dict[str, torch.Tensor]:
    """The encoder's checkpoint tensors in BF16, scaled so its activations stay O(1)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in args.tensor_shapes().items():
        t = torch.randn(shape, generator=generator)
        t = t / shape[1] ** 0.5 if len(shape) == 2 else 1 + 0.1 * t if "norm" in name else 0.1 * t
        tensors[name] = t.to(torch.bfloat16)
    return tensors


def random_biases(names: list[str], experts: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(experts, generator=generator) for name in names}


def save_shards(directory: Path, tensors: dict[str, torch.Tensor], stem: str) -> None:
    """Two shards, names interleaved, so each file holds part of the encoder."""
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[::2]}, directory / f"{stem}-1.safetensors")
    save_file({n: tensors[n] for n in names[1::2]}, directory / f"{stem}-2.safetensors")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """family -> (checkpoint directory, the tensors its encoder file must hold, as stored)."""
    root = tmp_path_factory.mktemp("vision-hf")
    exp, v41 = root / "vision-exp", root / "v41"
    exp.mkdir()
    v41.mkdir()
    write_official_checkpoint(exp, save_tiny_transformers_model(root / "hf", seed=0))
    encoder = random_encoder(EXP_ARGS, seed=1) | random_biases(EXP_BIASES, 8, seed=2)
    save_shards(exp, encoder, "vision")
    config = json.loads((exp / "config.json").read_text())
    (exp / "config.json").write_text(json.dumps(config | EXP_KEYS))
    v41_encoder = random_encoder(V41_ARGS, seed=3)
    language = random_biases([f"layers.{i}.ffn.gate.bias_vl" for i in range(4)], 12, seed=4)  # not the encoder's
    save_shards(v41, v41_encoder | language | {"embed.weight": torch.randn(16, 80).to(torch.bfloat16)}, "model")
    (v41 / "config.json").write_text(json.dumps(V41_CONFIG))
    return {"vision-exp": (exp, encoder), "v4.1-flash": (v41, v41_encoder)}


@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("vision-gguf")
    for family, (src, _) in checkpoints.items():
        convert_vision(src, out / f"{family}.gguf")
    return {family: out / f"{family}.gguf" for family in checkpoints}


@pytest.mark.parametrize(
    ("family", "args", "language", "router"),
    [
        ("vision-exp", EXP_ARGS, (6, 8), RouterShape(n_layers=6, n_experts=8, n_hash_layers=3, n_mtp_layers=1)),
        ("v4.1-flash", V41_ARGS, (4, 12), None),
    ],
)
def test_the_encoder_file_reads_back_as_the_checkpoint(checkpoints, converted, family, args, language, router):
    src, stored = checkpoints[family]
    with open_vision(converted[family]) as vision:
        assert vision.args == args
        assert vision.language == language and vision.router == router
        assert vision.name == f"{src.name} vision encoder"
        meta = vision.gguf.metadata
        assert meta["general.architecture"] == "deepseek4-vision"
        assert meta["deepseek4-vision.checkpoint_variant"] == family
        assert sorted(vision.gguf.tensors) == sorted(stored)  # the language model's tensors left out
        for name, want in stored.items():
            got = vision.tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name  # bit for bit
        if router is not None:
            assert torch.equal(vision.image_router_biases()[5], stored["layers.5.ffn.gate.bias_vl"])
            assert torch.equal(vision.mtp_image_router_biases()[0], stored["mtp.0.ffn.gate.bias_vl"])
            assert torch.equal(vision.hash_text_biases()[2], stored["layers.2.ffn.gate.bias"])
    # an independent reader: GGUF dims are the checkpoint's reversed, types BF16 and F32
    reader = gguf_py.GGUFReader(converted[family])
    for tensor in reader.tensors:
        assert tuple(int(d) for d in tensor.shape) == tuple(reversed(stored[tensor.name].shape)), tensor.name
        want_type = (
            gguf_py.GGMLQuantizationType.F32 if ".ffn.gate." in tensor.name else gguf_py.GGMLQuantizationType.BF16
        )
        assert tensor.tensor_type == want_type, tensor.name


@pytest.mark.parametrize("family", ["vision-exp", "v4.1-flash"])
def test_the_converted_encoder_encodes_as_the_checkpoint(checkpoints, converted, family):
    _, stored = checkpoints[family]
    grid = PatchGrid(4, 5)
    pixels = np.random.default_rng(0).uniform(-1, 1, size=(3, 4 * 14, 5 * 14)).astype(np.float32)
    with open_vision(converted[family]) as vision:
        got = VisionEncoder(TorchVisionOps(vision.args, vision.weights())).encode(pixels, grid)
        args = vision.args
    want = VisionEncoder(TorchVisionOps(args, stored)).encode(pixels, grid)
    assert got.shape == (2 * 2, args.out_dim) and torch.isfinite(got).all()
    assert torch.equal(got, want)


def test_convert_writes_the_model_and_its_encoder_which_run_together(checkpoints, tmp_path, monkeypatch, capsys):
    src, _ = checkpoints["vision-exp"]
    model, encoder = tmp_path / "model.gguf", tmp_path / "encoder.gguf"
    assert run_cli(monkeypatch, "convert", str(src), str(model), "--outtype", "f32", "--vision", str(encoder)) == 0
    out = capsys.readouterr().out
    assert f"wrote {encoder} (vision encoder, {len(EXP_ARGS.tensor_shapes()) + 10} tensors)" in out
    assert f"wrote {model} (f32," in out
    engine = load_engine(EngineSpec(model, "reference", ctx=512, vision=encoder))  # what --vision does
    assert engine.images is not None and engine.images.args == EXP_ARGS


def test_a_vision_exp_language_file_names_its_variant_and_its_encoder(checkpoints, tmp_path):
    """As ds4's: the language file of a Vision-Exp checkpoint says which it is and that it needs its
    encoder; a conversion without --vision says the checkpoint has one, and one with it does not list
    the encoder's tensors among those skipped."""
    from dwarfstar.convert.hf import plan_conversion, write_conversion
    from dwarfstar.convert.vision import plan_vision
    from dwarfstar.gguf.reader import GGUFFile

    src, stored = checkpoints["vision-exp"]
    alone = plan_conversion(src, "f32")
    assert any("--vision FILE writes it" in note for note in alone.notes)
    assert any("vision.blocks.*" in note for note in alone.notes if note.startswith("skipping"))
    encoder = [t.source.name for t in plan_vision(src).tensors]
    paired = plan_conversion(src, "f32", elsewhere=encoder)
    assert not any("--vision" in note or "vision." in note or "aligner." in note for note in paired.notes)
    write_conversion(paired, tmp_path / "model.gguf", None)
    meta = GGUFFile(tmp_path / "model.gguf").metadata
    assert meta["deepseek4.checkpoint_variant"] == "vision-exp" and meta["deepseek4.vision.sidecar_required"] is True
    plain = tmp_path / "plain"
    plain.mkdir()
    write_official_checkpoint(plain, save_tiny_transformers_model(tmp_path / "hf", seed=0))  # no vision_* keys
    assert "deepseek4.checkpoint_variant" not in plan_conversion(plain, "f32").metadata


def test_the_encoder_alone_runs_beside_a_matching_synthetic_model(checkpoints, tmp_path, monkeypatch, capsys):
    src, _ = checkpoints["vision-exp"]
    model, encoder = tmp_path / "tiny.gguf", tmp_path / "encoder.gguf"
    write_synthetic_model(model, TINY, seed=0)
    assert run_cli(monkeypatch, "convert", str(src), "--vision", str(encoder)) == 0
    assert [p.name for p in tmp_path.iterdir()] == sorted(
        ["tiny.gguf", "encoder.gguf"], key=[model.name, encoder.name].index
    )
    assert load_engine(EngineSpec(model, "reference", ctx=512, vision=encoder)).images is not None


def as_stored(dtype: torch.dtype, name: str):
    def change(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(dtype) if k == name else v for k, v in stored.items()}

    return change


def resized(name: str, shape: tuple[int, ...]):
    return lambda stored: {k: torch.zeros(shape, dtype=v.dtype) if k == name else v for k, v in stored.items()}


def unset(*keys: str):
    return lambda c: {k: v for k, v in c.items() if k not in keys}


def changed(**values):
    return lambda c: c | values


V41_VISION = V41_CONFIG["vision_config"]
NEEDS = "but the vision encoder needs"


@pytest.mark.parametrize(
    ("family", "config", "tensors", "message"),
    [
        ("vision-exp", unset(*EXP_KEYS), None, r"declares no vision encoder: it has neither vision_\* keys"),
        ("vision-exp", unset("vision_n_heads"), None, r"missing required key 'vision_n_heads'"),
        ("vision-exp", changed(vision_dim="wide"), None, r"vision_dim must be an integer, got 'wide'"),
        ("vision-exp", changed(vision_patch_size=0), None, r"vision_patch_size must be positive, got 0"),
        ("vision-exp", changed(vision_n_heads=5), None, r"width of 64 does not split into 5 heads"),
        ("vision-exp", changed(vision_config=V41_VISION), None, r"both a vision_config .* and flat"),
        ("vision-exp", None, without("vision.blocks.1.mlp.w2.weight"), r"tensor 'vision\.blocks\.1\.mlp\.w2\.weight'$"),
        ("vision-exp", None, without("mtp.0.ffn.gate.bias_vl"), r"no tensor 'mtp\.0\.ffn\.gate\.bias_vl'$"),
        ("vision-exp", None, without("layers.1.ffn.gate.bias"), r"no tensor 'layers\.1\.ffn\.gate\.bias'$"),
        ("vision-exp", changed(vision_inter_dim=80), None,
         rf"'vision\.blocks\.0\.mlp\.w1\.weight' has shape \[192, 64\], {NEEDS} \[160, 64\]"),
        ("vision-exp", None, resized("aligner.w2.bias", (63,)), rf"'aligner\.w2\.bias' has shape \[63\], {NEEDS}"),
        ("vision-exp", None, as_stored(torch.float32, "aligner.w1.weight"), r"'aligner\.w1\.weight' is stored as F32;"),
        ("vision-exp", None, as_stored(torch.float16, "image_pad"), r"'image_pad' is stored as F16; .* as BF16"),
        ("vision-exp", None, as_stored(torch.bfloat16, "layers.4.ffn.gate.bias_vl"),
         r"'layers\.4\.ffn\.gate\.bias_vl' is stored as BF16; .* as F32"),
        ("v4.1-flash", changed(vision_config=V41_VISION | {"model_type": "qwen2_5_vl"}), None,
         r"unknown vision encoder family vision_config\.model_type 'qwen2_5_vl'"),
        ("v4.1-flash", changed(vision_config=[1, 2]), None, r"vision_config must be an object"),
        ("v4.1-flash", unset("text_config"), None, r"has a vision_config .* but no text_config"),
        ("v4.1-flash", changed(text_config={"hidden_size": 80, "num_hidden_layers": 4}), None,
         r"missing required key 'text_config\.n_routed_experts'"),
        ("v4.1-flash", changed(text_config=V41_CONFIG["text_config"] | {"n_routed_experts": 0}), None,
         r"text_config\.n_routed_experts must be positive, got 0"),
        ("v4.1-flash", None, without("image_newline"), r"no tensor 'image_newline'"),
    ],
)  # fmt: skip
def test_bad_input_is_one_named_error_and_leaves_no_file(
    checkpoints, tmp_path, monkeypatch, capsys, family, config, tensors, message
):
    src = variant(checkpoints[family][0], tmp_path / "src", config or (lambda c: c), tensors)
    out = tmp_path / "out"
    code = run_cli(monkeypatch, "convert", str(src), "--vision", str(out / "encoder.gguf"))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and re.search(message, errors[0]), err
    assert "Traceback" not in err
    assert list(out.rglob("*.gguf*")) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--vision", "{out}/a.gguf", "{out}/a.gguf"], r"--vision .*a\.gguf is the output path too"),
        (["{out}/a.gguf", "--dspark", "{out}/d.gguf", "--vision", "{out}/d.gguf"], r"d\.gguf is the --dspark"),
        ([], r"convert writes OUT .*, --vision FILE .* or both"),
        (["--dspark", "{out}/d.gguf", "--vision", "{out}/v.gguf"], r"--dspark writes the language model's drafter"),
    ],
)  # fmt: skip
def test_bad_output_paths_are_named(checkpoints, tmp_path, monkeypatch, capsys, argv, message):
    src, _ = checkpoints["vision-exp"]
    code = run_cli(monkeypatch, "convert", str(src), *(a.format(out=tmp_path) for a in argv))
    err = capsys.readouterr().err
    assert code == 2 and re.search(message, err) and "Traceback" not in err, err
    assert list(tmp_path.rglob("*.gguf*")) == []


def test_a_trunk_that_fails_leaves_no_encoder_file(checkpoints, tmp_path, monkeypatch, capsys):
    """The encoder is written first; the trunk's own error (a hash id past the experts, found while
    writing it) then removes it, as --dspark's support file."""
    src, _ = checkpoints["vision-exp"]

    def bad_id(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if "layers.2.ffn.gate.tid2eid" in stored:
            stored["layers.2.ffn.gate.tid2eid"] = torch.full_like(stored["layers.2.ffn.gate.tid2eid"], 8)
        return stored

    bad = variant(src, tmp_path / "src", tensors=bad_id)
    code = run_cli(monkeypatch, "convert", str(bad), str(tmp_path / "m.gguf"), "--vision", str(tmp_path / "v.gguf"))
    assert code == 2 and "outside 0..7" in capsys.readouterr().err
    assert list(tmp_path.glob("*.gguf*")) == []
