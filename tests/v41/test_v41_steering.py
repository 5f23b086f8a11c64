"""Steering a DeepSeek V4.1 model (issue 33): a direction file applies in every layer through the V4.1
forward's `attn_out` / `ffn_out` hooks. A zero direction leaves the logits as they were; a unit one gives
the logits of the forward with each sublayer's output y replaced by y - F v (v . y), computed here by a
hook of the test's own, and Triton and MLX steer as the reference does; each sequence of a batch keeps
its own scale; `steer build` on a V4.1 file averages the sublayer outputs at each prompt's last token
that a hook of the test's own reads, and `steer eval` measures the file it writes."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.quant.prompts import PromptText
from dwarfstar.steering.apply import SteeredBackend, SteeringOptions
from dwarfstar.steering.direction import SteeringScale, build_direction
from dwarfstar.steering.probe import prompt_ids

_register_commands()
PROMPT = [(7919 * i + 101) % 120000 for i in range(13)]
ROW = re.compile(r"^\s*(-?[\d.]+)\s+[\d.]+\s+(-?[\d.]+)\s+(-?[\d.]+)\s")  # steer eval: scale, length, in, out


def spec(path, backend: str = "reference", **kw) -> EngineSpec:
    return EngineSpec(path, backend, ctx=64, engram_cache=1, **kw)


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


def cli(*args: str) -> str:
    done = CliRunner().invoke(app, [*args])
    assert done.exit_code == 0, done.output
    return done.output


def last_rows(engine, prompts: list[list[int]], point: str) -> torch.Tensor:
    """Each prompt's last-token output of every layer's `point` sublayer [prompts, layers, dim], read by
    a hook of this test's own."""
    seen: dict[int, torch.Tensor] = {}

    def keep(il: int, out: torch.Tensor) -> None:
        seen[il] = out[-1].clone()

    hooks = engine.backend.transformer.hooks[point]
    hooks.append(keep)
    try:
        rows = []
        for ids in prompts:
            engine.backend.forward(ids, engine.backend.new_state(), all_logits=False)
            rows.append(torch.stack([seen[il] for il in range(engine.model.args.n_layers)]))
    finally:
        hooks.remove(keep)
    return torch.stack(rows)


def test_steer_build_and_eval_run_on_v41(v41_tiny_file, plain, tmp_path):
    good, bad = ["Renzo e Lucia", "Il lago di Como"], ["Don Abbondio", "I bravi"]
    (tmp_path / "good.txt").write_text("\n".join(good) + "\n")
    (tmp_path / "bad.txt").write_text("\n".join(bad) + "\n")
    out, model = tmp_path / "dir.f32", ["-m", str(v41_tiny_file), "--backend", "reference"]
    cli("steer", "build", "--good", str(tmp_path / "good.txt"), "--bad", str(tmp_path / "bad.txt"), "-o", str(out),
        "--component", "attn_out", *model)  # fmt: skip
    args = plain.model.args
    ids = {name: [prompt_ids(PromptText("", p, False), plain.tokenizer, False) for p in texts] for name, texts in
           (("good", good), ("bad", bad))}  # fmt: skip
    want = build_direction(last_rows(plain, ids["good"], "attn_out"), last_rows(plain, ids["bad"], "attn_out"), True)
    got = torch.from_numpy(np.fromfile(out, dtype="<f4").reshape(args.n_layers, args.dim))
    assert torch.allclose(got, want, atol=1e-6) and got.norm(dim=-1).gt(0.99).all()
    # at scale 1 each attention output loses its whole projection on the unit direction
    table = cli("steer", "eval", str(out), "--prompts", str(tmp_path / "good.txt"), "--scales=0,1", "-n", "2", *model)
    rows = {float(m[1]): (float(m[2]), float(m[3])) for m in map(ROW.match, table.splitlines()) if m}
    assert sorted(rows) == [0.0, 1.0], table
    assert rows[0.0][0] == rows[0.0][1] > 0.01 and abs(rows[1.0][1]) < 1e-4, table  # the good side projects ahead


@pytest.mark.parametrize("backend", ["triton", "mlx"])
def test_triton_and_mlx_steer_as_the_reference(v41_tiny_file, unit_file, backend):
    """The same direction on Triton (the interpreter here) and MLX moves the logits as on the reference,
    without the QAT roundings (where the backends agree to float32 order): the hooks, the device arrays
    of the direction and its scales, per backend."""
    if backend == "mlx":
        pytest.importorskip("mlx.core", reason="mlx does not import (pip install mlx[cpu] on Linux)")
    else:
        from triton_interpreter import apply_patches

        apply_patches()  # Triton's interpreter where no GPU runs the kernels (a no-op elsewhere)
    steering = SteeringOptions(unit_file, ffn=1.5, attn=-0.5)
    want = logits_of(load_engine(spec(v41_tiny_file, qat=False, steering=steering)))
    plain = logits_of(load_engine(spec(v41_tiny_file, qat=False)))  # the reference's: the backend's own is slow
    got = logits_of(load_engine(spec(v41_tiny_file, backend, qat=False, steering=steering)))
    scale = want.abs().max()
    assert float((want - plain).abs().max() / scale) > 1e-2  # so a backend that ignored the direction fails below
    assert float((got.cpu() - want).abs().max() / scale) < 1e-5
