"""ds4's DeepSeek V4.1 files (issue 33): the v41-tiny synthetic file loads, its Engram tables are located
(not read) and read back row for row, inspect describes it, the engine refuses it, and every bad input
is a named error at load."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import sympy
import torch

from dwarfstar.cli import main
from dwarfstar.engram.store import EngramStore
from dwarfstar.errors import ModelFileError
from dwarfstar.gguf.constants import GGMLType, ValueType
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.gguf.writer import GGUFWriter
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.file_v41 import open_model41
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_synthetic_model
from dwarfstar.model.synthetic_v41 import V41_TINY, v41_preset, write_synthetic_v41


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("v4") / "tiny.gguf"
    write_synthetic_model(path, TINY, seed=0)
    return path


def primes_after(start: int, count: int) -> list[int]:
    out, p = [], start
    for _ in range(count):
        p = sympy.nextprime(p)
        out.append(p)
    return out


def test_tiny_loads_with_its_engram_tables_located(v41_tiny_file: Path) -> None:
    model = open_model41(v41_tiny_file)
    try:
        assert model.args == V41_TINY
        layer1, layer6 = primes_after(64, 24), primes_after(64, 48)[24:]  # the next 24 primes past 64, twice
        assert {il: e.rows for il, e in model.engram.items()} == {1: sum(layer1), 6: sum(layer6)}
        assert model.engram_hash.primes[1].tolist() == layer1
        # layer 1's multipliers are the reference's draw for seed 10007 (spec §3)
        assert model.engram_hash.multipliers[1].tolist() == [
            76632096046245,
            4839876093313,
            35959672319349,
            73987337458391,
        ]
        token_map = model.engram_hash.token_map
        assert token_map.size == 129280 and int(token_map.max()) + 1 == 99092
        assert [int(token_map[t]) for t in (0, 671, 2058, 16, 2)] == [0, 237, 1751, 16, 2]  # §3's example
        end = max(info.offset + info.nbytes for info in model.gguf.tensors.values())
        assert end <= v41_tiny_file.stat().st_size
        assert model.engram_bytes == (sum(layer1) + sum(layer6)) * 264
    finally:
        model.close()


def test_engram_store_reads_the_rows_synth_wrote(v41_tiny_file: Path) -> None:
    model = open_model41(v41_tiny_file)
    store = EngramStore(model.engram, cache_bytes=0)
    try:
        extent = model.engram[6]
        ids = np.array([0, 1, 2, extent.rows // 2, extent.rows - 1])
        got = store.raw(6, ids)
        with open(v41_tiny_file, "rb") as f:  # the rows as the file holds them, read by hand
            want = []
            for row in ids:
                f.seek(extent.offset + int(row) * 264)
                want.append(np.frombuffer(f.read(264), dtype=np.uint8))
        np.testing.assert_array_equal(got, np.stack(want))
        # real rows: each block of 32 E4M3 values uses its power-of-two scale fully (peak in [224, 448])
        fp8 = torch.from_numpy(got[:, :256].copy()).view(torch.float8_e4m3fn).float().abs().reshape(5, 8, 32)
        peaks = fp8.amax(dim=2)
        assert ((peaks >= 224) & (peaks <= 448)).all()
        values = store.rows(6, ids)
        assert values.shape == (5, 256) and np.isfinite(values).all()
        assert 0.5 < values.std() < 2  # random N(0, 1) rows, stored at FP8 precision
        assert len({bytes(r) for r in got}) == 5
    finally:
        store.close()
        model.close()


def test_the_engine_refuses_v41_with_one_sentence(v41_tiny_file: Path) -> None:
    with pytest.raises(ModelFileError) as err:
        open_model(v41_tiny_file)
    text = str(err.value)
    assert "DeepSeek V4.1 Flash loads (12 layers" in text
    assert text.endswith("but only `dwarfstar run`, `serve`, `agent`, `bench` and `steer` run it yet (issue 33)")


def test_inspect_shows_modes_and_engram_bytes(v41_tiny_file: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["dwarfstar", "inspect", str(v41_tiny_file)])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "DeepSeek V4.1 Flash (deepseek41): 12 layers, hidden 64" in out
    lines = out.splitlines()
    assert any(line.split()[:4] == ["6", "ratio", "1", "full"] and "builds candidates" in line for line in lines)
    assert any(line.split()[:4] == ["8", "ratio", "1", "reindex"] and "picks inside" in line for line in lines)
    assert any(line.split()[:4] == ["3", "ratio", "2", "reuse"] for line in lines)
    rows6 = sum(primes_after(64, 48)[24:])
    assert f"Engram layer 6: {rows6:,} rows of 264 bytes = {rows6 * 264:,} bytes on disk" in out
    assert "on disk (Engram tables)" in out and "resident (weights)" in out
    assert "Engram rows (disk)" in out  # in the bytes read per decoded token


def test_shaped_tables_are_holes_that_take_no_disk(tmp_path) -> None:
    """The holes path on tiny shapes: the tables read as zero rows and the disk holds none of them."""
    path = tmp_path / "holes.gguf"
    write_synthetic_v41(path, V41_TINY, engram_holes=True)
    model = open_model41(path)
    store = EngramStore(model.engram, cache_bytes=0)
    try:
        assert not store.raw(1, np.array([0, model.engram[1].rows - 1])).any()
        stat = path.stat()
        assert stat.st_size - stat.st_blocks * 512 >= model.engram_bytes - 2 * 16384  # page-aligned holes
    finally:
        store.close()
        model.close()


def test_shaped_preset_is_flash_shapes() -> None:
    assert v41_preset("v41-shaped", 40) == ModelArgs41()  # Flash V4.1 itself
    shaped = v41_preset("v41-shaped")
    assert (shaped.n_layers, shaped.dim, shaped.n_routed_experts, shaped.engram_rows) == (
        4,
        5120,
        384,
        (384006168, 384016682),
    )


# -- bad inputs ------------------------------------------------------------------------------------------
def rewrite(src: Path, dst: Path, meta: dict | None = None, drop: str | None = None) -> Path:
    """Copy a GGUF byte for byte, with metadata changes or one tensor dropped."""
    with GGUFFile(src) as f:
        typed = f.typed_metadata()
        typed.update(meta or {})
        with GGUFWriter(dst, typed, alignment=f.alignment) as w:
            names = [n for n in f.tensors if n != drop]
            for name in names:
                w.add_tensor(name, f.tensors[name].shape, f.tensors[name].ggml_type)
            for name in names:
                w.write_tensor(name, f.raw(name))
    return dst


def test_a_v4_file_labelled_v41_is_mislabelled(tiny4: Path, tmp_path) -> None:
    bad = rewrite(tiny4, tmp_path / "bad.gguf", {"general.architecture": (ValueType.STRING, "deepseek41")})
    for opener in (open_model, open_model41):
        with pytest.raises(ModelFileError, match="mislabelled: general.architecture says 'deepseek41'"):
            opener(bad)


def test_a_v4_file_with_v41_keys_is_mislabelled(tiny4: Path, tmp_path) -> None:
    bad = rewrite(tiny4, tmp_path / "bad.gguf", {"deepseek41.config": (ValueType.STRING, "{}")})
    with pytest.raises(ModelFileError, match="mislabelled: general.architecture says 'deepseek4' .* deepseek41"):
        open_model(bad)


def test_a_v4_file_where_v41_is_expected(tiny4: Path) -> None:
    with pytest.raises(ModelFileError, match="is DeepSeek V4 \\('deepseek4'\\), not DeepSeek V4.1 Flash"):
        open_model41(tiny4)


def test_rows_that_disagree_with_their_primes(v41_tiny_file: Path, tmp_path) -> None:
    with GGUFFile(v41_tiny_file) as f:
        primes = list(f.metadata["deepseek41.engram.primes"])
    primes[30] += 2  # layer 6's seventh prime
    bad = rewrite(
        v41_tiny_file,
        tmp_path / "bad.gguf",
        {"deepseek41.engram.primes": (ValueType.ARRAY, (ValueType.UINT32, primes))},
    )
    with pytest.raises(ModelFileError, match="layer 6's Engram table has 6076 rows, but its 24 primes .* sum to 6078"):
        open_model41(bad)


def test_a_truncated_engram_table(v41_tiny_file: Path, tmp_path) -> None:
    bad = tmp_path / "cut.gguf"
    data = v41_tiny_file.read_bytes()
    bad.write_bytes(data[: len(data) - 20000])  # into the last table's rows
    with pytest.raises(ModelFileError, match="'blk.6.engram_embd.weight' data runs past the end .*truncated"):
        open_model41(bad)
    with pytest.raises(ModelFileError, match="blk.6.engram_embd.weight"):
        open_model(bad)


def test_a_token_map_of_the_wrong_size(v41_tiny_file: Path, tmp_path) -> None:
    with GGUFFile(v41_tiny_file) as f:
        token_map = list(f.metadata["deepseek41.engram.token_map"])
    key = "deepseek41.engram.token_map"
    bad = rewrite(v41_tiny_file, tmp_path / "bad.gguf", {key: (ValueType.ARRAY, (ValueType.UINT32, token_map[:-1]))})
    with pytest.raises(ModelFileError, match="token_map has 129279 entries, expected 129280"):
        open_model41(bad)
    token_map[500] = 99092
    bad = rewrite(v41_tiny_file, tmp_path / "bad2.gguf", {key: (ValueType.ARRAY, (ValueType.UINT32, token_map))})
    with pytest.raises(ModelFileError, match="maps token 500 to 99092, past the compressed vocabulary of 99092"):
        open_model41(bad)


def test_an_even_multiplier(v41_tiny_file: Path, tmp_path) -> None:
    with GGUFFile(v41_tiny_file) as f:
        multipliers = list(f.metadata["deepseek41.engram.multipliers"])
    multipliers[5] += 1
    bad = rewrite(
        v41_tiny_file, tmp_path / "bad.gguf", {"deepseek41.engram.multipliers": (ValueType.ARRAY, (10, multipliers))}
    )
    with pytest.raises(ModelFileError, match="layer 6's Engram multipliers .* must be odd"):
        open_model41(bad)


@pytest.mark.parametrize(
    "name", ["blk.2.attn_compressor_gate.weight", "blk.6.engram_kv.weight", "blk.1.engram_embd.weight"]
)
def test_a_missing_tensor(v41_tiny_file: Path, tmp_path, name: str) -> None:
    bad = rewrite(v41_tiny_file, tmp_path / "bad.gguf", drop=name)
    with pytest.raises(ModelFileError, match=f"missing tensor '{name}'"):
        open_model41(bad)


def test_an_i8_tensor_reads_as_its_bytes(tmp_path) -> None:
    path = tmp_path / "i8.gguf"
    with GGUFWriter(path, {}) as writer:
        writer.add_tensor("t", (2, 3), GGMLType.I8)
        writer.write_tensor("t", np.array([1, -2, 3, 127, -128, 0], dtype=np.int8))
    with GGUFFile(path) as gguf:
        assert gguf.tensor("t").tolist() == [[1, -2, 3], [127, -128, 0]]


def test_skip_tensor_leaves_a_hole_of_the_tensors_size(tmp_path) -> None:
    path = tmp_path / "hole.gguf"
    with GGUFWriter(path, {}) as writer:
        writer.add_tensor("a", (4,), GGMLType.F32)
        writer.add_tensor("big", (1 << 24,), GGMLType.F32)  # 64 MiB
        writer.write_tensor("a", np.arange(4, dtype=np.float32))
        writer.skip_tensor("big")
    with GGUFFile(path) as gguf:
        assert gguf.tensor("a").tolist() == [0, 1, 2, 3]
        assert not gguf.raw("big")[:: 1 << 20].any()
    assert path.stat().st_size >= 64 << 20
    assert os.stat(path).st_blocks * 512 < 1 << 20
