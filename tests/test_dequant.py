"""Torch dequantizers and encoders, bit-exact against gguf-py 0.19.0 (ggml's reference in numpy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType
from dwarfstar.gguf.dequant import _iq2xxs_tables, dequantize
from dwarfstar.gguf.quantize import quantize

QUANT_TYPES = [GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.IQ2_XXS]


def reference(raw: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    return quants.dequantize(raw, GGMLQuantizationType(int(ggml_type)))


def assert_bits_equal(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    ours_np = ours.numpy()
    assert ours_np.shape == ref.shape
    assert np.array_equal(ours_np.view(np.uint32), np.ascontiguousarray(ref, dtype=np.float32).view(np.uint32))


@pytest.mark.parametrize("ggml_type", QUANT_TYPES, ids=lambda t: t.name)
def test_quant_types_bit_exact_multi_row(ggml_type, quant_blocks):
    block, size = BLOCK_GEOMETRY[ggml_type]
    rows, blocks_per_row = 24, 3
    raw = quant_blocks(ggml_type, rows * blocks_per_row, seed=int(ggml_type)).reshape(rows, blocks_per_row * size)
    ours = dequantize(raw, ggml_type, rows * blocks_per_row * block).reshape(rows, blocks_per_row * block)
    assert_bits_equal(ours, reference(raw, ggml_type))
    assert torch.isfinite(ours).all() and ours.abs().max() > 0


@pytest.mark.parametrize("ggml_type", QUANT_TYPES, ids=lambda t: t.name)
def test_quant_types_bit_exact_expert_shaped(ggml_type, quant_blocks):
    # 3-D tensors such as blk.N.ffn_gate_exps: (experts, rows, row bytes); dequantize works on the flat bytes
    block, size = BLOCK_GEOMETRY[ggml_type]
    experts, rows, blocks_per_row = 4, 6, 2
    n_blocks = experts * rows * blocks_per_row
    raw = quant_blocks(ggml_type, n_blocks, seed=100 + int(ggml_type)).reshape(experts, rows, -1)
    ours = dequantize(raw, ggml_type, n_blocks * block).reshape(experts, rows, blocks_per_row * block)
    assert_bits_equal(ours, reference(raw, ggml_type))


def test_q8_0_bit_exact_on_gguf_quantized_data():
    x = np.random.default_rng(3).standard_normal((16, 256)).astype(np.float32) * 0.05
    raw = quants.quantize(x, GGMLQuantizationType.Q8_0)
    ours = dequantize(raw, GGMLType.Q8_0, x.size).reshape(x.shape)
    assert_bits_equal(ours, reference(raw, GGMLType.Q8_0))
    assert (ours.numpy() - x).__abs__().max() <= np.abs(x).max() / 127


def test_iq2_xxs_sign_table_matches_ggml():
    # ksigns is computed (7 sign bits + even-parity 8th bit), not copied: check it against gguf-py's table
    _, ksigns = _iq2xxs_tables()
    assert bytes(ksigns.numpy()) == quants.IQ2_XXS.ksigns


def test_f16_every_bit_pattern():
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    ours = dequantize(halves.view(np.uint8), GGMLType.F16, halves.size).numpy()
    ref = reference(halves.view(np.uint8), GGMLType.F16)
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(ours), nan) and nan.sum() == 2 * 1023
    assert np.array_equal(ours[~nan].view(np.uint32), ref[~nan].view(np.uint32))  # incl. ±0, subnormals, ±inf


def test_bf16_every_bit_pattern():
    bf16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    ours = dequantize(bf16.view(np.uint8), GGMLType.BF16, bf16.size)
    assert_bits_equal(ours, reference(bf16.view(np.uint8), GGMLType.BF16))  # NaN payloads included


def test_f32_and_i32_are_copies_of_the_bytes():
    bits = np.random.default_rng(5).integers(0, 1 << 32, size=96, dtype=np.uint64).astype(np.uint32)
    raw = bits.view(np.uint8)
    f32 = dequantize(raw, GGMLType.F32, 96)
    assert np.array_equal(f32.numpy().view(np.uint32), bits)
    i32 = dequantize(raw, GGMLType.I32, 96)
    assert i32.dtype == torch.int32 and np.array_equal(i32.numpy(), bits.view(np.int32))
    f32 += 1  # the result must not alias the (possibly read-only, memory-mapped) input
    assert np.array_equal(raw.view(np.uint32), bits)


def test_accepts_torch_bytes_at_any_offset(quant_blocks):
    raw = quant_blocks(GGMLType.Q4_K, 4, seed=9).reshape(-1)
    padded = torch.from_numpy(np.concatenate([np.zeros(3, np.uint8), raw]))
    ours = dequantize(padded[3:], GGMLType.Q4_K, 4 * 256)  # storage offset 3: not viewable as fp16 in place
    assert_bits_equal(ours, reference(raw, GGMLType.Q4_K).reshape(-1))


def test_rejects_wrong_sizes_and_types(quant_blocks):
    raw = quant_blocks(GGMLType.Q8_0, 2)
    with pytest.raises(ValueError, match="96 elements need 102 bytes, got 68"):
        dequantize(raw, GGMLType.Q8_0, 96)
    with pytest.raises(ValueError, match="whole number"):
        dequantize(raw, GGMLType.Q8_0, 48)
    with pytest.raises(ValueError, match="Q6_K"):
        dequantize(raw, GGMLType.Q6_K, 64)


# -- encoders ------------------------------------------------------------------------------------------------


def q8_0_test_data() -> np.ndarray:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((8, 128)).astype(np.float32)
    x[0, :32] = 0.0  # all-zero block: d = 0 and no division by zero
    x[1, :32] = np.arange(32) - 15.5  # amax 15.5, so q = x * 127/15.5 lands on many near-ties
    x[2, 1:32] = np.linspace(-2.5, 2.5, 31)  # with 127 in slot 0, d = 1: exact .5 ties
    x[2, 0] = 127.0
    x[3] *= 1e4
    x[4] *= 1e-6
    return x


def test_q8_0_quantize_matches_gguf():
    x = q8_0_test_data()
    ours = quantize(torch.from_numpy(x), GGMLType.Q8_0)
    ref = quants.quantize(x, GGMLQuantizationType.Q8_0)
    assert ours.dtype == np.uint8 and ours.shape == ref.shape == (8, 4 * 34)
    assert np.array_equal(ours, ref)


def test_q8_0_rounds_half_away_from_zero():
    x = torch.zeros(32)
    x[0], x[1], x[2] = 127.0, 2.5, -2.5  # d = 1 exactly
    q = quantize(x, GGMLType.Q8_0)[2:5].view(np.int8)
    assert q.tolist() == [127, 3, -3]  # torch.round would give 2, -2


def test_bf16_quantize_matches_gguf_on_any_bits():
    bits = np.random.default_rng(13).integers(0, 1 << 32, size=(4, 1024), dtype=np.uint64).astype(np.uint32)
    bits[0, :4] = [0x7F800001, 0xFFC00001, 0x7F7FFFFF, 0x3F808000]  # sNaN, -qNaN, round to inf, exact tie
    x = bits.view(np.float32)
    ours = quantize(torch.from_numpy(x), GGMLType.BF16)
    assert np.array_equal(ours, quants.quantize(x, GGMLQuantizationType.BF16))


@pytest.mark.parametrize("ggml_type", [GGMLType.F32, GGMLType.F16], ids=lambda t: t.name)
def test_float_quantize_matches_numpy(ggml_type):
    x = np.random.default_rng(17).standard_normal((3, 2, 64)).astype(np.float32) * 100
    ours = quantize(torch.from_numpy(x), ggml_type)
    ref = quants.quantize(x, GGMLQuantizationType(int(ggml_type)))
    assert ours.shape == (3, 2, 64 * BLOCK_GEOMETRY[ggml_type][1])
    assert np.array_equal(ours, ref.view(np.uint8).reshape(ours.shape))


def test_quantize_dequantize_round_trip_expert_shaped():
    x = torch.randn(3, 4, 96, generator=torch.Generator().manual_seed(0))
    raw = quantize(x, GGMLType.Q8_0)
    assert raw.shape == (3, 4, 3 * 34)
    back = dequantize(raw, GGMLType.Q8_0, x.numel()).reshape(x.shape)
    amax = x.reshape(-1, 32).abs().amax(1, keepdim=True)
    # half a step of d = amax/127, plus 127 q times the fp16 rounding of d (relative 2^-11): < 0.57 d
    assert ((back - x).reshape(-1, 32).abs() <= amax / 127 * 0.57).all()


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.zeros(4, 48), GGMLType.Q8_0)
    with pytest.raises(NotImplementedError, match="Q5_K"):
        quantize(torch.zeros(256), GGMLType.Q5_K)
