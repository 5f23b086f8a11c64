"""ds4's vision encoder GGUFs (issue 34): the synthetic writer's file read back exactly, its bytes fixed
by the seed, every bad input a named error, `dwarfstar inspect` on an encoder and `synth --preset
vision-tiny` through the command line. Broken files are written here, one fault each."""

from __future__ import annotations

import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_cli_front import cli  # `dwarfstar ARGV` as the console script runs it

from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import GGMLType, ValueType
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model.synthetic import VISION_PRESETS, synthetic_vision_tensors, write_synthetic_vision
from dwarfstar.model.vision import V41, VISION_EXP, VISION_TINY
from dwarfstar.model.vision_file import RouterShape, open_vision, vision_metadata

TINY_ROUTER = VISION_PRESETS["vision-tiny"][1]
V41_TINY = replace(VISION_TINY, family=V41, image_token_id=129264, max_tokens=1024, min_pixels=295936, max_wh_ratio=0)


def write_encoder(path: Path, args=VISION_TINY, router=TINY_ROUTER, *, meta=None, drop=(), shapes=None, types=None):
    """The synthetic encoder with one fault: metadata changed (`meta`: key -> (type, value), or None to
    drop it), tensors dropped, reshaped (torch order) or retyped; new names in `shapes` are added."""
    language = (router.n_layers, router.n_experts)
    metadata = vision_metadata(args, "broken", language)
    for key, value in (meta or {}).items():
        if value is None:
            metadata.pop(key)
        else:
            metadata[key] = value
    tensors = {name: (shape, t) for name, shape, t, _ in synthetic_vision_tensors(args, 0, router)}
    for name in drop:
        del tensors[name]
    for name, shape in (shapes or {}).items():
        tensors[name] = (shape, tensors.get(name, (shape, GGMLType.F32))[1])
    for name, t in (types or {}).items():
        tensors[name] = (tensors[name][0], t)
    with GGUFWriter(path, metadata) as writer:
        for name, (shape, t) in tensors.items():
            writer.add_tensor(name, shape, t)
        for name, (shape, t) in tensors.items():
            size = torch.Size(shape).numel() * {GGMLType.F32: 4, GGMLType.Q8_0: 34 / 32}.get(t, 2)
            writer.write_tensor(name, bytes(int(size)))
    return path


def refused(path: Path, *phrases: str) -> str:
    with pytest.raises(ModelFileError) as e:
        open_vision(path)
    message = str(e.value)
    assert str(path) in message, message
    for phrase in phrases:
        assert phrase in message, message
    return message


def test_the_synthetic_encoder_reads_back_exactly(tmp_path):
    path = tmp_path / "enc.gguf"
    write_synthetic_vision(path, VISION_TINY, seed=3, router=TINY_ROUTER, name="tiny encoder")
    with open_vision(path) as v:
        assert v.args == VISION_TINY  # f32 keys too: norm_eps reads 1e-06, not 9.99999997e-07
        assert (v.name, v.language, v.router) == ("tiny encoder", (6, 8), RouterShape(6, 8, 3, 1))
        written = synthetic_vision_tensors(VISION_TINY, 3, TINY_ROUTER)
        assert list(v.gguf.tensors) == [name for name, *_ in written]
        assert len(written) == 3 + 8 * 2 + 4 + 4 + 6 + 1 + 3
        for name, shape, ggml_type, draw in written:
            got = v.tensor(name)
            want = draw().to(torch.bfloat16 if ggml_type == GGMLType.BF16 else torch.float32)
            assert got.dtype == want.dtype and got.shape == shape and torch.equal(got, want), name
            # GGUF dims are the reverse of the checkpoint's [out, in]
            assert v.gguf.tensors[name].shape == shape
        name = b"vision.patch_embed.proj.weight"  # on disk: ne0 (the input, 3·14·14) first
        assert struct.pack("<Q", len(name)) + name + struct.pack("<I2Q", 2, 588, 64) in path.read_bytes()
        raw = v.gguf.raw("vision.blocks.1.attn.wqkv.weight")
        assert v.tensor("vision.blocks.1.attn.wqkv.weight").data_ptr() == raw.ctypes.data  # no copy
        assert set(v.weights()) == set(VISION_TINY.tensor_shapes())
        assert list(v.image_router_biases()) == list(range(6))
        assert list(v.mtp_image_router_biases()) == [0] and list(v.hash_text_biases()) == [0, 1, 2]
        assert torch.equal(v.image_router_biases()[4], v.tensor("layers.4.ffn.gate.bias_vl"))


def test_a_v41_encoder_has_its_token_id_and_no_router_biases(tmp_path):
    path = tmp_path / "v41.gguf"
    write_synthetic_vision(path, V41_TINY, router=RouterShape(40, 384))
    with open_vision(path) as v:
        assert v.args == V41_TINY and v.args.image_token_id == 129264 and v.args.max_wh_ratio == 0
        assert v.language == (40, 384) and v.router is None and v.image_router_biases() == {}
        assert "image_pad" not in v.gguf.tensors and "image_newline" in v.gguf.tensors
        assert all(info.ggml_type == GGMLType.BF16 for info in v.gguf.tensors.values())


def test_the_bytes_are_fixed_by_the_seed(tmp_path):
    def written(seed: int, name: str) -> bytes:
        path = tmp_path / name
        write_synthetic_vision(path, VISION_TINY, seed=seed, router=TINY_ROUTER)
        return path.read_bytes()

    first = written(7, "a.gguf")
    assert written(7, "b.gguf") == first
    assert written(8, "c.gguf") != first
    assert first[:4] == b"GGUF" and struct.unpack_from("<I", first, 4)[0] == 3


def test_the_real_vision_exp_layout():
    """vision-exp-shaped is ds4's sidecar: 316 tensors, 933 MB (not written here: its inventory is enough)."""
    args, router = VISION_PRESETS["vision-exp-shaped"]
    tensors = synthetic_vision_tensors(args, 0, router)
    assert len(tensors) == 316
    size = sum(torch.Size(shape).numel() * (2 if t == GGMLType.BF16 else 4) for _, shape, t, _ in tensors)
    assert size == pytest.approx(933e6, rel=1e-3)
    assert sum(t == GGMLType.F32 for _, _, t, _ in tensors) == 43 + 3 + 3
    meta = vision_metadata(args, "x", (43, 256))
    assert meta["deepseek4-vision.projection_length"] == (ValueType.UINT32, 4096)
    assert meta["deepseek4-vision.attention.layer_norm_rms_epsilon"] == (ValueType.FLOAT32, 1e-6)


def test_not_an_encoder(tmp_path, tiny_model_file):
    text = tmp_path / "notes.gguf"
    text.write_text("hello, not a model\n")
    refused(text, "not a GGUF file")
    refused(tmp_path / "missing.gguf", "not found")
    with pytest.raises(ModelFileError, match="is a directory"):
        open_vision(tmp_path)
    lm = tiny_model_file(0)
    message = refused(lm, "is a DeepSeek V4 language model, not a vision encoder", "--vision takes the encoder")
    assert "-m" in message
    other = write_encoder(tmp_path / "llama.gguf", meta={"general.architecture": (ValueType.STRING, "llama")})
    refused(other, "general.architecture is 'llama', expected 'deepseek4-vision'")


def test_bad_metadata(tmp_path):
    variant = write_encoder(
        tmp_path / "variant.gguf", meta={"deepseek4-vision.checkpoint_variant": (ValueType.STRING, "v5-vision")}
    )
    refused(variant, "unknown vision encoder variant 'v5-vision'", "vision-exp, v4.1-flash")
    for key in (
        "deepseek4-vision.block_count",
        "deepseek4-vision.rope.freq_base",
        "deepseek4-vision.checkpoint_variant",
    ):
        path = write_encoder(tmp_path / f"{key}.gguf", meta={key: None})
        refused(path, f"metadata lacks '{key}'")
    no_token = write_encoder(tmp_path / "token.gguf", V41_TINY, meta={"deepseek4-vision.image.token_id": None})
    refused(no_token, "lacks 'deepseek4-vision.image.token_id'")
    wrong_type = write_encoder(
        tmp_path / "type.gguf", meta={"deepseek4-vision.embedding_length": (ValueType.STRING, "64")}
    )
    refused(wrong_type, "deepseek4-vision.embedding_length must be an unsigned integer, got '64'")
    zero = write_encoder(tmp_path / "zero.gguf", meta={"deepseek4-vision.attention.head_count": (ValueType.UINT32, 0)})
    refused(zero, "deepseek4-vision.attention.head_count must be positive")
    heads = write_encoder(
        tmp_path / "heads.gguf", meta={"deepseek4-vision.attention.head_count": (ValueType.UINT32, 5)}
    )
    refused(heads, "does not split into 5 heads")


def test_missing_misshapen_and_unexpected_tensors(tmp_path):
    refused(write_encoder(tmp_path / "a.gguf", drop=["vision.blocks.1.mlp.w2.weight"]), "lacks 1 tensors")
    transposed = write_encoder(tmp_path / "b.gguf", shapes={"vision.blocks.0.attn.wqkv.weight": (64, 192)})
    refused(transposed, "vision.blocks.0.attn.wqkv.weight has shape (64, 192), expected (192, 64)")
    # a V4.1 file labelled Vision-Exp lacks image_pad; a Vision-Exp file labelled V4.1 has one too many
    refused(write_encoder(tmp_path / "c.gguf", drop=["image_pad"]), "first image_pad")
    relabelled = write_encoder(
        tmp_path / "d.gguf", VISION_TINY, meta={"deepseek4-vision.checkpoint_variant": (ValueType.STRING, V41)}
    )
    refused(relabelled, "lacks 'deepseek4-vision.image.token_id'")
    extra = write_encoder(tmp_path / "e.gguf", shapes={"vision.pos_embed": (64,)})
    refused(extra, "unexpected tensor 'vision.pos_embed'", VISION_EXP)
    quantized = write_encoder(tmp_path / "f.gguf", types={"aligner.w2.weight": GGMLType.Q8_0})
    refused(quantized, "'aligner.w2.weight' is Q8_0", "BF16, F16 or F32")


def test_bad_router_biases(tmp_path):
    refused(write_encoder(tmp_path / "a.gguf", drop=["layers.3.ffn.gate.bias_vl"]), "lack layers.3.ffn.gate.bias_vl")
    gap = write_encoder(tmp_path / "b.gguf", shapes={"mtp.2.ffn.gate.bias_vl": (8,)})
    refused(gap, "lack mtp.1.ffn.gate.bias_vl")
    past = write_encoder(tmp_path / "c.gguf", shapes={"layers.6.ffn.gate.bias_vl": (8,)})
    refused(past, "layers.6.ffn.gate.bias_vl is past the language model's 6 layers")
    wide = write_encoder(tmp_path / "d.gguf", shapes={"layers.2.ffn.gate.bias_vl": (16,)})
    refused(wide, "layers.2.ffn.gate.bias_vl has shape (16,), expected (8,) for 8 experts")
    unstated = write_encoder(tmp_path / "e.gguf", meta={"deepseek4-vision.language.expert_count": None})
    refused(unstated, "lacks 'deepseek4-vision.language.expert_count'")
    both = write_encoder(
        tmp_path / "f.gguf",
        meta={"deepseek4-vision.language.expert_count": None, "deepseek4-vision.language.block_count": None},
    )
    refused(both, "carries router biases but not the language model they are for")


def test_a_truncated_encoder(tmp_path):
    path = tmp_path / "cut.gguf"
    write_synthetic_vision(path, VISION_TINY, router=TINY_ROUTER)
    content = path.read_bytes()
    path.write_bytes(content[: len(content) - 1000])
    refused(path, "runs past the end of the file", "truncated")
    path.write_bytes(content[:200])
    refused(path, "truncated")


def test_inspect_an_encoder(tmp_path, monkeypatch, capsys):
    path = tmp_path / "enc.gguf"
    write_synthetic_vision(path, VISION_TINY, router=TINY_ROUTER)
    code, out, _ = cli(monkeypatch, capsys, "inspect", str(path))
    assert code == 0
    with open_vision(path) as v:
        size = v.nbytes
    summary = [
        "vision encoder: DeepSeek V4 Flash Vision-Exp (vision-exp)",
        "  ViT: 2 layers, width 64, 4 heads of 16, MLP 96, 14-pixel patches",
        "  aligner: 3x3 patches per token, output width 64",
        "  image budget: 384 tokens, min 147456 pixels, max width/height ratio 8:1",
        f"  tensors: 37, {size:,} bytes ({size / 1e6:.1f} MB)",
        "  image router biases: 6 layers and 1 MTP layer of 8 experts; text biases of 3 hash-routed layers",
    ]
    assert "\n".join(summary) in out
    assert "  deepseek4-vision.checkpoint_variant = 'vision-exp'" in out and "bytes read per decoded token" not in out

    v41 = write_encoder(tmp_path / "v41.gguf", V41_TINY, RouterShape(40, 384))
    out = cli(monkeypatch, capsys, "inspect", str(v41))[1]
    assert "vision encoder: DeepSeek V4.1 Flash (v4.1-flash)" in out and "  image token id: 129264" in out
    assert "max width/height ratio none" in out
    assert "  image router biases: none (V4.1's language model file carries them)" in out

    broken = write_encoder(tmp_path / "broken.gguf", drop=["vision.norm.weight"])
    code, out, _ = cli(monkeypatch, capsys, "inspect", str(broken))
    assert code == 0 and "vision encoder: INVALID: " in out and "first vision.norm.weight" in out


def test_synth_vision_presets(tmp_path, monkeypatch, capsys):
    out_path = tmp_path / "vision-tiny.gguf"
    code, out, err = cli(monkeypatch, capsys, "synth", str(out_path), "--preset", "vision-tiny", "--seed", "2")
    assert code == 0, err
    assert "(vision-tiny: vision-exp encoder, 2 ViT layers, BF16, image router biases for 6 layers of 8 experts" in out
    direct = tmp_path / "direct.gguf"
    write_synthetic_vision(direct, VISION_TINY, seed=2, router=TINY_ROUTER, name="dwarfstar-vision-tiny")
    assert out_path.read_bytes() == direct.read_bytes()
    with open_vision(out_path) as v:
        assert v.args == VISION_TINY and v.router == RouterShape(6, 8, 3, 1)

    one = tmp_path / "one.gguf"
    assert cli(monkeypatch, capsys, "synth", str(one), "--preset", "vision-tiny", "--layers", "1")[0] == 0
    with open_vision(one) as v:
        assert v.args == replace(VISION_TINY, n_layers=1)

    for flags, phrase in (
        (["--layout", "ds4"], "--layout is for language models"),
        (["--split-at", "1"], "--split-at is for language models"),
    ):
        code, _, err = cli(monkeypatch, capsys, "synth", str(tmp_path / "x.gguf"), "--preset", "vision-tiny", *flags)
        assert code == 2 and phrase in err
    code, _, err = cli(monkeypatch, capsys, "synth", str(tmp_path / "x.gguf"), "--preset", "vision-huge")
    assert code == 2 and "pro-shaped, vision-tiny, vision-exp-shaped" in err
    assert not (tmp_path / "x.gguf").exists()


def test_bench_vision_encodes_an_image_from_an_encoder_file(tmp_path, monkeypatch, capsys):
    path = tmp_path / "enc.gguf"
    write_synthetic_vision(path, VISION_TINY, router=TINY_ROUTER)
    code, out, _ = cli(monkeypatch, capsys, "bench", "vision", str(path), "--size", "1920x1080", "--repeat", "1")
    assert code == 0, out
    (row,) = [line.split() for line in out.splitlines() if line.lstrip().startswith("1920x1080")]
    # the canvas of a 1920x1080 image for Vision-Exp (worked from the reference's plan), its patches
    assert row[1:3] == ["1036x588", str(74 * 42)]
    assert float(row[5]) > 0 and float(row[6]) > 0
    code, _, err = cli(monkeypatch, capsys, "bench", "vision", str(path), "--size", "wide")
    assert code == 2 and "WIDTHxHEIGHT" in err
