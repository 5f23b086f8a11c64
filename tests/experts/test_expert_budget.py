"""Budget arithmetic against the figures ds4 prints for the real Flash q2 file, and the layout's
byte ranges against the file they describe."""

from __future__ import annotations

import pytest

from dwarfstar.experts.layout import (
    BudgetError,
    ExpertLayout,
    auto_budget_bytes,
    check_capacity,
    experts_for_bytes,
    parse_size,
    split_bytes,
)
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.synthetic import TINY_K, tensor_type
from dwarfstar.model.tensors import EXPERTS, layer_tensor

GIB, MIB = 1 << 30, 1 << 20
# ggml block sizes (bytes per 256 weights), from the ggml type table rather than our constants
IQ2_XXS_BLOCK, Q2_K_BLOCK = 66, 84


def q2_split(args: ModelArgs) -> tuple[int, int]:
    return split_bytes(args, lambda spec: tensor_type(spec, "ds4"))


def test_flash_q2_matches_ds4_figures():
    # ds4 on the Flash q2 file prints "routed expert size: 6.75 MiB" and "non-routed weights: 8.20 GiB"
    # (antirez/ds4#488); the file is 80.76 GiB of weights (antirez/ds4#437)
    args = ModelArgs.flash()
    routed, other = q2_split(args)
    expert = routed // (args.n_layers * args.n_routed_experts)
    assert expert / MIB == 6.75
    assert round(other / GIB, 2) == 8.20
    assert round((routed + other) / GIB, 2) == 80.76
    # --ssd-streaming-cache-experts 32GB: whole experts in 32 GiB
    assert experts_for_bytes(parse_size("32GB"), expert) == 4854  # 32768 MiB / 6.75 MiB = 4854.5


def test_pro_q2_expert_size():
    args = ModelArgs.pro()
    routed, _ = q2_split(args)
    gate_up = 3072 * 7168 // 256 * IQ2_XXS_BLOCK
    down = 7168 * 3072 // 256 * Q2_K_BLOCK
    assert routed == (2 * gate_up + down) * 61 * 384
    assert experts_for_bytes(parse_size("32GB"), 2 * gate_up + down) == 32 * GIB // (2 * gate_up + down) == 1849


def test_sizes_count_in_binary_units_as_ds4():
    # ds4 plans `--ssd-streaming-cache-experts 20GB` as 21.47 (1e9-byte) GB (antirez/ds4#802)
    assert round(parse_size("20GB") / 1e9, 2) == 21.47
    assert parse_size("512MB") == 512 * MIB
    assert parse_size("1.5g") == 3 * GIB // 2
    assert parse_size("4096") == 4096
    for bad in ("lots", "-3GB", "12PB", ""):
        with pytest.raises(BudgetError, match="cannot read the size"):
            parse_size(bad)


def test_auto_budget_on_a_small_gpu_leaves_no_room():
    # ds4 on an 8 GB CUDA card: "recommends 7.62 GiB", "80% ... 6.10 GiB", non-routed 8.20 GiB (ds4#488)
    usable = int(7.62 * GIB)
    assert round((usable * 0.8) / GIB, 2) == 6.10
    _, other = q2_split(ModelArgs.flash())
    left = auto_budget_bytes(usable, other)
    assert left < 0 and experts_for_bytes(left, int(6.75 * MIB)) == 0
    with pytest.raises(BudgetError, match="smaller than the 6 one token uses"):
        check_capacity(0, 6, 43 * 256)


def test_layout_tiles_each_expert_tensor(tiny_k_path):
    with GGUFFile(tiny_k_path) as gguf:
        layout = ExpertLayout.of(gguf, TINY_K)
        assert layout.routed_bytes == q2_split(TINY_K)[0]
        for il in (0, TINY_K.n_layers - 1):
            for i, name in enumerate(EXPERTS):
                info = gguf.tensors[layer_tensor(il, name)]
                ranges = [layout.expert(il, e)[i] for e in range(TINY_K.n_routed_experts)]
                assert ranges[0].offset == info.offset
                assert ranges[-1].offset + ranges[-1].nbytes == info.offset + info.nbytes
                assert all(a.offset + a.nbytes == b.offset for a, b in zip(ranges, ranges[1:], strict=False))
                assert ranges[0].shape == info.shape[1:] and ranges[0].ggml_type == info.ggml_type
    with pytest.raises(IndexError):
        layout.expert(0, TINY_K.n_routed_experts)
