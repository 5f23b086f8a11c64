"""`--cpu-moe`: a GPU backend's routed experts of some layers computed on the CPU kernels, from the file.

Runs Triton under its interpreter on tiny-k in ds4's layout (IQ2_XXS gate/up, Q2_K down experts). The
first host layer's MoE sees the same input as the all-device run's, so its output may differ only by
what the int8 activations of the host's products explain: the same experts on the same input in
float32 against int8 (the reference's products against the kernels'), measured here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from host_experts_check import check_host_output, crossing_bytes, rounding_effects
from triton_interpreter import apply_patches

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError
from dwarfstar.experts.attach import StreamingOptions
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY_K, write_synthetic_model

PROMPT = torch.randint(3, 120000, (12,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cpu-moe") / "tiny-k.gguf"
    write_synthetic_model(path, TINY_K, "ds4", seed=4)
    return path


def run(
    path: Path, cpu_moe: range, device: str = "cpu"
) -> tuple[object, torch.Tensor, dict[int, tuple[torch.Tensor, ...]]]:
    """The Triton backend over the prompt (on the CPU: the interpreter): its logits, and each layer's MoE
    inputs and output."""
    apply_patches()
    from dwarfstar.backends.triton import load_backend

    backend = load_backend(open_model(path), device=device, cpu_moe=cpu_moe, threads=2)
    seen: dict[int, tuple[torch.Tensor, ...]] = {}
    moe = backend.ops.moe

    def recording(il, x, ids, weights, experts, batch):
        out = moe(il, x, ids, weights, experts, batch)
        seen[il] = (x.clone(), ids.clone(), weights.clone(), out.clone())
        return out

    backend.ops.moe = recording
    return backend, backend.forward(PROMPT, backend.new_state()), seen


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: the pinned copies and events run on CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_host_layers_differ_only_by_the_activation_rounding(model_path, device) -> None:
    """On a GPU (tools/gpu_check.sh) the inputs leave through pinned memory while the shared expert runs."""
    device_run, _, on_device = run(model_path, range(0), device)
    host_run, logits, on_host = run(model_path, range(2), device)
    assert [host_run.ops.w.layers[il].gate_exps is None for il in range(4)] == [True, True, False, False]
    x, ids, weights, device_out = (t.cpu() for t in on_device[0])
    assert torch.equal(on_host[0][0].cpu(), x) and torch.equal(on_host[0][1].cpu(), ids)  # the same input
    host_out = on_host[0][3].cpu()

    # what int8 activations change in layer 0's routed experts, on this input
    check_host_output(host_out, device_out, rounding_effects(model_path, 0, x, ids, weights)[2])
    assert torch.isfinite(logits).all()


def test_bytes_crossing(model_path) -> None:
    """Each host layer sends its rows and the ids and weights of its k experts, and gets its rows back:
    per token and layer 2 x dim float32 + k x (int64 + float32)."""
    backend, _, _ = run(model_path, range(3))
    assert backend.ops.host.crossed == crossing_bytes(TINY_K, len(PROMPT), 3)


def test_decode_steps_run_with_host_layers(model_path) -> None:
    backend, _, _ = run(model_path, range(4))
    state = backend.new_state()
    backend.forward(PROMPT, state)
    for token in (5, 6, 7):
        assert torch.isfinite(backend.forward([token], state)).all()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (dict(backend="reference", cpu_moe="2"), "--cpu-moe keeps routed experts on the CPU beside a GPU backend"),
        (dict(backend="cpu", cpu_moe="all"), "the cpu backend computes everything where it runs"),
        (dict(backend="reference", cpu_moe="two"), "--cpu-moe takes a layer count or 'all'"),
    ],
)
def test_bad_cpu_moe_is_refused(model_path, spec, message) -> None:
    with pytest.raises(DwarfStarError, match=message):
        load_engine(EngineSpec(model_path, **spec))


def test_cpu_moe_with_streaming_is_refused(model_path) -> None:
    """The two flags both move the routed experts; only the interpreter's Triton could take either."""
    spec = EngineSpec(model_path, "reference", cpu_moe="1", streaming=StreamingOptions())
    with pytest.raises(DwarfStarError, match="--cpu-moe"):
        load_engine(spec)


def test_the_layer_count_is_clamped() -> None:
    assert EngineSpec("m.gguf", cpu_moe="all").cpu_moe_layers(43) == range(43)
    assert EngineSpec("m.gguf", cpu_moe="50").cpu_moe_layers(43) == range(43)
    assert EngineSpec("m.gguf", cpu_moe="0").cpu_moe_layers(43) == range(0)
    assert EngineSpec("m.gguf").cpu_moe_layers(43) == range(0)
    # a pipeline stage keeps those of its own layers
    assert EngineSpec("m.gguf", cpu_moe="20").cpu_moe_layers(43, range(10, 30)) == range(10, 20)
    assert EngineSpec("m.gguf", cpu_moe="20").cpu_moe_layers(43, range(25, 43)) == range(25, 25)
