"""V4.1's Engram rows (dwarfstar/engram): the FP8 E4M3 + E8M0 row format against a decoder written here
from the formats' definitions, and the store that reads rows from a file with positional reads: the
values, the cache (hits, a budget, the clock's evictions), merged neighbour reads, prefetch, telemetry,
and bad input (a truncated table, a row or layer that does not exist)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dwarfstar.engram.rows import ROW_BYTES, dequantize, quantize
from dwarfstar.engram.store import EngramExtent, EngramStore
from dwarfstar.errors import DwarfStarError, ModelFileError


def fp8_e4m3fn(byte: int) -> float:
    """An FP8 E4M3 (fn) byte's value: sign, 4 exponent bits (bias 7), 3 mantissa bits, subnormals at
    exponent 0, S.1111.111 NaN and no infinities (OCP 8-bit floating point, 2023)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def row_values(row: np.ndarray) -> list[float]:
    """A stored row's 256 values, each byte decoded by hand times its block's E8M0 scale 2^(e - 127)."""
    return [fp8_e4m3fn(int(row[i])) * 2.0 ** (int(row[256 + i // 32]) - 127) for i in range(256)]


def random_rows(n: int, seed: int) -> np.ndarray:
    """Stored rows with random FP8 bytes (no NaN codes) and scale exponents 2^-20..2^10."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, ROW_BYTES), dtype=np.uint8)
    nan = (raw[:, :256] & 0x7F) == 0x7F
    raw[:, :256][nan] ^= 1
    raw[:, 256:] = rng.integers(107, 138, (n, 8), dtype=np.uint8)
    return raw


def test_dequantize_matches_the_formats_definitions():
    raw = random_rows(6, seed=1)
    got = dequantize(raw)
    for row, values in zip(raw, got, strict=True):
        assert values.tolist() == pytest.approx(row_values(row), rel=0, abs=0)


def test_nan_codes_stay_nan():
    raw = random_rows(1, seed=2)
    raw[0, 5], raw[0, 40], raw[0, 257] = 0x7F, 0xFF, 0xFF  # FP8 NaN twice; the second block's scale NaN
    values = dequantize(raw)[0]
    assert np.isnan(values[5]) and np.isnan(values[40]) and np.isnan(values[32:64]).all()
    assert np.isfinite(np.delete(values, np.r_[5, 32:64])).all()


def test_quantize_keeps_each_block_within_fp8_precision():
    values = np.random.default_rng(3).standard_normal((20, 256)).astype(np.float32)
    values[:, :32] *= 1e-4  # blocks of very different magnitudes
    values[:, 32:64] *= 1e3
    raw = quantize(values)
    back = dequantize(raw)
    blocks, peak = values.reshape(20, 8, 32), np.abs(values.reshape(20, 8, 32)).max(axis=2)
    scale = 2.0 ** (raw[:, 256:].astype(np.float64) - 127)
    assert (peak / scale <= 448).all() and (peak / scale > 224).all()  # the smallest power of two that fits
    err = np.abs(back.reshape(20, 8, 32) - blocks).max(axis=2)
    assert (err <= peak * 2.0**-4).all()  # 3 mantissa bits: half an ulp of the block's largest value


def table_file(path, rows: np.ndarray, offset: int = 1000, tail: int = 0):
    """A file holding `offset` bytes of something else, the table, then `tail` bytes."""
    with open(path, "wb") as f:
        f.write(b"x" * offset)
        f.write(rows.tobytes())
        f.write(b"y" * tail)
    return EngramExtent(path, offset, rows.shape[0])


@pytest.fixture
def tables(tmp_path):
    first, second = random_rows(500, seed=4), random_rows(300, seed=5)
    return {1: (first, table_file(tmp_path / "a.bin", first)), 14: (second, table_file(tmp_path / "b.bin", second, 77))}


def store_of(tables, cache_bytes: int) -> EngramStore:
    return EngramStore({layer: extent for layer, (_, extent) in tables.items()}, cache_bytes)


def test_rows_come_back_as_stored_and_repeats_hit_the_cache(tables):
    store = store_of(tables, cache_bytes=1 << 20)
    ids = np.array([[7, 299, 7], [0, 123, 250]])
    for layer, (rows, _) in tables.items():
        assert np.array_equal(store.raw(layer, ids.reshape(-1)), rows[ids.reshape(-1)])
        np.testing.assert_array_equal(store.rows(layer, ids), dequantize(rows[ids.reshape(-1)]).reshape(2, 3, 256))
    first = store.telemetry()
    # a layer's 6 uses of 5 rows: 5 read and 1 repeat at the first lookup, 6 hits at the second
    assert first["misses"] == 2 * 5 and first["hits"] == 2 * (1 + 6)
    store.rows(1, ids)
    again = store.telemetry()
    assert again["hits"] == first["hits"] + 6 and again["bytes_read"] == first["bytes_read"]
    store.close()


def test_a_small_cache_evicts_and_stays_within_its_budget(tables):
    rows, _ = tables[1]
    store = store_of(tables, cache_bytes=10 * ROW_BYTES)
    rng = np.random.default_rng(6)
    for _ in range(20):
        ids = rng.integers(0, 500, 16)
        assert np.array_equal(store.raw(1, ids), rows[ids])
        assert store.telemetry()["resident_rows"] <= 10
    assert store.telemetry()["capacity_rows"] == 10
    hot = np.array([3, 3, 3])
    store.raw(1, hot)
    before = store.telemetry()
    store.raw(1, hot)  # just read: still resident
    after = store.telemetry()
    assert after["hits"] == before["hits"] + 3 and after["misses"] == before["misses"]
    store.close()


def test_without_a_cache_every_lookup_reads(tables):
    store = store_of(tables, cache_bytes=0)
    rows, _ = tables[14]
    for _ in range(2):
        assert np.array_equal(store.raw(14, np.array([5, 9])), rows[[5, 9]])
    assert store.telemetry()["misses"] == 4 and store.telemetry()["hits"] == 0
    store.close()


def test_neighbours_come_in_one_read(tables):
    store = store_of(tables, cache_bytes=0)
    rows, _ = tables[1]
    ids = np.array([10, 11, 12, 20, 400])  # 10..20 lie within a page: one read; 400 another
    assert np.array_equal(store.raw(1, ids), rows[ids])
    stats = store.telemetry()
    assert stats["reads"] == 2 and stats["bytes_read"] == 11 * ROW_BYTES + ROW_BYTES
    store.close()


def test_prefetch_makes_the_prompts_rows_resident(tables):
    store = store_of(tables, cache_bytes=1 << 20)
    wanted = {1: np.arange(0, 500, 7), 14: np.arange(0, 300, 11)}
    store.prefetch(wanted).result()
    stats = store.telemetry()
    assert stats["prefetched"] == stats["misses"] == len(wanted[1]) + len(wanted[14])
    for layer, ids in wanted.items():
        assert np.array_equal(store.raw(layer, ids), tables[layer][0][ids])
    assert store.telemetry()["hits"] == stats["misses"]
    store.close()


def test_a_truncated_table_is_refused_at_open(tmp_path):
    rows = random_rows(50, seed=7)
    extent = table_file(tmp_path / "t.bin", rows)
    with pytest.raises(ModelFileError, match="truncated"):
        EngramStore({1: EngramExtent(extent.path, extent.offset, 51)}, 0)
    with pytest.raises(ModelFileError, match="cannot open"):
        EngramStore({1: EngramExtent(tmp_path / "missing.bin", 0, 1)}, 0)


def test_rows_and_layers_that_do_not_exist_are_named(tables):
    store = store_of(tables, cache_bytes=1 << 16)
    with pytest.raises(DwarfStarError, match="row 500 is outside layer 1's table of 500 rows"):
        store.raw(1, np.array([3, 500]))
    with pytest.raises(DwarfStarError, match="row -1"):
        store.raw(14, np.array([-1]))
    with pytest.raises(DwarfStarError, match="layer 2 has no Engram table"):
        store.raw(2, np.array([0]))
    with pytest.raises(DwarfStarError, match="must not be negative"):
        EngramStore({}, -1)
    store.close()


def test_a_huge_sparse_table_reads_only_what_is_asked(tmp_path):
    """A table far larger than what is read (a sparse file: no disk, no memory behind its holes)."""
    path, rows = tmp_path / "sparse.bin", 40_000_000  # 10.6 GB of table
    stored = random_rows(2, seed=8)
    with open(path, "wb") as f:
        f.seek(ROW_BYTES * 12_345_678)
        f.write(stored[0].tobytes())
        f.seek(ROW_BYTES * (rows - 1))
        f.write(stored[1].tobytes())
    store = EngramStore({1: EngramExtent(path, 0, rows)}, 1 << 20)
    assert np.array_equal(store.raw(1, np.array([12_345_678, rows - 1])), stored)
    assert store.telemetry()["bytes_read"] == 2 * ROW_BYTES
    store.close()
