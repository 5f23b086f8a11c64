"""DSpark for DeepSeek V4.1 on the MLX backend (issue 33 item 6), on `v41-tiny` and its random drafter
(`TINY_DSPARK41`): the drafter's block against the reference backend's drafter on the same captured
streams, greedy speculation against MLX's plain greedy decoding, the stages sharing the target's
embedding and output matrix, and what stays refused.

Tolerances, as tests/v41/test_v41_mlx.py's: with the FP8/FP4 roundings patched to the identity only float32
summation order differs (bound 1e-5 relative, every top-1 equal); with them, a value within float32 noise
of a rounding midpoint may round the other way (bounds: mean KL < 2e-3, 0.25 relative, no top-1 change
away from near-ties). Measured on this block: 5.4e-7 relative with the roundings, the same drafts."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core", reason="mlx does not import (pip install mlx[cpu] on Linux)")

import dwarfstar.backends.mlx.ops as mlx_ops  # noqa: E402
import dwarfstar.backends.reference.ops as reference_ops  # noqa: E402
from dwarfstar.backends.mlx.parity import compare_logits  # noqa: E402
from dwarfstar.backends.mlx.v41.backend import MLXModel41  # noqa: E402
from dwarfstar.backends.reference.v41.backend import ReferenceModel41  # noqa: E402
from dwarfstar.engine.load import load_engine  # noqa: E402
from dwarfstar.engine.spec import EngineSpec  # noqa: E402
from dwarfstar.errors import DwarfStarError, ModelFileError  # noqa: E402
from dwarfstar.model.dspark import DSparkArgs  # noqa: E402
from dwarfstar.model.synthetic import TINY, write_synthetic_dspark  # noqa: E402
from dwarfstar.model.synthetic_v41 import TINY_DSPARK41, V41_TINY  # noqa: E402
from dwarfstar.sampling import GREEDY, Sampler  # noqa: E402
from dwarfstar.session.session import Session  # noqa: E402
from dwarfstar.speculative.decode import Speculator  # noqa: E402
from dwarfstar.speculative.dspark_v41 import DSparkDraft41  # noqa: E402
from dwarfstar.speculative.mtp_options import MTP41_REFUSAL, MTPOptions  # noqa: E402

CTX, CHUNK = 256, 8
PROMPT = [(7919 * i + 101) % 120000 for i in range(13)]  # odd: ends inside a ratio-2 group, past the window
SHORT = [4242, 17, 9001]  # generation crosses the window (8) and ratio-2 groups from here
N = 12
EXACT_REL = 1e-5
ROUNDED_KL, ROUNDED_REL = 2e-3, 0.25


@pytest.fixture(scope="module")
def model(v41_tiny):
    return v41_tiny


@pytest.fixture(scope="module")
def mlx41(model):
    return MLXModel41.from_file(model, 1 << 20, CTX)


@pytest.fixture(scope="module")
def drafts(model, v41_dspark_file, mlx41):
    """The drafter on each backend: (MLX's, the reference's)."""
    reference = ReferenceModel41.from_file(model, 1 << 20, CTX)
    return DSparkDraft41(mlx41, model, v41_dspark_file), DSparkDraft41(reference, model, v41_dspark_file)


@pytest.fixture
def no_rounding(monkeypatch):
    """Both backends' FP8/FP4 fake-quant roundings as the identity."""
    for module in (reference_ops, mlx_ops):
        monkeypatch.setattr(module, "fp8_round", lambda x, *args, **kwargs: x)
        monkeypatch.setattr(module, "fp4_round", lambda x, *args, **kwargs: x)


def block(draft: DSparkDraft41, captured: list[torch.Tensor], splits: tuple[int, ...]):
    """(greedy drafts, each row's logits with the Markov bias, the rows the confidence head reads, the
    state) after feeding `captured` in `splits`."""
    state, at = draft.new_state(), 0
    for size in splits:
        draft.feed([c[at : at + size] for c in captured], state)
        at += size
    tokens, rows = draft.propose(4242, state, TINY_DSPARK41.d.block_size, Sampler(GREEDY))
    collapsed, _ = draft.forward.block(4242, state)  # the reference's a tensor, MLX's an array
    assert state.pos == at  # drafting leaves the context as it was
    host = collapsed if isinstance(collapsed, torch.Tensor) else torch.from_numpy(np.array(collapsed))
    return tokens, torch.stack(rows), host, state


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def captured_streams(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    layers = len(TINY_DSPARK41.d.target_layers)
    return [torch.randn(11, V41_TINY.hc_mult, V41_TINY.dim, generator=gen) for _ in range(layers)]  # > window


def test_the_drafters_block_on_mlx_matches_the_reference(drafts):
    captured = captured_streams(3)
    want_tokens, want, want_rows, _ = block(drafts[1], captured, (11,))
    got_tokens, got, got_rows, state = block(drafts[0], captured, (7, 4))  # the rings appended across feeds
    diff, rows = compare_logits(want, got), rel_err(got_rows, want_rows)
    print(f"[v41 mlx dspark] block vs the reference's: {diff}; confidence rows {rows:.3g}")
    assert diff.mean_kl < ROUNDED_KL and diff.max_rel < ROUNDED_REL and diff.top1_mismatches == 0, diff
    assert rows < ROUNDED_REL and got_tokens == want_tokens
    for rows in state.rings.values():  # each stage keeps the last `window` context rows, as MLX arrays
        assert isinstance(rows, mx.array) and rows.shape == (V41_TINY.window, V41_TINY.head_dim)


def test_without_the_roundings_the_block_equals_the_references_to_float32_order(drafts, no_rounding):
    captured = captured_streams(5)
    want_tokens, want, want_rows, _ = block(drafts[1], captured, (11,))
    got_tokens, got, got_rows, _ = block(drafts[0], captured, (11,))
    diff, rows = compare_logits(want, got), rel_err(got_rows, want_rows)
    print(f"[v41 mlx dspark, no rounding] block vs the reference's: {diff}; confidence rows {rows:.3g}")
    assert diff.max_rel < EXACT_REL and diff.top1_agreement == 1.0, diff
    assert rows < EXACT_REL and got_tokens == want_tokens


def test_the_stages_share_the_targets_embedding_and_output_and_hold_only_their_layers(drafts, mlx41):
    ops, target = drafts[0].forward.ops, mlx41.transformer.ops
    assert ops.embedding is target.embedding and ops.output is target.output
    assert set(ops.layers) == set(drafts[0].forward.layers)


@pytest.mark.parametrize("prompt", [PROMPT, SHORT], ids=["past-window", "short"])
def test_greedy_speculation_on_mlx_is_plain_greedy(mlx41, drafts, prompt):
    plain = Session(mlx41, ctx=CTX, chunk=CHUNK)
    plain.prefill(prompt)
    want = list(plain.generate(N, GREEDY))
    spec = Speculator(Session(mlx41, ctx=CTX, chunk=CHUNK), drafts[0], TINY_DSPARK41.d.block_size)
    spec.prefill(prompt)
    assert list(spec.generate(N, GREEDY)) == want
    assert spec.state.tokens == plain.state.tokens and torch.equal(spec.state.logits, plain.state.logits)
    assert spec.stats.steps > 1 and spec.stats.drafted[0] > 1  # it drafted, and rolled back what was wrong


def test_what_stays_refused_on_mlx(v41_tiny_file, mlx41, model, tmp_path):
    v4_support = tmp_path / "v4-dspark.gguf"
    d4 = DSparkArgs(block_size=5, markov_rank=16, noise_token_id=128799, target_layers=(3, 4, 5), stages=3)
    write_synthetic_dspark(v4_support, TINY, d4)
    with pytest.raises(ModelFileError, match=r"a DSpark drafter for DeepSeek V4 \(deepseek4-dspark\)"):
        DSparkDraft41(mlx41, model, v4_support)
    with pytest.raises(DwarfStarError, match=re.escape(MTP41_REFUSAL)):
        load_engine(EngineSpec(v41_tiny_file, "mlx", ctx=CTX, speculation=MTPOptions(None, 2)))
