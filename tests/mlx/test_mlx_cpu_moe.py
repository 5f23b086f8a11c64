"""`--cpu-moe` on the MLX backend: the routed experts of some layers computed on the CPU kernels, from the file.

Runs MLX's portable path (the exact packing) on tiny-k in ds4's layout (IQ2_XXS gate/up, Q2_K down
experts), as tests/cpu/test_cpu_moe.py runs Triton. The first host layer's MoE sees the same input as
the all-MLX run's, so its output may differ only by what the int8 activations of the host's products
explain: the same experts on the same input in float32 against int8 (the reference's products
against the kernels'), measured here. The exact packing's products are float32 up to summation
order, so the all-MLX run stands where the reference's float32 products do.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from host_experts_check import check_host_output, crossing_bytes, rounding_effects

from dwarfstar.backends.mlx import weights as mlx_weights
from dwarfstar.backends.mlx.model import MLXModel
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError
from dwarfstar.experts.attach import StreamingOptions
from dwarfstar.model import tensors as tt
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY_K, write_synthetic_model

PROMPT = torch.randint(3, 120000, (12,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mlx-cpu-moe") / "tiny-k.gguf"
    write_synthetic_model(path, TINY_K, "ds4", seed=4)
    return path


def torch_of(a: mx.array) -> torch.Tensor:
    return torch.from_numpy(np.array(a))


def run(path: Path, cpu_moe: range) -> tuple[MLXModel, torch.Tensor, dict[int, tuple[torch.Tensor, ...]]]:
    """MLX (exact packing) over the prompt: its logits, and each layer's MoE inputs and output."""
    backend = MLXModel(open_model(path), packing="exact", cpu_moe=cpu_moe, threads=2)
    seen: dict[int, tuple[mx.array, ...]] = {}
    moe = backend.ops.moe

    def recording(il, x, ids, weights, experts, batch):
        out = moe(il, x, ids, weights, experts, batch)
        seen[il] = (x, ids, weights, out)
        return out

    backend.ops.moe = recording
    logits = backend.forward(PROMPT, backend.new_state())
    return backend, logits, {il: tuple(torch_of(a) for a in arrays) for il, arrays in seen.items()}


@pytest.fixture(scope="module")
def all_mlx(model_path) -> dict[int, tuple[torch.Tensor, ...]]:
    return run(model_path, range(0))[2]


# layer 0 is hash-routed (ids from the token table), layer 3 routed by its scores (argpartition's
# uint32 ids); `--cpu-moe N` always starts at layer 0, the backend takes any range
@pytest.mark.parametrize("host_layers", [range(2), range(3, 5)], ids=["hash-routed", "score-routed"])
def test_host_layers_differ_only_by_the_activation_rounding(model_path, all_mlx, host_layers) -> None:
    host_run, logits, on_host = run(model_path, host_layers)
    il = host_layers.start
    assert host_run.ops.host.layers == host_layers
    # the host layers' routed experts are not packed
    assert sorted(host_run.ops.experts.layers) == [i for i in range(TINY_K.n_layers) if i not in host_layers]
    x, ids, weights, device_out = all_mlx[il]
    assert torch.equal(on_host[il][0], x) and torch.equal(on_host[il][1], ids)  # the same input reached the layer
    assert torch.equal(on_host[il][2], weights)
    host_out = on_host[il][3]

    # what int8 activations change in the layer's routed experts, on this input
    _, rounded, explained = rounding_effects(model_path, il, x, ids, weights)
    check_host_output(host_out, device_out, explained)
    # the host's output is MLX's shared expert plus the kernels' routed sum, nothing else
    gate, up, down = host_run.ops.layers[il].shared
    xm, swiglu = mx.array(x.numpy()), host_run.ops.fused.swiglu
    shared = torch_of(down.matmul(swiglu(gate.matmul(xm), up.matmul(xm))))
    assert torch.allclose(host_out, shared + rounded, rtol=0, atol=1e-6 * host_out.abs().max().item())
    assert torch.isfinite(logits).all()


def test_host_layers_experts_are_never_read_into_mlx(model_path, monkeypatch) -> None:
    """No routed-expert tensor of a host layer goes through the MLX packing; the others all do."""
    packed: list[str] = []
    experts = mlx_weights.Weights.experts

    def recording(self, name):
        packed.append(name)
        return experts(self, name)

    monkeypatch.setattr(mlx_weights.Weights, "experts", recording)
    MLXModel(open_model(model_path), packing="exact", cpu_moe=range(4), threads=1)
    assert sorted(packed) == sorted(tt.layer_tensor(il, name) for il in (4, 5) for name in tt.EXPERTS)


def test_bytes_crossing(model_path) -> None:
    """Each host layer sends its rows and the ids and weights of its k experts, and gets its rows back:
    per token and layer 2 x dim float32 + k x (int64 + float32)."""
    backend, _, _ = run(model_path, range(3))
    assert backend.ops.host.crossed == crossing_bytes(TINY_K, len(PROMPT), 3)


def test_decode_steps_run_with_host_layers(model_path) -> None:
    backend, _, _ = run(model_path, range(4))
    state = backend.new_state()
    prompt = backend.forward(PROMPT, state)
    steps = [backend.forward([token], state) for token in (5, 6, 7)]
    assert all(torch.isfinite(logits).all() for logits in steps)
    # decode steps continue the prompt: the same tokens in one pass give the same rows (bit-equal on
    # Linux's CPU; the bound leaves summation order to other machines)
    whole = backend.forward([*PROMPT, 5, 6, 7], backend.new_state())
    rows = torch.cat([prompt[-1:], *steps])
    assert torch.allclose(rows, whole[len(PROMPT) - 1 :], rtol=0, atol=1e-5 * whole.abs().max().item())


def test_the_engine_loads_mlx_with_every_layer_on_the_host(model_path) -> None:
    loaded = load_engine(EngineSpec(model_path, "mlx", cpu_moe="all", threads=1))
    backend = loaded.backend
    assert loaded.backend_name == "mlx" and isinstance(backend, MLXModel)
    assert list(backend.ops.host.layers) == list(range(TINY_K.n_layers)) and backend.ops.experts.layers == {}
    state = backend.new_state()
    assert torch.isfinite(backend.forward(PROMPT, state)).all()
    assert torch.isfinite(backend.forward([5], state)).all()
    assert backend.ops.host.crossed == crossing_bytes(TINY_K, len(PROMPT) + 1, TINY_K.n_layers)


def test_cpu_moe_with_streaming_is_refused_on_mlx(model_path) -> None:
    spec = EngineSpec(model_path, "mlx", cpu_moe="1", streaming=StreamingOptions())
    with pytest.raises(DwarfStarError, match="--cpu-moe and --ssd-streaming"):
        load_engine(spec)
