"""What the conformance suite shares: the backends that can run here, how each is loaded (through the
public loaders only), the prompt, and how two backends' logits are compared.

Importable by the suite's child processes too (the payload test continues a state in a fresh
process): put tests/ and tests/backends/ on sys.path.
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from dwarfstar.backends.protocol import Backend
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.kvcache.payload import read_payload, write_payload
from dwarfstar.model.state import SequenceState

# One prompt for every check. The tiny model has a raw window of 8, ratio-4 layers (indexer top-4)
# and ratio-128 layers, so position 5 is inside the window, 20 tokens make 5 ratio-4 rows (the
# indexer must choose), and position 131 is past the first ratio-128 row (completed at 127).
PROMPT = torch.randint(3, 120000, (140,), generator=torch.Generator().manual_seed(7)).tolist()
MODEL_SEED = 4
# the payload header's context and prefill chunk (a payload is only read back with the same ones)
CTX, CHUNK = 1024, 64


@dataclass(frozen=True)
class BackendKind:
    """A backend and what runs it here: `name` as load_engine spells it, `runs_on` for the test id."""

    name: str
    runs_on: str

    @property
    def id(self) -> str:
        return self.name if self.name == "reference" else f"{self.name}-{self.runs_on}"


REFERENCE = BackendKind("reference", "cpu")


def backend_kinds() -> list[tuple[BackendKind | None, str, str | None]]:
    """(kind, id, why it cannot run) for every backend; kind is None where it cannot run here."""
    kinds: list[tuple[BackendKind | None, str, str | None]] = [(REFERENCE, REFERENCE.id, None)]
    from dwarfstar.backends.cpu.native import available

    why = available()
    cpu = BackendKind("cpu", "native")
    kinds.append((None if why else cpu, cpu.id, f"the CPU kernels do not build here: {why}" if why else None))
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        kinds.append((None, "triton", f"triton does not import: {exc}"))
    else:
        kind = BackendKind("triton", "cuda" if torch.cuda.is_available() else "interpret")
        kinds.append((kind, kind.id, None))
    from dwarfstar.backends.mlx import metal_available, mlx_available

    if mlx_available():
        kind = BackendKind("mlx", "metal" if metal_available() else "cpu")
        kinds.append((kind, kind.id, None))
    else:
        kinds.append((None, "mlx", "mlx does not import (pip install mlx[cpu] on Linux)"))
    return kinds


def load(kind: BackendKind, model_path: Path, qat: bool) -> Backend:
    """The backend as `dwarfstar.engine.load.load_engine` builds it; Triton's interpreter only through the
    Triton loader, as load_engine refuses Triton without a GPU."""
    if kind.runs_on == "interpret":
        from triton_interpreter import apply_patches

        from dwarfstar.backends.triton import load_backend
        from dwarfstar.model.loader import open_model

        apply_patches()
        return load_backend(open_model(model_path), device="cpu", qat=qat)
    from dwarfstar.engine.load import load_engine

    return load_engine(EngineSpec(model_path, backend=kind.name, qat=qat)).backend


def state_device(backend: Backend) -> torch.device:
    """Where the backend keeps its torch tensors (its states' logits)."""
    return torch.device(backend.new_state().cache.storage.device)


def payload_of(state: SequenceState, backend: Backend) -> bytes:
    buf = io.BytesIO()
    write_payload(buf, state, backend.args, CTX, CHUNK)
    return buf.getvalue()


def state_from_payload(data: bytes, backend: Backend) -> SequenceState:
    """A new state of `backend` holding the payload's sequence (states are backend-neutral)."""
    return read_payload(data, backend.args, CTX, CHUNK, backend.new_state)


# -- comparing logits ------------------------------------------------------------------------------
# A reference top-1/top-2 gap below this is a near-tie that a flipped QAT rounding may swap.
NEAR_TIE = 1e-2


@dataclass(frozen=True)
class LogitDiff:
    max_rel: float  # max |got - want| over max |want|
    mean_kl: float  # KL(want || got) per position, averaged
    top1_mismatches: int  # positions whose argmax differs although want's top-2 gap is >= NEAR_TIE
    top1_changes: int  # positions whose argmax differs at all

    def within(self, max_rel: float, mean_kl: float, near_ties_may_swap: bool) -> bool:
        changes = self.top1_mismatches if near_ties_may_swap else self.top1_changes
        return self.max_rel < max_rel and self.mean_kl < mean_kl and changes == 0


def compare_logits(want: torch.Tensor, got: torch.Tensor) -> LogitDiff:
    """Compare [T, vocab] logits position by position (float64, on the CPU)."""
    want, got = want.detach().cpu().double(), got.detach().cpu().double()
    assert want.shape == got.shape, (want.shape, got.shape)
    log_p = want.log_softmax(-1)
    kl = (log_p.exp() * (log_p - got.log_softmax(-1))).sum(-1)
    changed = want.argmax(-1) != got.argmax(-1)
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) >= NEAR_TIE
    max_rel = ((want - got).abs().max() / want.abs().max()).item()
    return LogitDiff(
        max_rel=max_rel if math.isfinite(max_rel) else math.inf,
        mean_kl=kl.mean().item(),
        top1_mismatches=int((changed & clear).sum()),
        top1_changes=int(changed.sum()),
    )


# the suite's tolerances (why: tests/backends/test_conformance_logits.py)
EXACT_REL, EXACT_KL = 1e-5, 1e-8
QAT_REL, QAT_KL = 1e-2, 1e-5


def assert_matches_reference(want: torch.Tensor, got: torch.Tensor, qat: bool, what: str) -> None:
    diff = compare_logits(want, got)
    if qat:
        assert diff.within(QAT_REL, QAT_KL, near_ties_may_swap=True), f"{what}: {diff}"
    else:
        assert diff.within(EXACT_REL, EXACT_KL, near_ties_may_swap=False), f"{what}: {diff}"


def tests_dir() -> Path:
    return Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """The environment of a child process that imports this module (and the interpreter patches)."""
    paths = [str(tests_dir()), str(tests_dir() / "backends")]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    return env
