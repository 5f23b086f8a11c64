"""Every malformed GGUF must raise ModelFileError naming the problem, never a bare struct/Index/Unicode error.

Files are assembled byte by byte here (not with our writer), so each field can be corrupted on its own.
"""

from __future__ import annotations

import random
import struct

import pytest

from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.reader import open_gguf


def gstr(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + payload


def tinfo(name: str, dims: list[int], type_id: int, offset: int) -> bytes:
    return gstr(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)


ARCH = kv("general.architecture", 8, gstr("deepseek4"))
RATIOS = kv("deepseek4.attention.compress_ratios", 9, struct.pack("<IQ4I", 4, 4, 0, 0, 4, 128))
# a Q8_0 tensor of 2 rows x 32 (68 bytes, padded to 96) followed by an F32 tensor of 4 values
TENSORS = [tinfo("blk.0.attn_q_a.weight", [32, 2], 8, 0), tinfo("output_norm.weight", [4], 0, 96)]


def build(
    *,
    magic: bytes = b"GGUF",
    version: int = 3,
    kvs: list[bytes] | None = None,
    infos: list[bytes] | None = None,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    data: bytes = bytes(96) + bytes(16),
) -> bytes:
    kvs = [ARCH, RATIOS] if kvs is None else kvs
    infos = TENSORS if infos is None else infos
    n_kv = len(kvs) if n_kv is None else n_kv
    n_tensors = len(infos) if n_tensors is None else n_tensors
    head = magic + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % 32) + data


def read(tmp_path, content: bytes):
    path = tmp_path / "m.gguf"
    path.write_bytes(content)
    with open_gguf(path) as f:
        return f.metadata, f.tensors


def expect_error(tmp_path, content: bytes, *phrases: str) -> str:
    with pytest.raises(ModelFileError) as e:
        read(tmp_path, content)
    message = str(e.value)
    for phrase in phrases:
        assert phrase in message
    return message


def test_the_base_file_is_valid(tmp_path):
    meta, tensors = read(tmp_path, build())
    assert meta["deepseek4.attention.compress_ratios"] == [0, 0, 4, 128]
    assert [t.shape for t in tensors.values()] == [(2, 32), (4,)]


def test_empty_and_missing_files(tmp_path):
    expect_error(tmp_path, b"", "empty file")
    with pytest.raises(ModelFileError, match="cannot open model file"):
        open_gguf(tmp_path / "missing.gguf")


def test_bad_magic(tmp_path):
    expect_error(tmp_path, build(magic=b"GGML"), "not a GGUF file", "b'GGML'")
    expect_error(tmp_path, b"PK\x03\x04" + bytes(100), "not a GGUF file")


def test_unsupported_versions(tmp_path):
    expect_error(tmp_path, build(version=99), "unsupported GGUF version 99")
    expect_error(tmp_path, build(version=1), "unsupported GGUF version 1")
    expect_error(tmp_path, build(version=3 << 24), "big-endian")


def test_every_truncation_of_the_header_is_reported(tmp_path):
    content = build()
    header_end = len(content) - 112
    for cut in range(1, header_end):
        message = expect_error(tmp_path, content[:cut])
        assert "truncated" in message or "not a GGUF file" in message, (cut, message)


@pytest.mark.parametrize("cut", [0, 1, 67, 68, 95, 96, 111])
def test_truncation_inside_tensor_data_names_tensor_and_missing_bytes(tmp_path, cut):
    content = build()
    data_start = len(content) - 112
    message = expect_error(tmp_path, content[: data_start + cut], "data runs past the end of the file")
    if cut < 68:
        assert "'blk.0.attn_q_a.weight'" in message and f"{68 - cut} bytes missing" in message
    else:
        assert "'output_norm.weight'" in message and f"{112 - cut} bytes missing" in message


def test_unknown_and_unsupported_ggml_types(tmp_path):
    infos = [tinfo("blk.3.ffn_up_exps.weight", [256, 2], 200, 0)]
    expect_error(tmp_path, build(infos=infos), "'blk.3.ffn_up_exps.weight'", "unknown ggml type id 200")
    infos = [tinfo("output.weight", [256, 2], 14, 0)]  # Q6_K: a real type DwarfStar does not read
    expect_error(tmp_path, build(infos=infos, data=bytes(420)), "'output.weight'", "Q6_K", "not supported")


def test_unknown_metadata_value_type(tmp_path):
    expect_error(tmp_path, build(kvs=[ARCH, kv("x.y", 13, b"\0" * 8)]), "unknown metadata value type 13", "'x.y'")
    bad_array = kv("x.arr", 9, struct.pack("<IQ", 42, 1))
    expect_error(tmp_path, build(kvs=[bad_array]), "unknown metadata value type 42")


def test_implausible_counts(tmp_path):
    expect_error(tmp_path, build(n_kv=2**60), "implausible metadata count")
    expect_error(tmp_path, build(n_tensors=2**40), "implausible tensor count")
    huge_key = struct.pack("<Q", 2**63) + b"general.architecture"
    expect_error(tmp_path, build(kvs=[huge_key]), "implausible string length")
    huge_value = kv("tokenizer.ggml.model", 8, struct.pack("<Q", 10**12) + b"gpt2")
    expect_error(tmp_path, build(kvs=[huge_value]), "implausible string length", "'tokenizer.ggml.model'")
    huge_array = kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2**50))
    expect_error(tmp_path, build(kvs=[huge_array]), "implausible array length")


def test_deeply_nested_arrays(tmp_path):
    bomb = kv("x.nest", 9, struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0))
    expect_error(tmp_path, build(kvs=[bomb]), "arrays nested more than 16 deep", "'x.nest'")


def test_invalid_utf8(tmp_path):
    expect_error(tmp_path, build(kvs=[kv(b"bad\xff", 4, struct.pack("<I", 1))]), "invalid UTF-8")


def test_duplicates(tmp_path):
    dup_kv = [ARCH, kv("general.architecture", 8, gstr("other"))]
    expect_error(tmp_path, build(kvs=dup_kv), "duplicate metadata key 'general.architecture'")
    dup_tensor = [TENSORS[0], tinfo("blk.0.attn_q_a.weight", [4], 0, 96)]
    expect_error(tmp_path, build(infos=dup_tensor), "duplicate tensor name 'blk.0.attn_q_a.weight'")


def test_misaligned_offset(tmp_path):
    infos = [TENSORS[0], tinfo("output_norm.weight", [4], 0, 72)]
    expect_error(tmp_path, build(infos=infos), "'output_norm.weight'", "misaligned", "multiple of 32")


def test_quant_row_not_a_whole_number_of_blocks(tmp_path):
    infos = [tinfo("blk.0.attn_q_a.weight", [48, 2], 8, 0)]
    expect_error(tmp_path, build(infos=infos), "'blk.0.attn_q_a.weight'", "multiple of 32 elements, got 48")


def test_bad_dimension_count(tmp_path):
    expect_error(tmp_path, build(infos=[tinfo("t", [1, 1, 1, 1, 4], 0, 0)]), "has 5 dimensions")
    expect_error(tmp_path, build(infos=[tinfo("t", [], 0, 0)]), "has 0 dimensions")


def test_bad_alignment(tmp_path):
    odd = kv("general.alignment", 4, struct.pack("<I", 48))
    expect_error(tmp_path, build(kvs=[ARCH, odd]), "general.alignment must be a power of two, got 48")
    text = kv("general.alignment", 8, gstr("32"))
    expect_error(tmp_path, build(kvs=[text]), "general.alignment must be a positive integer")


def test_huge_dims_run_past_end(tmp_path):
    infos = [tinfo("tok_embd", [2**40, 2**20], 0, 0)]
    expect_error(tmp_path, build(infos=infos), "'tok_embd'", "data runs past the end of the file")


def test_random_header_corruption_only_raises_model_file_error(tmp_path):
    base = build()
    header_end = len(base) - 112
    rng = random.Random(0)
    path = tmp_path / "m.gguf"
    for _ in range(400):
        content = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            content[rng.randrange(header_end)] = rng.randrange(256)
        path.write_bytes(bytes(content))
        try:
            with open_gguf(path) as f:
                for name in f.tensors:  # a corruption that still parses must also decode
                    f.tensor(name)
        except ModelFileError:
            pass
