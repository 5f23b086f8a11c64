"""DeepSeek V4.1 on the MLX backend (`backends/mlx/v41`) against the torch reference (`ReferenceModel41`)
on `v41-tiny`, and the MLX backend as the engine, the session layer and `dwarfstar run` drive it.

Tolerances, and why (measured on this machine's CPU, mlx 0.32):
* Fake-quant roundings off (both backends' FP8/FP4 roundings patched to the identity): nothing left is
  discontinuous, so only float32 summation order differs. Measured: max |diff| 1.8e-5 (3.4e-6 of the
  largest logit) over every prefix of the prompt, 2.4e-6 over the decode steps, mean KL 2e-12, the same
  top-1 everywhere. Bound: 1e-5 relative, every top-1 equal.
* Roundings on (the real model): the roundings agree bit for bit on equal inputs (test_v41_mlx_steps.py),
  but a value within float32 noise of a rounding midpoint rounds the other way, and on this tiny random
  model a flipped FP4 row or top-k pick moves what follows by a lot. Measured: one-call prefill max |diff|
  0.032 (6.8e-3 relative), mean KL 2.5e-5; 8 decode steps 0.35 (0.067 relative), mean KL 4.3e-4, no
  top-1 change away from a near-tie. For scale, the reference against itself with its embedding scaled
  by 1 + 1e-5 noise (the size of the MLX/reference difference in the early layers' streams) differs by
  mean KL 2.4e-3 to 7.8e-3 and 0.2 to 0.32 relative (3 seeds). Bounds: mean KL < 2e-3, 0.25 relative,
  no top-1 change away from near-ties (reference top-2 gap < 1e-2).
"""

from __future__ import annotations

import io

import pytest
import torch
from test_cli_front import cli

mx = pytest.importorskip("mlx.core", reason="mlx does not import (pip install mlx[cpu] on Linux)")

import dwarfstar.backends.mlx.ops as mlx_ops  # noqa: E402
import dwarfstar.backends.reference.ops as reference_ops  # noqa: E402
from dwarfstar.backends.mlx import metal_available  # noqa: E402
from dwarfstar.backends.mlx.parity import compare_logits  # noqa: E402
from dwarfstar.backends.mlx.v41.backend import MLXModel41, MLXState41  # noqa: E402
from dwarfstar.backends.reference.v41.backend import ReferenceModel41  # noqa: E402
from dwarfstar.cli import _register_commands  # noqa: E402
from dwarfstar.engine.load import load_engine  # noqa: E402
from dwarfstar.engine.spec import EngineSpec  # noqa: E402
from dwarfstar.kvcache.payloads import read_payload, write_payload  # noqa: E402
from dwarfstar.model.image_spans import ImageSpan, content_ids  # noqa: E402
from dwarfstar.sampling import SamplingParams  # noqa: E402
from dwarfstar.session.session import Session  # noqa: E402

_register_commands()

# 41 tokens on v41-tiny (window 8, ratio-2 and ratio-1 kv sources, top-4, candidate blocks of 2): the
# window, both compressors, the candidate pool and the top-k all bite; odd, so a ratio-2 group is open
PROMPT = [(7919 * i + 101) % 120000 for i in range(41)]
DECODE = [(104729 * i + 7) % 120000 for i in range(8)]
EXACT_REL = 1e-5
ROUNDED_KL, ROUNDED_REL = 2e-3, 0.25


@pytest.fixture(scope="module")
def model(v41_tiny):
    return v41_tiny


@pytest.fixture(scope="module")
def mlx_model(model) -> MLXModel41:
    return MLXModel41.from_file(model, 1 << 20)


@pytest.fixture
def no_rounding(monkeypatch):
    """Both backends' FP8/FP4 fake-quant roundings as the identity."""
    for module in (reference_ops, mlx_ops):
        monkeypatch.setattr(module, "fp8_round", lambda x, *args, **kwargs: x)
        monkeypatch.setattr(module, "fp4_round", lambda x, *args, **kwargs: x)


def prefill_and_decode(backend, all_positions: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits after the prompt: every prefix's, or the one call's last; after each decode step)."""
    state = backend.new_state()
    prefill = backend.forward(PROMPT, state, all_logits=all_positions)
    return prefill, torch.cat([backend.forward([t], state, all_logits=False) for t in DECODE])


def test_without_the_roundings_mlx_equals_the_reference_to_float32_order(model, no_rounding):
    reference, mlx = ReferenceModel41.from_file(model, 1 << 20), MLXModel41.from_file(model, 1 << 20)
    for want, got in zip(prefill_and_decode(reference, True), prefill_and_decode(mlx, True), strict=True):
        diff = compare_logits(want, got)
        print(f"[v41 mlx, no rounding] {want.shape[0]} positions: {diff}")
        assert diff.max_rel < EXACT_REL and diff.top1_agreement == 1.0, diff


def test_prefill_and_decode_logits_match_the_reference(model, mlx_model):
    reference = ReferenceModel41.from_file(model, 1 << 20)
    for want, got in zip(prefill_and_decode(reference, False), prefill_and_decode(mlx_model, False), strict=True):
        diff = compare_logits(want, got)
        print(f"[v41 mlx] {want.shape[0]} positions: {diff}")
        assert diff.mean_kl < ROUNDED_KL and diff.max_rel < ROUNDED_REL and diff.top1_mismatches == 0, diff


def test_a_chunked_prefill_equals_a_whole_one(mlx_model):
    whole = mlx_model.forward(PROMPT, mlx_model.new_state(), all_logits=False)
    for chunks in ([16, 1, 17, 7], [8, 8, 8, 8, 8, 1]):
        state, at = mlx_model.new_state(), 0
        for size in chunks:
            got = mlx_model.forward(PROMPT[at : at + size], state, all_logits=False)
            at += size
        assert state.pos == len(PROMPT)
        if metal_available():  # Metal's products may sum a row otherwise at another row count
            diff = compare_logits(whole, got)
            assert diff.mean_kl < ROUNDED_KL and diff.max_rel < ROUNDED_REL and diff.top1_mismatches == 0, diff
        else:  # measured: bit-identical on MLX's CPU path
            assert torch.equal(got, whole), chunks


def test_a_batch_of_two_sequences_at_different_positions_equals_each_alone(mlx_model):
    first, second = mlx_model.new_state(), mlx_model.new_state()
    mlx_model.forward(PROMPT[:20], first, all_logits=False)
    mlx_model.forward(PROMPT[20:23], second, all_logits=False)
    alone_first, alone_second = first.snapshot(), second.snapshot()
    a, b = mlx_model.forward_batch([DECODE[:1], PROMPT[23:30]], [first, second], all_logits=False)
    assert (first.pos, second.pos) == (21, 10)
    assert torch.equal(a, mlx_model.forward(DECODE[:1], alone_first, all_logits=False))
    assert torch.equal(b, mlx_model.forward(PROMPT[23:30], alone_second, all_logits=False))
    assert torch.equal(first.logits, a[0]) and torch.equal(second.logits, b[0])


def test_snapshots_restore_and_stay_usable(mlx_model):
    state = mlx_model.new_state()
    mlx_model.forward(PROMPT[:9], state, all_logits=False)
    snap, before = state.snapshot(), state.nbytes()
    again = mlx_model.forward(PROMPT[9:], state, all_logits=False)
    assert state.nbytes() > before
    state.restore(snap)
    assert state.pos == 9 and state.nbytes() == before
    assert torch.equal(mlx_model.forward(PROMPT[9:], state, all_logits=False), again)
    state.restore(snap)
    assert torch.equal(mlx_model.forward(PROMPT[9:], state, all_logits=False), again)


def test_the_engine_loads_v41_on_mlx_and_the_session_generates(v41_tiny_file):
    engine = load_engine(EngineSpec(v41_tiny_file, "mlx", ctx=256, engram_cache=1))
    assert isinstance(engine.backend, MLXModel41) and engine.backend.max_seq_len == 256
    session = Session(engine.backend, ctx=256, chunk=8)
    session.prefill(PROMPT[:23])
    got = list(session.generate(4, SamplingParams(temperature=0.0)))
    state = engine.backend.new_state()  # the same greedy tokens, one forward call at a time
    logits, want = engine.backend.forward(PROMPT[:23], state, all_logits=False)[0], []
    for _ in range(4):
        want.append(int(logits.argmax()))
        logits = engine.backend.forward(want[-1:], state, all_logits=False)[0]
    assert got == want


def test_cli_run_answers_on_v41_with_mlx(monkeypatch, capsys, v41_tiny_file):
    args = ["run", "-m", str(v41_tiny_file), "-p", "hello there", "-n", "4", "--backend", "mlx", "--temp", "0"]
    code, out, err = cli(monkeypatch, capsys, *args, "--no-think", "--engram-cache", "8")
    assert code == 0, err
    assert out.strip() and "decode 4 tok" in err


@pytest.mark.slow
def test_fused_primitives_match_eager(model):
    """The mx.compile'd primitives (the default on Metal) against eager ops, here on the CPU (slow only the
    first time on a machine: MLX compiles each fused graph with the C++ compiler). Measured: bit-identical."""
    eager, fused = MLXModel41.from_file(model, 0, fuse=False), MLXModel41.from_file(model, 0, fuse=True)
    states = eager.new_state(), fused.new_state()
    for chunk in (PROMPT[:40], PROMPT[40:41]):
        a, b = (m.forward(chunk, s, all_logits=False) for m, s in zip((eager, fused), states, strict=True))
        assert compare_logits(a, b).max_rel < EXACT_REL


def test_an_image_block_matches_the_reference(model, mlx_model):
    """A prompt with an image block (its rows in place of the embedding, the Engram gate shut, the image
    router bias): the roundings off, MLX equals the reference to float32 order."""
    ids = content_ids(b"\x02" * 32, 5, model.args.vocab_size)
    tokens, rows = [*PROMPT[:6], *ids, *PROMPT[6:20]], torch.randn(5, model.args.dim)
    reference = ReferenceModel41.from_file(model, 1 << 20)
    want = reference.forward(tokens, reference.new_state(), all_logits=False, images=[ImageSpan(6, rows)])
    got = mlx_model.forward(tokens, mlx_model.new_state(), all_logits=False, images=[ImageSpan(6, rows)])
    diff = compare_logits(want, got)
    assert diff.mean_kl < ROUNDED_KL and diff.max_rel < ROUNDED_REL and diff.top1_mismatches == 0, diff


def test_a_payload_round_trip_decodes_as_the_uninterrupted_sequence(mlx_model):
    """A state saved from MLX's arrays and read back into them (the DS41 payload) decodes exactly as the
    sequence that never left memory."""
    state = mlx_model.new_state()
    mlx_model.forward(PROMPT[:11], state, all_logits=False)
    out = io.BytesIO()
    write_payload(out, state, mlx_model.args, 256, 8)
    want = mlx_model.forward([5], state, all_logits=False)
    back = read_payload(out.getvalue(), mlx_model.args, 256, 8, mlx_model.new_state)
    assert isinstance(back, MLXState41) and back.tokens == PROMPT[:11]
    assert torch.equal(mlx_model.forward([5], back, all_logits=False), want)
