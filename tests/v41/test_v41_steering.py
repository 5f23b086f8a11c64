"""Steering a DeepSeek V4.1 model (issue 33): a direction file applies in every layer through the V4.1
forward's `attn_out` / `ffn_out` hooks. A zero direction leaves the logits as they were; a unit one gives
the logits of the forward with each sublayer's output y replaced by y - F v (v . y), computed here by a
hook of the test's own; each sequence of a batch keeps its own scale; and `steer build` (whose probe
reads V4's batches) refuses a V4.1 file by name."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from dwarfstar.engine.load import load_engine, require_v4
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import ModelFileError
from dwarfstar.model.file_v41 import NOT_YET
from dwarfstar.steering.apply import SteeredBackend, SteeringOptions
from dwarfstar.steering.direction import SteeringScale

PROMPT = [(7919 * i + 101) % 120000 for i in range(13)]


def spec(path, **kw) -> EngineSpec:
    return EngineSpec(path, "reference", ctx=64, engram_cache=1, **kw)


@pytest.fixture(scope="module")
def plain(v41_tiny_file):
    return load_engine(spec(v41_tiny_file))


@pytest.fixture(scope="module")
def unit_file(tmp_path_factory, plain):
    args = plain.model.args
    v = np.random.default_rng(3).standard_normal((args.n_layers, args.dim)).astype(np.float32)
    path = tmp_path_factory.mktemp("steer41") / "unit.f32"
    path.write_bytes((v / np.linalg.norm(v, axis=1, keepdims=True)).astype("<f4").tobytes())
    return path


def logits_of(engine, tokens=PROMPT) -> torch.Tensor:
    return engine.backend.forward(tokens, engine.backend.new_state(), all_logits=True)


def test_a_zero_direction_leaves_the_logits(v41_tiny_file, plain, tmp_path):
    args = plain.model.args
    path = tmp_path / "zero.f32"
    path.write_bytes(np.zeros((args.n_layers, args.dim), "<f4").tobytes())
    steered = load_engine(spec(v41_tiny_file, steering=SteeringOptions(path, ffn=1.0, attn=1.0)))
    assert isinstance(steered.backend, SteeredBackend)
    assert torch.equal(logits_of(steered), logits_of(plain))


def test_a_direction_updates_every_sublayer_output(v41_tiny_file, plain, unit_file):
    ffn, attn = 1.5, -0.5
    steered = load_engine(spec(v41_tiny_file, steering=SteeringOptions(unit_file, ffn=ffn, attn=attn)))
    got = logits_of(steered)
    v = torch.from_numpy(np.fromfile(unit_file, "<f4").reshape(plain.model.args.n_layers, -1))
    seen: set[tuple[str, int]] = set()

    def update(point: str, scale: float):
        def hook(il: int, y: torch.Tensor) -> torch.Tensor:
            seen.add((point, il))
            return y - scale * (y @ v[il])[:, None] * v[il][None, :]

        return hook

    hooks = plain.backend.transformer.hooks
    hooks["attn_out"].append(update("attn_out", attn))
    hooks["ffn_out"].append(update("ffn_out", ffn))
    try:
        want = logits_of(plain)
    finally:
        hooks["attn_out"].clear()
        hooks["ffn_out"].clear()
    n = plain.model.args.n_layers
    assert seen == {(p, il) for p in ("attn_out", "ffn_out") for il in range(n)}
    assert not torch.allclose(got, logits_of(plain), atol=1e-3)  # the direction moves them
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_each_sequence_keeps_its_own_scale(v41_tiny_file, plain, unit_file):
    engine = load_engine(spec(v41_tiny_file, steering=SteeringOptions(unit_file, ffn=1.0)))
    backend = engine.backend

    class Owner:  # what `assign` keys on: a session holding the state
        def __init__(self, state) -> None:
            self.state = state

    off, on = backend.new_state(), backend.new_state()
    owner = Owner(off)
    backend.assign(owner, SteeringScale(0.0, 0.0))
    both = backend.forward_batch([PROMPT, PROMPT], [off, on], all_logits=True)
    alone_on = backend.forward(PROMPT, backend.new_state(), all_logits=True)
    assert torch.equal(both[1], alone_on) and torch.equal(both[0], logits_of(plain))
    assert not torch.equal(both[0], both[1])


def test_steer_build_refuses_v41(plain):
    with pytest.raises(ModelFileError, match=re.escape(NOT_YET) + "; dwarfstar steer build runs DeepSeek V4 only"):
        require_v4(plain, "dwarfstar steer build")
