"""GGUF writer/reader round trips, cross-checked against gguf-py's own GGUFReader and GGUFWriter."""

from __future__ import annotations

import mmap

import gguf
import numpy as np
import pytest
import torch

from dwarfstar.gguf.constants import GGMLType, ValueType
from dwarfstar.gguf.dequant import dequantize
from dwarfstar.gguf.quantize import quantize
from dwarfstar.gguf.reader import GGUFFile, open_gguf
from dwarfstar.gguf.writer import GGUFWriter

V = ValueType
METADATA = {
    "general.architecture": (V.STRING, "deepseek4"),
    "t.u8": (V.UINT8, 255),
    "t.i8": (V.INT8, -128),
    "t.u16": (V.UINT16, 65535),
    "t.i16": (V.INT16, -32768),
    "t.u32": (V.UINT32, 7),
    "t.i32": (V.INT32, 7),  # same value as t.u32: only metadata_types tells them apart
    "t.f32": (V.FLOAT32, 0.1),
    "t.bool": (V.BOOL, True),
    "t.str": (V.STRING, "ünïcødé ✓ <｜begin▁of▁sentence｜>"),
    "t.u64": (V.UINT64, 2**64 - 1),
    "t.i64": (V.INT64, -(2**63)),
    "t.f64": (V.FLOAT64, 0.1),
    "t.arr_u8": (V.ARRAY, (V.UINT8, [0, 1, 255])),
    "t.arr_i8": (V.ARRAY, (V.INT8, [-1, 2])),
    "t.arr_u16": (V.ARRAY, (V.UINT16, [65535])),
    "t.arr_i16": (V.ARRAY, (V.INT16, [-2, 3])),
    "t.arr_u32": (V.ARRAY, (V.UINT32, [0, 4, 128])),
    "t.arr_i32": (V.ARRAY, (V.INT32, [0, 4, 128])),
    "t.arr_f32": (V.ARRAY, (V.FLOAT32, [10.0, 1.5, -0.1])),
    "t.arr_bool": (V.ARRAY, (V.BOOL, [True, False, True])),
    "t.arr_str": (V.ARRAY, (V.STRING, ["Ġthe", "", "a b"])),
    "t.arr_u64": (V.ARRAY, (V.UINT64, [2**64 - 1])),
    "t.arr_i64": (V.ARRAY, (V.INT64, [-(2**63), 5])),
    "t.arr_f64": (V.ARRAY, (V.FLOAT64, [0.1, -2.0])),
    "t.arr_empty": (V.ARRAY, (V.INT32, [])),
    "t.nested": (V.ARRAY, (V.ARRAY, [(V.INT8, [1, -1]), (V.STRING, ["x", "y"]), (V.UINT32, [])])),
}
EXPECTED = {
    key: np.float32(value).item() if vtype == V.FLOAT32 else value
    for key, (vtype, value) in METADATA.items()
    if vtype != V.ARRAY
} | {
    key: [np.float32(x).item() for x in value[1]] if value[0] == V.FLOAT32 else list(value[1])
    for key, (vtype, value) in METADATA.items()
    if vtype == V.ARRAY and value[0] != V.ARRAY
}
EXPECTED["t.nested"] = [[1, -1], ["x", "y"], []]


def test_metadata_round_trip_every_value_type(tmp_path):
    path = tmp_path / "meta.gguf"
    with GGUFWriter(path, METADATA):
        pass
    with open_gguf(path) as f:
        assert f.version == 3 and f.alignment == 32 and f.tensors == {}
        assert f.metadata == EXPECTED
        assert list(f.metadata) == list(METADATA)  # file order kept
        for key, (vtype, value) in METADATA.items():
            item_type = value[0] if vtype == V.ARRAY else None
            assert f.metadata_types[key] == (vtype, item_type), key
        assert f.metadata_types["t.u32"] != f.metadata_types["t.i32"]
        assert f.metadata_types["t.arr_u32"] == (V.ARRAY, V.UINT32)
        assert f.metadata_types["t.arr_i32"] == (V.ARRAY, V.INT32)
        assert type(f.metadata["t.bool"]) is bool and type(f.metadata["t.arr_bool"][0]) is bool


def test_metadata_readable_by_gguf_py(tmp_path):
    path = tmp_path / "meta.gguf"
    with GGUFWriter(path, METADATA):
        pass
    r = gguf.GGUFReader(path)
    for key, (vtype, value) in METADATA.items():
        field = r.fields[key]
        assert field.types[0] == gguf.GGUFValueType(int(vtype)), key
        if vtype == V.ARRAY and value[0] != V.ARRAY:
            assert int(field.parts[3][0]) == value[0], key  # parts: key length, key, type, item type, count, ...
            assert field.contents() == EXPECTED[key], key
        elif vtype != V.ARRAY:
            assert field.contents() == EXPECTED[key], key


def tensor_cases(quant_blocks) -> dict[str, tuple[tuple[int, ...], GGMLType, np.ndarray]]:
    """name -> (torch shape, type, raw bytes) covering every supported type, 1-D, 2-D and 3-D."""
    rng = np.random.default_rng(0)
    cases = {
        "f32": ((3, 5), GGMLType.F32, rng.standard_normal((3, 5)).astype(np.float32)),
        "f32_1d": ((7,), GGMLType.F32, rng.standard_normal(7).astype(np.float32)),
        "f16": ((4, 6), GGMLType.F16, rng.standard_normal((4, 6)).astype(np.float16)),
        "bf16": ((2, 8), GGMLType.BF16, quantize(torch.randn(2, 8), GGMLType.BF16)),
        "i32": ((9,), GGMLType.I32, rng.integers(-(2**31), 2**31, 9, dtype=np.int64).astype(np.int32)),
        "q8_0": ((3, 64), GGMLType.Q8_0, quantize(torch.randn(3, 64), GGMLType.Q8_0)),
    }
    for ggml_type, shape in [(GGMLType.Q2_K, (2, 512)), (GGMLType.Q4_K, (3, 2, 256)), (GGMLType.IQ2_XXS, (4, 256))]:
        n_blocks = int(np.prod(shape)) // 256
        cases[ggml_type.name.lower()] = (shape, ggml_type, quant_blocks(ggml_type, n_blocks, seed=n_blocks))
    return cases


def write_cases(path, cases, alignment=32):
    with GGUFWriter(path, {"general.architecture": (V.STRING, "test")}, alignment=alignment) as w:
        for name, (shape, ggml_type, _) in cases.items():
            w.add_tensor(name, shape, ggml_type)
        for name, (_, _, data) in cases.items():
            w.write_tensor(name, data)


@pytest.mark.parametrize("alignment", [32, 64])
def test_tensor_round_trip_every_type(tmp_path, quant_blocks, alignment):
    path = tmp_path / "t.gguf"
    cases = tensor_cases(quant_blocks)
    write_cases(path, cases, alignment)
    with GGUFFile(path) as f:
        assert f.alignment == alignment and list(f.tensors) == list(cases)
        for name, (shape, ggml_type, data) in cases.items():
            info = f.tensors[name]
            assert (info.shape, info.ggml_type, info.offset % alignment) == (shape, ggml_type, 0)
            assert info.nbytes == data.nbytes and info.n_elements == int(np.prod(shape))
            assert f.raw(name).tobytes() == data.tobytes()
            expected = dequantize(data.reshape(-1).view(np.uint8), ggml_type, info.n_elements).reshape(shape)
            got = f.tensor(name)
            assert got.shape == shape and got.dtype == expected.dtype
            assert torch.equal(got, expected)
        assert torch.equal(f.tensor("f32"), torch.from_numpy(cases["f32"][2]))


def test_tensors_readable_by_gguf_py(tmp_path, quant_blocks):
    path = tmp_path / "t.gguf"
    cases = tensor_cases(quant_blocks)
    write_cases(path, cases, alignment=64)
    r = gguf.GGUFReader(path)
    assert r.alignment == 64 and [t.name for t in r.tensors] == list(cases)
    with open_gguf(path) as f:
        for t in r.tensors:
            shape, ggml_type, data = cases[t.name]
            assert int(t.tensor_type) == int(ggml_type)
            assert tuple(t.shape.tolist()) == tuple(reversed(shape))  # gguf-py reports ggml order
            assert t.data.tobytes() == data.tobytes()
            if ggml_type != GGMLType.I32:
                ref = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
                assert np.array_equal(f.tensor(t.name).numpy().view(np.uint32), ref.view(np.uint32))


def test_reads_file_written_by_gguf_py(tmp_path):
    path = tmp_path / "theirs.gguf"
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((2, 2, 8)).astype(np.float16)
    c = rng.standard_normal((5, 64)).astype(np.float32)
    q = gguf.quants.quantize(c, gguf.GGMLQuantizationType.Q8_0)
    w = gguf.GGUFWriter(path, arch="deepseek4")
    w.add_uint32("deepseek4.block_count", 43)
    w.add_array("deepseek4.attention.compress_ratios", [0, 0, 4, 128])
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_tensor("a", a)
    w.add_tensor("b", b)
    w.add_tensor("q", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open_gguf(path) as f:
        assert f.metadata["general.architecture"] == "deepseek4"
        assert f.metadata["deepseek4.block_count"] == 43
        assert f.metadata_types["deepseek4.block_count"] == (V.UINT32, None)
        assert f.metadata["deepseek4.attention.compress_ratios"] == [0, 0, 4, 128]
        assert f.metadata["tokenizer.ggml.model"] == "gpt2"
        assert [(n, i.shape, i.ggml_type) for n, i in f.tensors.items()] == [
            ("a", (3, 4), GGMLType.F32),
            ("b", (2, 2, 8), GGMLType.F16),
            ("q", (5, 64), GGMLType.Q8_0),
        ]
        assert torch.equal(f.tensor("a"), torch.from_numpy(a))
        assert torch.equal(f.tensor("b"), torch.from_numpy(b.astype(np.float32)))
        assert f.raw("q").tobytes() == q.tobytes()


def test_reads_version_2(tmp_path, quant_blocks):
    path = tmp_path / "v2.gguf"
    write_cases(path, tensor_cases(quant_blocks))
    data = bytearray(path.read_bytes())
    data[4:8] = (2).to_bytes(4, "little")  # v2 has the same layout as v3 (u64 counts and lengths)
    path.write_bytes(bytes(data))
    with open_gguf(path) as f:
        assert f.version == 2 and f.metadata["general.architecture"] == "test"
        assert f.raw("q4_k").tobytes() == tensor_cases(quant_blocks)["q4_k"][2].tobytes()


def test_raw_is_a_zero_copy_view_of_the_mapping(tmp_path, quant_blocks):
    path = tmp_path / "t.gguf"
    write_cases(path, tensor_cases(quant_blocks))
    with open_gguf(path) as f:
        raw = f.raw("q2_k")
        assert isinstance(raw, np.memmap) and not raw.flags.owndata and not raw.flags.writeable
        base = raw
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base, mmap.mmap)  # backed by the file mapping, not by a buffer read into memory
        assert np.shares_memory(raw, f.raw("q2_k"))
        info = f.tensors["q2_k"]
        assert raw.ctypes.data - f.raw("f32").ctypes.data == info.offset - f.tensors["f32"].offset


def test_streaming_write_in_chunks(tmp_path):
    experts = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(2))
    whole = quantize(experts, GGMLType.Q8_0)
    meta = {"general.architecture": (V.STRING, "test")}
    with GGUFWriter(tmp_path / "s.gguf", meta) as w:
        w.add_tensor("blk.0.ffn_gate_exps.weight", tuple(experts.shape), GGMLType.Q8_0)
        w.add_tensor("f", (3, 4), GGMLType.F32)
        w.write_tensor("blk.0.ffn_gate_exps.weight", (quantize(e, GGMLType.Q8_0) for e in experts))
        chunks = [b"", torch.zeros(1, 4), memoryview(np.ones(4, np.float32)), bytearray(np.full(4, 2.0, np.float32))]
        w.write_tensor("f", chunks)
    with open_gguf(tmp_path / "s.gguf") as f:
        assert f.raw("blk.0.ffn_gate_exps.weight").tobytes() == whole.tobytes()
        assert f.tensor("f").tolist() == [[0.0] * 4, [1.0] * 4, [2.0] * 4]


def start_writer(path):
    w = GGUFWriter(path, {"general.architecture": (V.STRING, "test")})
    w.add_tensor("a", (2, 32), GGMLType.Q8_0)
    w.add_tensor("b", (4,), GGMLType.F32)
    return w


def test_exception_mid_write_leaves_no_file_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"previous model")

    def experts():
        yield np.zeros(34, np.uint8)
        raise RuntimeError("source checkpoint unreadable")

    with pytest.raises(RuntimeError, match="unreadable"):
        with start_writer(path) as w:
            w.write_tensor("a", experts())
    assert path.read_bytes() == b"previous model"
    assert list(tmp_path.iterdir()) == [path]


def test_exception_in_caller_code_leaves_no_file(tmp_path):
    path = tmp_path / "model.gguf"
    with pytest.raises(KeyError):
        with start_writer(path) as w:
            w.write_tensor("a", np.zeros(68, np.uint8))
            raise KeyError("converter bug")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("name", "data", "error", "match"),
    [
        ("a", np.zeros(67, np.uint8), ValueError, "needs 68 bytes, got 67"),
        ("a", [np.zeros(68, np.uint8), b"x"], ValueError, "needs 68 bytes, got more than 68"),
        ("b", np.zeros(4, np.float32), ValueError, "declaration order: expected 'a'"),
        ("a", np.zeros(17, np.float32), TypeError, "float32 data cannot be raw Q8_0"),
        ("a", 3.5, TypeError, "cannot write float"),
    ],
)
def test_bad_write_aborts_the_file(tmp_path, name, data, error, match):
    path = tmp_path / "model.gguf"
    w = start_writer(path)
    with pytest.raises(error, match=match):
        w.write_tensor(name, data)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="already closed or aborted"):
        w.write_tensor("b", np.zeros(4, np.float32))


def test_close_requires_every_tensor(tmp_path):
    path = tmp_path / "model.gguf"
    w = start_writer(path)
    w.write_tensor("a", np.zeros(68, np.uint8))
    with pytest.raises(ValueError, match="1 declared tensors were never written, first 'b'"):
        w.close()
    assert list(tmp_path.iterdir()) == []


def test_file_appears_only_on_close(tmp_path):
    path = tmp_path / "model.gguf"
    w = start_writer(path)
    w.write_tensor("a", np.zeros(68, np.uint8))
    w.write_tensor("b", torch.arange(4, dtype=torch.float32))
    assert not path.exists() and (tmp_path / "model.gguf.tmp").exists()
    w.close()
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]
    with open_gguf(path) as f:
        assert f.tensor("b").tolist() == [0.0, 1.0, 2.0, 3.0]


def test_writer_rejects_bad_declarations(tmp_path):
    with pytest.raises(ValueError, match="'t.u8'.*UINT8"):
        GGUFWriter(tmp_path / "x.gguf", {"t.u8": (V.UINT8, 256)})
    with pytest.raises(ValueError, match="contradicts"):
        GGUFWriter(tmp_path / "x.gguf", {"general.alignment": (V.UINT32, 64)}, alignment=32)
    w = GGUFWriter(tmp_path / "x.gguf", {})
    with pytest.raises(ValueError, match="multiple of 256"):
        w.add_tensor("q", (2, 128), GGMLType.Q4_K)
    w.add_tensor("q", (2, 256), GGMLType.Q4_K)
    with pytest.raises(ValueError, match="declared twice"):
        w.add_tensor("q", (2, 256), GGMLType.Q4_K)
    w.abort()
    assert list(tmp_path.iterdir()) == []
