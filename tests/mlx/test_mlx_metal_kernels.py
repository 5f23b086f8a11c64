"""The Metal kernels on GGUF blocks: fused dequant-GEMV/GEMM and the gathered expert GEMV/GEMM.

Each launch the backend would make is checked against the torch dequantizer's weights (float64
products), twice: by the CPU emulation of the kernels (conftest.py) on any machine with g++, and by
the real kernels where Metal exists (skipped elsewhere, with the reason). The decoders are exact,
so the only difference is summation order: 1e-5 relative to the largest output.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from dwarfstar.backends.mlx import metal
from dwarfstar.backends.mlx.model import MLXModel
from dwarfstar.backends.mlx.parity import compare_logits
from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType
from dwarfstar.gguf.dequant import dequantize

TOL = 1e-5
ROWS, COLS = 40, 512  # 40 rows: a partial 32-row tile; 512 inputs: two K-quant blocks per row
EXPERT_TYPES = (GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q8_0)  # routed experts and the grouped wo_a


def block_matrix(quant_blocks, ggml_type: GGMLType, shape: tuple[int, ...]) -> tuple[metal.BlockMatrix, np.ndarray]:
    """Random well-formed blocks as a BlockMatrix, and their float64 weights [experts * rows, cols]."""
    n = int(np.prod(shape))
    raw = quant_blocks(ggml_type, n // BLOCK_GEOMETRY[ggml_type][0], seed=int(ggml_type) + n)
    dense = dequantize(raw, ggml_type, n).view(-1, shape[-1]).double().numpy()
    return metal.BlockMatrix.from_gguf(raw, ggml_type, shape), dense


def inputs(rows: int, cols: int, seed: int) -> np.ndarray:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).numpy()


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOL * np.abs(want).max()


def gather_case(quant_blocks, ggml_type, pairs_per_token: int, tokens: int, per_x: int):
    """A stack of 4 experts, routing ids for tokens x pairs_per_token pairs, and the expected products."""
    experts = 4
    cols = 256
    m, dense = block_matrix(quant_blocks, ggml_type, (experts, ROWS, cols))
    ids = np.random.default_rng(tokens).integers(0, experts, size=tokens * pairs_per_token).astype(np.uint32)
    x = inputs(len(ids) // per_x, cols, seed=tokens)
    stacked = dense.reshape(experts, ROWS, cols)
    want = np.stack([stacked[e] @ x[p // per_x] for p, e in enumerate(ids)])
    return m, mx.array(x), mx.array(ids), want


@pytest.mark.parametrize("ggml_type", metal.KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 3, 40], ids=["gemv-1", "gemv-3", "gemm-40"])
def test_matmul_emulated(emulate, quant_blocks, ggml_type, tokens):
    m, dense = block_matrix(quant_blocks, ggml_type, (ROWS, COLS))
    x = inputs(tokens, COLS, seed=tokens)
    launch = m.matmul_launch(mx.array(x))
    assert launch.kernel == ("qgemv" if tokens <= metal.GEMV_MAX_TOKENS else "qgemm")
    assert_close(emulate(launch), x @ dense.T)


@pytest.mark.parametrize("ggml_type", EXPERT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("tokens", "per_x"), [(3, 2), (3, 1), (40, 2)], ids=["gemv", "gemv-per-pair", "gemm"])
def test_gather_emulated(emulate, quant_blocks, ggml_type, tokens, per_x):
    m, x, ids, want = gather_case(quant_blocks, ggml_type, 2, tokens, per_x)
    launch = m.gather_launch(x, ids, per_x)
    assert launch.kernel == ("moe_gemv" if len(want) <= metal.MOE_GEMV_MAX_PAIRS else "moe_gemm")
    assert_close(emulate(launch), want)


def test_kernel_objects_build_anywhere():
    """Building the objects needs no Metal (compiling does, at the first call): the API takes our sources."""
    for name in metal.SPECS:
        assert callable(metal.kernel(name))


@pytest.mark.parametrize("ggml_type", metal.KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_matmul_on_metal(metal_device, quant_blocks, ggml_type, tokens):
    m, dense = block_matrix(quant_blocks, ggml_type, (ROWS, COLS))
    x = inputs(tokens, COLS, seed=tokens)
    assert_close(np.array(m.matmul(mx.array(x))), x @ dense.T)


@pytest.mark.parametrize("ggml_type", EXPERT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("tokens", "per_x"), [(3, 2), (3, 1), (40, 2)])
def test_gather_on_metal(metal_device, quant_blocks, ggml_type, tokens, per_x):
    m, x, ids, want = gather_case(quant_blocks, ggml_type, 2, tokens, per_x)
    assert_close(np.array(m.gather_launch(x, ids, per_x).run()), want)


def test_model_on_emulated_kernels_matches_reference(ds4_model, emulate, monkeypatch):
    """The production packing end to end: every quantized product goes through a kernel launch.

    Launches run in the emulation, except the vocabulary-sized output head (4M emulated threads per
    call), which is computed from its dequantized blocks instead. Prefill takes the tiled kernels,
    decode the GEMVs.
    """

    def run(launch: metal.Launch) -> mx.array:
        w, x = launch.inputs[0], launch.inputs[1]
        if launch.output_shape[-1] > 4096:
            qtype, cols = (value for _, value in launch.template[:2])
            dense = dequantize(
                np.array(w), GGMLType(qtype), w.size // BLOCK_GEOMETRY[qtype][1] * BLOCK_GEOMETRY[qtype][0]
            )
            return mx.array(np.array(x) @ dense.view(-1, cols).numpy().T)
        return mx.array(emulate(launch))

    monkeypatch.setattr(metal.Launch, "run", run)
    reference, model = ReferenceModel(ds4_model, qat=False), MLXModel(ds4_model, qat=False, packing="blocks")
    assert isinstance(model.experts.layers[3].gate, metal.BlockMatrix)
    prompt = torch.randint(3, 120000, (42,), generator=torch.Generator().manual_seed(5)).tolist()
    want = reference.forward(prompt, reference.new_state())
    state = model.new_state()
    got = [model.forward(prompt[:40], state)] + [model.forward([t], state) for t in prompt[40:]]
    assert compare_logits(want, torch.cat(got)).max_rel < 1e-4
