"""Fixtures of the backend conformance suite: every backend that can run here, on the tiny model.

`kind` is parametrised over the backends (ids say what ran: reference, triton-interpret or
triton-cuda, mlx-cpu or mlx-metal); a backend that cannot run here is a skip with the reason.
Backends and the reference results are built once per session and shared by the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conformance import CTX, MODEL_SEED, PROMPT, REFERENCE, BackendKind, backend_kinds, load, payload_of
from triton_interpreter import apply_patches

from dwarfstar.backends.protocol import Backend

apply_patches()  # Triton's interpreter runs the kernels wherever no GPU is present


def _kind_params() -> list:
    return [
        pytest.param(kind, id=test_id, marks=[] if why is None else [pytest.mark.skip(reason=why)])
        for kind, test_id, why in backend_kinds()
    ]


@pytest.fixture(scope="session")
def model_path(tiny_model_file) -> Path:
    return tiny_model_file(MODEL_SEED)


@pytest.fixture(scope="session")
def loaded(model_path) -> Callable[[BackendKind, bool], Backend]:
    """loaded(kind, qat) -> that backend over the tiny model, loaded once per session."""
    cache: dict[tuple[BackendKind, bool], Backend] = {}

    def get(kind: BackendKind, qat: bool) -> Backend:
        if (kind, qat) not in cache:
            cache[kind, qat] = load(kind, model_path, qat)
        return cache[kind, qat]

    return get


@pytest.fixture(scope="session", params=_kind_params())
def kind(request) -> BackendKind:
    return request.param


@pytest.fixture(scope="session")
def backend(kind, loaded) -> Backend:
    """The backend under test with the QAT rounding on, as the real model runs."""
    return loaded(kind, True)


@pytest.fixture(scope="session")
def reference_logits(loaded) -> Callable[[bool], torch.Tensor]:
    """reference_logits(qat) -> the reference's logits after every prefix of PROMPT, one pass."""
    cache = {}

    def get(qat: bool):
        if qat not in cache:
            reference = loaded(REFERENCE, qat)
            cache[qat] = reference.forward(PROMPT, reference.new_state())
        return cache[qat]

    return get


@pytest.fixture(scope="session")
def reference_payload(loaded) -> Callable[[int, bool], bytes]:
    """reference_payload(n, qat) -> the DSV4 payload of the reference's state after PROMPT[:n].

    States are backend-neutral, so a backend continues from it: long prefixes cost the Triton
    interpreter nothing (it would take about a second per prompt token).
    """
    cache: dict[tuple[int, bool], bytes] = {}

    def get(n: int, qat: bool) -> bytes:
        assert n < CTX
        if (n, qat) not in cache:
            reference = loaded(REFERENCE, qat)
            state = reference.new_state()
            reference.forward(PROMPT[:n], state, all_logits=False)
            cache[n, qat] = payload_of(state, reference)
        return cache[n, qat]

    return get
