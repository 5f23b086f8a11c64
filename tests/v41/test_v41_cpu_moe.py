"""`--cpu-moe` with DeepSeek V4.1 (issue 33): on the GPU backends V4 takes it on (Triton, in its interpreter
here, and MLX's portable path) `v41-tiny`'s first layers' routed experts run on the CPU kernels from the
file, with V4's bounds (tests/cpu/test_cpu_moe.py, tests/mlx/test_mlx_cpu_moe.py): the first host layer's
MoE sees the all-device run's input and may differ from its output only by what the kernels' int8
activations explain (the same experts on the same input in float32 against int8, measured here). The
host layers' experts are never uploaded, the bytes crossing are counted, decode runs; the backends
without a device refuse the flag, as for V4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from host_experts_check import check_host_output, crossing_bytes, rounding_effects
from triton_interpreter import apply_patches

from dwarfstar.backends import registry
from dwarfstar.engine.load import Engine, load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.synthetic_v41 import V41_TINY

apply_patches()  # Triton's interpreter where no GPU runs the kernels (a no-op elsewhere)

PROMPT = [(7919 * i + 101) % 120000 for i in range(12)]
MLX = pytest.mark.skipif(not registry.backend_entry("mlx").available(), reason="MLX does not run here")
BACKENDS = ["triton", pytest.param("mlx", marks=MLX)]


def host(array) -> torch.Tensor:
    """A backend's array (a torch tensor on its device, an MLX array) as a host torch tensor."""
    return array.detach().cpu() if isinstance(array, torch.Tensor) else torch.from_numpy(np.array(array))


class Recorder:
    """The last call's MoE input and output of each layer, and the ids and route weights it used (read
    where the routed experts are asked for: the device's expert source, or the host's `send`)."""

    def __init__(self, loaded: Engine) -> None:
        self.ops, self.seen = loaded.backend.transformer.ops, {}
        moe, experts, send = self.ops.moe, self.ops.experts.experts, getattr(self.ops.host, "send", None)

        def recording_moe(il, x, image):
            self.il, self.x = il, host(x)
            out = moe(il, x, image)
            self.seen[il] = (self.x, self.ids, self.weights, host(out))
            return out

        def recording_experts(il, ids):
            self.ids = host(ids).long()
            return experts(il, ids)

        def recording_send(x, ids, weights):
            self.ids, self.weights = host(ids).long(), host(weights)
            return send(x, ids, weights)

        self.ops.moe, self.ops.experts.experts = recording_moe, recording_experts
        if send is not None:
            self.ops.host.send = recording_send
        self.weights = None


def engine(path, backend: str, cpu_moe: str | None) -> Engine:
    return load_engine(EngineSpec(path, backend, ctx=256, engram_cache=1, cpu_moe=cpu_moe, threads=1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_host_layers_differ_only_by_the_activation_rounding(v41_tiny_file, backend):
    on_device = engine(v41_tiny_file, backend, None)
    device_seen = Recorder(on_device)
    on_device.backend.forward(PROMPT, on_device.backend.new_state(), all_logits=False)
    loaded = engine(v41_tiny_file, backend, "2")
    ops = loaded.backend.transformer.ops
    assert ops.host.layers == range(2)
    assert sorted(ops.experts.layers) == list(range(2, V41_TINY.n_layers))  # the host layers' stay in the file
    host_seen = Recorder(loaded)
    state = loaded.backend.new_state()
    logits = loaded.backend.forward(PROMPT, state, all_logits=False)

    x, ids, _, device_out = device_seen.seen[0]
    host_x, host_ids, weights, host_out = host_seen.seen[0]
    assert torch.equal(host_x, x) and torch.equal(host_ids, ids)  # the same input reached layer 0
    exact, rounded, explained = rounding_effects(v41_tiny_file, 0, x, ids, weights)
    check_host_output(host_out, device_out, explained)
    assert not torch.equal(host_out, device_out)  # the host's products did run: int8 activations moved it
    assert torch.isfinite(logits).all()

    # decode steps run with the host layers; each token's rows cross both ways in each host layer
    for token in (5, 6):
        assert torch.isfinite(loaded.backend.forward([token], state, all_logits=False)).all()
    assert ops.host.crossed == crossing_bytes(V41_TINY, len(PROMPT) + 2, 2)


def test_every_layer_on_the_host(v41_tiny_file):
    """`--cpu-moe all` on MLX (Triton: the interpreter's seconds a call): no routed expert is packed, every
    layer's MoE crosses to the host."""
    if not registry.backend_entry("mlx").available():
        pytest.skip("MLX does not run here")
    loaded = engine(v41_tiny_file, "mlx", "all")
    ops = loaded.backend.transformer.ops
    assert ops.host.layers == range(V41_TINY.n_layers) and ops.experts.layers == {}
    state = loaded.backend.new_state()
    assert torch.isfinite(loaded.backend.forward(PROMPT, state, all_logits=False)).all()
    assert torch.isfinite(loaded.backend.forward([5], state, all_logits=False)).all()
    assert ops.host.crossed == crossing_bytes(V41_TINY, len(PROMPT) + 1, V41_TINY.n_layers)


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("reference", "--cpu-moe keeps routed experts on the CPU beside a GPU backend"),
        ("cpu", "the cpu backend computes everything where it runs"),
    ],
)
def test_backends_without_a_device_refuse_it(v41_tiny_file, backend, message):
    with pytest.raises(DwarfStarError, match=message):
        engine(v41_tiny_file, backend, "2")
