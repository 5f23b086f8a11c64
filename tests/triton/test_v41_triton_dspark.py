"""DSpark for DeepSeek V4.1 on the Triton kernels (issue 33 item 6; the interpreter on a machine without a
GPU), on `v41-tiny` and its random drafter (`TINY_DSPARK41`): the drafter's block against the reference
backend's drafter on the same captured streams, greedy speculation against Triton's plain greedy
decoding, the stages sharing the target's embedding and output matrix, and what stays refused.

Tolerances: the conformance suite's QAT bounds, as tests/triton/test_v41_triton.py's (both backends run
float32 with the same FP8 roundings of the window rows, so what differs is the order sums add in;
measured: 4.9e-7 of the largest logit over the block)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from dwarfstar.backends.reference.v41.backend import ReferenceModel41
from dwarfstar.backends.triton import load_backend41
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError, ModelFileError
from dwarfstar.model import tensors as tt
from dwarfstar.model.dspark import DSparkArgs
from dwarfstar.model.synthetic import TINY, write_synthetic_dspark
from dwarfstar.model.synthetic_v41 import TINY_DSPARK41, V41_TINY
from dwarfstar.sampling import GREEDY, Sampler
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import Speculator
from dwarfstar.speculative.dspark_v41 import DSparkDraft41
from dwarfstar.speculative.mtp_options import MTP41_REFUSAL, MTPOptions

pytestmark = pytest.mark.whole_model  # tests/triton/conftest.py: no int32 overflow checks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))
from conformance import QAT_KL, QAT_REL, compare_logits  # noqa: E402

CTX, CHUNK = 64, 8
SHORT = [4242, 17, 9001]
N, DRAFTS = 3, 2  # the interpreter runs each kernel in Python (seconds a token): a few short steps


@pytest.fixture(scope="module")
def model(v41_tiny):
    return v41_tiny


@pytest.fixture(scope="module")
def triton41(model, device):
    return load_backend41(model, 1 << 20, CTX, device=device)


@pytest.fixture(scope="module")
def drafts(model, v41_dspark_file, triton41):
    """The drafter on each backend: (Triton's, the reference's)."""
    reference = ReferenceModel41.from_file(model, 1 << 20, CTX)
    return DSparkDraft41(triton41, model, v41_dspark_file), DSparkDraft41(reference, model, v41_dspark_file)


def block(draft: DSparkDraft41, captured: list[torch.Tensor], splits: tuple[int, ...]):
    """(greedy drafts, each row's logits with the Markov bias, the rows the confidence head reads, the
    state) after feeding `captured` in `splits`."""
    state, at = draft.new_state(), 0
    for size in splits:
        draft.feed([c[at : at + size] for c in captured], state)
        at += size
    tokens, rows = draft.propose(4242, state, TINY_DSPARK41.d.block_size, Sampler(GREEDY))
    collapsed, _ = draft.forward.block(4242, state)
    assert state.pos == at  # drafting leaves the context as it was
    return tokens, torch.stack(rows).cpu(), collapsed.cpu(), state


def test_the_drafters_block_on_triton_matches_the_reference(drafts, triton41):
    gen = torch.Generator().manual_seed(3)
    layers = len(TINY_DSPARK41.d.target_layers)
    captured = [torch.randn(11, V41_TINY.hc_mult, V41_TINY.dim, generator=gen) for _ in range(layers)]  # > window
    triton, reference = drafts
    want_tokens, want, want_rows, _ = block(reference, captured, (11,))
    got_tokens, got, got_rows, state = block(triton, captured, (7, 4))  # the rings appended across feeds
    diff, rows = compare_logits(want, got), float((got_rows - want_rows).abs().max() / want_rows.abs().max())
    print(f"[v41 triton dspark] block vs the reference's: {diff}; confidence rows {rows:.3g}")
    assert diff.within(QAT_REL, QAT_KL, near_ties_may_swap=False), diff
    assert rows < QAT_REL and got_tokens == want_tokens
    for rows in state.rings.values():  # each stage keeps the last `window` context rows, on the device
        assert rows.device.type == triton41.device.type and rows.shape == (V41_TINY.window, V41_TINY.head_dim)


def test_the_stages_share_the_targets_embedding_and_output_and_hold_only_their_layers(drafts, triton41):
    ops, target = drafts[0].forward.ops, triton41.transformer.ops
    for name in (tt.EMBED, tt.OUTPUT):
        assert ops.w.matrices[name] is target.w.matrices[name]
    assert not torch.equal(ops.w.vectors[tt.OUTPUT_NORM], target.w.vectors[tt.OUTPUT_NORM])  # the last stage's
    held = {int(name.split(".")[1]) for name in (*ops.w.matrices, *ops.w.vectors) if name.startswith("blk.")}
    assert held == set(drafts[0].forward.layers)


def test_greedy_speculation_on_triton_is_plain_greedy(triton41, drafts):
    plain = Session(triton41, ctx=CTX, chunk=CHUNK)
    plain.prefill(SHORT)
    want = list(plain.generate(N, GREEDY))
    spec = Speculator(Session(triton41, ctx=CTX, chunk=CHUNK), drafts[0], DRAFTS)
    spec.prefill(SHORT)
    assert list(spec.generate(N, GREEDY)) == want
    assert spec.state.tokens == plain.state.tokens and torch.equal(spec.state.logits, plain.state.logits)
    assert spec.stats.drafted[0] >= 1  # it drafted (and rolled back what the target rejected)


def test_what_stays_refused_on_triton(v41_tiny_file, triton41, model, tmp_path):
    v4_support = tmp_path / "v4-dspark.gguf"
    d4 = DSparkArgs(block_size=5, markov_rank=16, noise_token_id=128799, target_layers=(3, 4, 5), stages=3)
    write_synthetic_dspark(v4_support, TINY, d4)
    with pytest.raises(ModelFileError, match=r"a DSpark drafter for DeepSeek V4 \(deepseek4-dspark\)"):
        DSparkDraft41(triton41, model, v4_support)
    with pytest.raises(DwarfStarError, match=re.escape(MTP41_REFUSAL)):
        load_engine(EngineSpec(v41_tiny_file, "triton", ctx=CTX, speculation=MTPOptions(None, 2)))


def test_captured_layer_inputs_are_each_layers_own(model, triton41):
    """A capture records each target layer's input streams as they were there: Triton's fused posts
    update the streams in place later in the pass, so the record must not alias them (it did: every
    layer after the last Engram layer then held the final streams, and the drafter read those)."""
    from dwarfstar.model.forward_v41 import Capture41

    layers = tuple(range(V41_TINY.n_layers - 3, V41_TINY.n_layers))
    reference = ReferenceModel41.from_file(model, 1 << 20, CTX)
    records = []
    for backend in (reference, triton41):
        state, capture = backend.new_state(), Capture41(layers)
        backend.forward([5, 6, 7], state, False, None, capture)
        backend.forward([8], state, False, None, capture)
        records.append([[h.cpu() for h in call] for call in capture.calls])
    for want_call, got_call in zip(*records, strict=True):
        for want, got in zip(want_call, got_call, strict=True):
            assert rel_err(got, want) < QAT_REL, (rel_err(got, want), len(want))
        assert not torch.equal(got_call[0], got_call[-1])


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())
