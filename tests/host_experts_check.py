"""What `--cpu-moe` tests on every backend share: how far a host layer's MoE output may move.

A host layer computes its routed experts on the CPU kernels, whose inputs are rounded to int8; given
the same layer input as the all-device run, its output may differ by what that rounding changes in
the same experts on the same input: the reference's float32 products against the kernels'.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dwarfstar.backends.cpu.products import KernelProducts
from dwarfstar.backends.reference import ops
from dwarfstar.backends.reference.weights import FLOAT32, GGUFWeights
from dwarfstar.model import tensors as tt
from dwarfstar.model.config import ModelArgs
from dwarfstar.model.config_v41 import ModelArgs41
from dwarfstar.model.file_v41 import open_model41
from dwarfstar.model.loader import is_v41, open_model


def rounding_effects(path: Path, il: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """(the routed sum in float32, the same on the kernels, their largest difference) for layer il of
    the V4 or V4.1 file at `path`."""
    model = open_model41(path) if is_v41(path) else open_model(path)
    names = [tt.layer_tensor(il, name) for name in tt.EXPERTS]
    kernels, weights_file = KernelProducts(model.gguf, 2), GGUFWeights(model.gguf)
    ids = ids.long()

    def routed(products, expert):
        return ops.routed_ffn(x, ids, ids, weights, expert, products, model.args.swiglu_limit)

    exact = routed(FLOAT32, lambda e: tuple(weights_file.expert(n, e) for n in names))
    rounded = routed(kernels, lambda e: tuple(kernels.file_expert(n, e) for n in names))
    return exact, rounded, (exact - rounded).abs().max().item()


def check_host_output(host_out: torch.Tensor, device_out: torch.Tensor, explained: float) -> None:
    """The host layer's output is within 1.5x what the rounding explains (and float32 noise)."""
    assert explained > 0
    assert (host_out - device_out).abs().max().item() <= 1.5 * explained + 1e-5 * device_out.abs().max().item()


def crossing_bytes(args: ModelArgs | ModelArgs41, tokens: int, layers: int) -> int:
    """Bytes a host layer moves per token: its rows there and back (float32), and the ids (int64) and
    router weights (float32) of its k experts."""
    return tokens * layers * (2 * args.dim * 4 + args.n_activated_experts * (8 + 4))
