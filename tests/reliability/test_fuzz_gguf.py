"""The GGUF reader under mutated real files: every input opens (and its tensors read) or raises
ModelFileError; never another exception, a crash or a hang."""

from __future__ import annotations

import numpy as np
import pytest
from fuzz_support import FUZZ, mutated, tally
from hypothesis import given
from hypothesis import strategies as st

from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import GGMLType, ValueType
from dwarfstar.gguf.reader import open_gguf
from dwarfstar.gguf.writer import GGUFWriter


def seed_file(path) -> bytes:
    """A small GGUF with every metadata kind (numbers, strings, nested arrays) and three tensor types."""
    metadata = {
        "general.architecture": (ValueType.STRING, "deepseek4"),
        "general.name": (ValueType.STRING, "fuzz seed ✓"),
        "deepseek4.block_count": (ValueType.UINT32, 2),
        "deepseek4.rope.freq_base": (ValueType.FLOAT32, 10000.0),
        "deepseek4.flag": (ValueType.BOOL, True),
        "deepseek4.big": (ValueType.UINT64, 2**40),
        "deepseek4.attention.compress_ratios": (ValueType.ARRAY, (ValueType.UINT32, [0, 4, 128, 4])),
        "tokenizer.ggml.tokens": (ValueType.ARRAY, (ValueType.STRING, ["<a>", "b", "ç", ""])),
    }
    rng = np.random.default_rng(0)
    q8_blocks = rng.integers(0, 256, size=(4, 34), dtype=np.uint8)  # 2 rows of 64: 4 blocks of 32
    q8_blocks[:, :2] = np.full((4, 1), 0.01, np.float16).view(np.uint8)  # finite scales
    tensors = {
        "output_norm.weight": (GGMLType.F32, (64,), rng.standard_normal(64).astype(np.float32)),
        "token_embd.weight": (GGMLType.F16, (4, 32), rng.standard_normal((4, 32)).astype(np.float16)),
        "blk.0.attn_q_a.weight": (GGMLType.Q8_0, (2, 64), q8_blocks),
    }
    with GGUFWriter(path, metadata) as writer:
        for name, (kind, shape, _data) in tensors.items():
            writer.add_tensor(name, shape, kind)
        for name, (_kind, _shape, data) in tensors.items():
            writer.write_tensor(name, data)
    return path.read_bytes()


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> bytes:
    return seed_file(tmp_path_factory.mktemp("gguf") / "seed.gguf")


def read_all(path) -> int:
    with open_gguf(path) as gguf:
        for name in gguf.tensors:
            gguf.tensor(name)
        return len(gguf.tensors)


def test_the_seed_reads(seed, tmp_path):
    path = tmp_path / "seed.gguf"
    path.write_bytes(seed)
    assert read_all(path) == 3


HEADER_BYTES = 700  # the metadata and tensor directory of the seed


@FUZZ
@given(data=st.data())
def test_mutated_files_open_or_raise_model_file_error(seed, tmp_path, data):
    path = tmp_path / "case.gguf"
    path.write_bytes(data.draw(mutated(seed, hot=HEADER_BYTES)))
    try:
        read_all(path)
    except ModelFileError as exc:
        assert str(exc)  # a message that names the problem
        tally("gguf reader", "ModelFileError")
    else:
        tally("gguf reader", "read")
