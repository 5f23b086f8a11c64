"""Shared test fixtures."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

# Triton reads TRITON_INTERPRET when a kernel is defined, and any test may import the Triton backend
# (the engine probes it), so on a CPU-only machine the interpreter is switched on before collection.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest

from dwarfstar.gguf.constants import BLOCK_GEOMETRY, GGMLType

TESTS = Path(__file__).parent
# Test folders whose files must run one after another in one process: tests/distributed starts its
# stage workers once per session and they wait a bounded time for their coordinator.
ONE_WORKER = ("distributed",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist's `--dist loadgroup` (.ci/run), a file's tests stay on one worker, in order,
    as with `--dist loadfile` (module fixtures built once); the ONE_WORKER folders are one group each."""
    for item in items:
        if not item.path.is_relative_to(TESTS):
            continue
        part = item.path.relative_to(TESTS).parts
        item.add_marker(pytest.mark.xdist_group(part[0] if part[0] in ONE_WORKER else "/".join(part)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With DWARFSTAR_FAILURE_LOG set (tools/gpu_check.sh), each failure's traceback is appended to
    that file as the report arrives, in the one process that gathers them (xdist's controller), so a
    run stopped by a timeout before its summary still says why its tests failed."""
    path = os.environ.get("DWARFSTAR_FAILURE_LOG")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"\n==== {report.nodeid} failed ({report.when})\n{report.longreprtext}\n")


# Byte offsets of the fp16 scale fields (d, dmin) inside one block of each quant type.
_FP16_FIELDS = {
    GGMLType.Q8_0: (0,),
    GGMLType.Q2_K: (80, 82),
    GGMLType.Q4_K: (0, 2),
    GGMLType.IQ2_XXS: (0,),
    GGMLType.MXFP4: (),
}


@pytest.fixture
def quant_blocks() -> Callable[[GGMLType, int, int], np.ndarray]:
    """make(ggml_type, n_blocks, seed) -> uint8 (n_blocks, bytes_per_block) of random, well-formed blocks.

    Every byte is random except the fp16 scales, which are drawn as small positive finite halves, so the
    blocks decode to finite numbers of a realistic magnitude (random fp16 bits would give NaN and inf).
    """

    def make(ggml_type: GGMLType, n_blocks: int, seed: int = 0) -> np.ndarray:
        rng = np.random.default_rng(seed)
        blocks = rng.integers(0, 256, size=(n_blocks, BLOCK_GEOMETRY[ggml_type][1]), dtype=np.uint8)
        for at in _FP16_FIELDS[ggml_type]:
            scale = rng.uniform(1e-4, 0.1, size=n_blocks).astype(np.float16)
            blocks[:, at : at + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
        if ggml_type == GGMLType.MXFP4:  # E8M0 exponent bytes: half-scales 2^-10 to 2^-4
            blocks[:, 0] = rng.integers(118, 125, size=n_blocks)
        return blocks

    return make


@pytest.fixture(scope="session")
def tiny_model_file(tmp_path_factory) -> Callable[[int], Path]:
    """tiny_model_file(seed) -> path of the `tiny` synthetic model for that seed, written once per run."""
    from dwarfstar.model.synthetic import TINY, write_synthetic_model

    written: dict[int, Path] = {}

    def make(seed: int) -> Path:
        if seed not in written:
            written[seed] = tmp_path_factory.mktemp("tiny") / f"tiny-{seed}.gguf"
            write_synthetic_model(written[seed], TINY, seed=seed)
        return written[seed]

    return make


@pytest.fixture(scope="session")
def tiny_vision_file(tmp_path_factory) -> Path:
    """A `vision-tiny` encoder (seed 1) in ds4's layout, its rows and router biases for the `tiny` model."""
    from dwarfstar.model.synthetic import VISION_PRESETS, write_synthetic_vision
    from dwarfstar.model.vision import VISION_TINY

    path = tmp_path_factory.mktemp("vision-tiny") / "encoder.gguf"
    write_synthetic_vision(path, VISION_TINY, seed=1, router=VISION_PRESETS["vision-tiny"][1])
    return path


@pytest.fixture(scope="session")
def v41_tiny_file(tmp_path_factory) -> Path:
    """The synthetic `v41-tiny` DeepSeek V4.1 file (seed 0), written once per run."""
    from dwarfstar.model.synthetic_v41 import V41_TINY, write_synthetic_v41

    path = tmp_path_factory.mktemp("v41") / "v41-tiny.gguf"
    write_synthetic_v41(path, V41_TINY, seed=0)
    return path


@pytest.fixture(scope="module")
def v41_tiny(v41_tiny_file):
    """The `v41-tiny` file opened (`ModelFile41`), once per test module, closed after it."""
    from dwarfstar.model.file_v41 import open_model41

    model = open_model41(v41_tiny_file)
    yield model
    model.close()


@pytest.fixture(scope="session")
def v41_dspark_file(tmp_path_factory) -> Path:
    """A random DSpark drafter (`TINY_DSPARK41`, seed 1) as the `v41-tiny` model's support file."""
    from dwarfstar.model.synthetic_v41 import TINY_DSPARK41, V41_TINY, write_synthetic_dspark41

    path = tmp_path_factory.mktemp("dspark41") / "tiny-dspark41.gguf"
    write_synthetic_dspark41(path, V41_TINY, TINY_DSPARK41, seed=1)
    return path


@pytest.fixture(scope="session")
def close_arrays() -> Callable[..., bool]:
    """close(got, want, tol=1e-5) -> whether two arrays (torch or numpy) match: the same shape, the same
    infinities (a compressor frontier's empty slots hold gate -inf), and the finite values within tol
    of the largest finite magnitude (fp32 noise between differently batched matmuls)."""

    def close(got, want, tol: float = 1e-5) -> bool:
        got, want = torch.as_tensor(np.asarray(got)), torch.as_tensor(np.asarray(want))
        if got.shape != want.shape or not torch.equal(got.isinf(), want.isinf()):
            return False
        if not torch.equal(got[want.isinf()], want[want.isinf()]):
            return False  # infinities of the same sign
        finite = ~want.isinf()
        if not finite.any():
            return True
        scale = max(float(want[finite].abs().max()), 1e-6)
        return bool((got[finite] - want[finite]).abs().max() <= tol * scale)

    return close


@pytest.fixture(scope="session")
def tiny_open(tiny_model_file):
    """The `tiny` model file (seed 0), opened."""
    from dwarfstar.model.loader import open_model

    return open_model(tiny_model_file(0))


@pytest.fixture(scope="session")
def image_model(tiny_open):
    """The `tiny` model on the reference backend with random image router biases: the image-span tests'."""
    import torch

    from dwarfstar.backends.reference.model import ReferenceModel
    from dwarfstar.model.synthetic import TINY

    m = ReferenceModel(tiny_open)
    gen = torch.Generator().manual_seed(11)
    m.attach_image_biases({il: torch.randn(TINY.n_routed_experts, generator=gen) for il in range(TINY.n_layers)})
    return m
