"""Model files end to end: synthetic models load and validate, bad files get a clear error, and the
`dwarfstar run` debug contract writes the documented logits dump."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import GGMLType, ValueType
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, TINY_K, write_synthetic_model


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_synthetic_model(path, TINY, seed=0)
    return path


def rewrite(
    src: Path,
    dst: Path,
    meta: dict | None = None,
    drop: str | None = None,
    reshape: tuple[str, tuple[int, ...]] | None = None,
    retype: tuple[str, GGMLType] | None = None,
) -> Path:
    """Copy a GGUF, changing one thing, to build a broken file."""
    with GGUFFile(src) as f:
        typed = {}
        for key, value in f.metadata.items():
            vtype, item = f.metadata_types[key]
            typed[key] = (vtype, (item, value) if vtype == ValueType.ARRAY else value)
        typed.update(meta or {})
        with GGUFWriter(dst, typed) as w:
            names = [n for n in f.tensors if n != drop]
            for name in names:
                info = f.tensors[name]
                shape = reshape[1] if reshape and reshape[0] == name else info.shape
                gtype = retype[1] if retype and retype[0] == name else info.ggml_type
                w.add_tensor(name, shape, gtype)
            for name in names:
                info = f.tensors[name]
                data = f.tensor(name)
                if retype and retype[0] == name:
                    data = data.half()
                elif reshape and reshape[0] == name:
                    data = data.flatten()[: int(np.prod(reshape[1]))]
                w.write_tensor(name, data.numpy())
    return dst


def test_synthetic_models_are_deterministic(tmp_path):
    write_synthetic_model(tmp_path / "a.gguf", TINY, seed=3)
    write_synthetic_model(tmp_path / "b.gguf", TINY, seed=3)
    write_synthetic_model(tmp_path / "c.gguf", TINY, seed=4)
    a, b, c = ((tmp_path / n).read_bytes() for n in ("a.gguf", "b.gguf", "c.gguf"))
    assert a == b and a != c


def test_ds4_layout_with_kquant_experts_loads_and_runs(tmp_path):
    path = tmp_path / "tiny-k.gguf"
    write_synthetic_model(path, TINY_K, layout="ds4", seed=0)
    model = open_model(path)
    types = {name: info.ggml_type for name, info in model.gguf.tensors.items()}
    assert types["blk.3.ffn_gate_exps.weight"] == GGMLType.IQ2_XXS
    assert types["blk.3.ffn_down_exps.weight"] == GGMLType.Q2_K
    assert types["blk.3.attn_q_b.weight"] == GGMLType.Q8_0
    assert types["token_embd.weight"] == GGMLType.F16
    assert types["blk.2.indexer_compressor_kv.weight"] == GGMLType.F16
    assert types["blk.3.attn_norm.weight"] == GGMLType.F32
    ref = ReferenceModel(model)
    logits = ref.forward(list(range(100, 140)), ref.new_state())
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_wrong_architecture(tiny_path, tmp_path):
    bad = rewrite(tiny_path, tmp_path / "bad.gguf", meta={"general.architecture": (ValueType.STRING, "llama")})
    with pytest.raises(ModelFileError, match="not a DeepSeek V4 model: general.architecture is 'llama'"):
        open_model(bad)


def test_missing_tensor(tiny_path, tmp_path):
    bad = rewrite(tiny_path, tmp_path / "bad.gguf", drop="blk.4.indexer.proj.weight")
    with pytest.raises(ModelFileError, match="missing tensor 'blk.4.indexer.proj.weight'"):
        open_model(bad)


def test_misshaped_tensor(tiny_path, tmp_path):
    bad = rewrite(tiny_path, tmp_path / "bad.gguf", reshape=("blk.1.attn_kv.weight", (64, 64)))
    with pytest.raises(ModelFileError, match=r"'blk.1.attn_kv.weight' has shape \[64, 64\], expected \[128, 64\]"):
        open_model(bad)


def test_wrong_tensor_type(tiny_path, tmp_path):
    bad = rewrite(tiny_path, tmp_path / "bad.gguf", retype=("output_norm.weight", GGMLType.F16))
    with pytest.raises(ModelFileError, match="'output_norm.weight' has type F16, expected one of F32"):
        open_model(bad)


def test_wrong_hyperparameter_is_caught_by_shapes(tiny_path, tmp_path):
    bad = rewrite(tiny_path, tmp_path / "bad.gguf", meta={"deepseek4.attention.q_lora_rank": (ValueType.UINT32, 48)})
    with pytest.raises(ModelFileError, match="attn_q_a.weight' has shape"):
        open_model(bad)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dwarfstar", *args], capture_output=True, text=True, timeout=300)


def test_dump_logits_contract(tiny_path, tmp_path):
    out = tmp_path / "logits.npy"
    done = run_cli(
        "run",
        "-m",
        str(tiny_path),
        "--prompt-tokens",
        "0,17,42",
        "--dump-logits",
        str(out),
        "--no-qat-rounding",
        "--backend",
        "reference",
    )
    assert done.returncode == 0, done.stderr
    dumped = np.load(out)
    assert dumped.dtype == np.float32 and dumped.shape == (3, TINY.vocab_size)
    ref = ReferenceModel(open_model(tiny_path), qat=False)
    assert np.array_equal(dumped, ref.forward([0, 17, 42], ref.new_state()).numpy())


def test_cli_reports_bad_files_without_traceback(tiny_path, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_path.read_bytes()[:-1000])
    done = run_cli("run", "-m", str(truncated), "--prompt-tokens", "1,2")
    assert done.returncode == 2
    assert "error:" in done.stderr and "Traceback" not in done.stderr
    assert "truncated" in done.stderr or "past the end" in done.stderr


def test_a_file_with_the_drafters_trailing_compress_ratios_loads_as_its_trunk(tmp_path):
    """ds4 writes V4 Flash 0731's and PRO 0813's `compress_ratios` from their configs: one entry per
    layer, then a 0 per DSpark stage. The layers' entries make the model; the file's logits are
    those of the same weights without the trailing entries."""
    plain, drafted = tmp_path / "plain.gguf", tmp_path / "drafted.gguf"
    write_synthetic_model(plain, TINY, seed=5)
    write_synthetic_model(drafted, TINY.with_(compress_ratios=(*TINY.compress_ratios, 0, 0, 0)), seed=5)
    model = open_model(drafted)
    assert model.args.compress_ratios[: TINY.n_layers] == TINY.compress_ratios
    tokens = list(range(100, 140))
    runs = [ReferenceModel(m) for m in (open_model(plain), model)]
    want, got = (backend.forward(tokens, backend.new_state()) for backend in runs)
    assert torch.equal(got, want)
