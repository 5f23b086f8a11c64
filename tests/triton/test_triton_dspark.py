"""The DSpark drafter on the Triton backend (its interpreter on a machine without a GPU), at the small
speculation model's shapes (4 layers, an 8-row raw window) with a random drafter: the four Ops it needs
against the reference backend's, its block against the reference's, and greedy speculation with it
against the Triton backend's plain greedy decoding.

Tolerances: both backends run float32 with the same QAT rounding (FP8 nope dims of the KV rows), so
what differs is the order products and sums add in, ~1e-6 relative (measured: under 1e-6 for the
block's logits). A value an fp32 ulp from an FP8 rounding midpoint may round the other way, a whole
grid step, which moves what reads it by up to ~1e-3 relative: the bound of tests/triton/test_model.py,
used here for everything downstream of a KV row; the ops that read no rounded row (the mHC collapse,
the norm) hold 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from speculative.spec_support import ScriptedDrafter, first_gap, speculative

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.backends.triton import load_backend
from dwarfstar.model.config import flash_compress_ratios
from dwarfstar.model.dspark import DSparkArgs
from dwarfstar.model.forward import Rows
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_synthetic_dspark, write_synthetic_model
from dwarfstar.sampling import GREEDY
from dwarfstar.speculative.dspark import DSparkDraft

pytestmark = pytest.mark.whole_model  # tests/triton/conftest.py: no int32 overflow checks

SMALL = TINY.with_(n_layers=4, compress_ratios=flash_compress_ratios(4))
D = DSparkArgs(block_size=5, markov_rank=16, noise_token_id=128799, target_layers=(1, 2, 3), stages=3)
PROMPT = torch.randint(3, 120000, (10,), generator=torch.Generator().manual_seed(11)).tolist()
N_TOKENS = 4  # the interpreter runs each kernel in Python: a few speculation steps
KV_TOL, TOL = 1e-3, 1e-5


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.cpu() - want).abs().max() / want.abs().max()).item()


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    """(Triton backend, reference model, the model file, the drafter's support file)."""
    root = tmp_path_factory.mktemp("triton-dspark")
    write_synthetic_model(root / "small.gguf", SMALL, seed=4)
    write_synthetic_dspark(root / "dspark.gguf", SMALL, D, seed=2)
    model = open_model(root / "small.gguf")
    return load_backend(model, qat=True, max_seq_len=1024), ReferenceModel(model, qat=True), model, root / "dspark.gguf"


@pytest.fixture(scope="module")
def drafters(backends):
    """The drafter on each backend: (Triton's, the reference's)."""
    triton, reference, model, support = backends
    return DSparkDraft(triton, model, support), DSparkDraft(reference, model, support)


def on(draft: DSparkDraft, x: torch.Tensor) -> torch.Tensor:
    """x on the device of the drafter's backend (the reference's is the CPU)."""
    return x.to(getattr(draft.stages.ops, "device", "cpu"))


def at(draft: DSparkDraft, pos: int, rings: list[torch.Tensor]):
    """A state of the drafter's stages at `pos`, each stage's ring holding `rings[il]` (row p mod window)."""
    state = draft.new_state()
    state.pos = pos
    for il, ring in enumerate(rings):
        state.part(il, "raw").copy_(ring)
    return state


def prepared(draft: DSparkDraft, lengths: list[int], states: list):
    """A prepared call of `lengths[i]` rows for each state."""
    stages = draft.stages
    batch = stages.batch([[D.noise_token_id] * n for n in lengths], states)
    batch.prepared = stages.ops.prepare(batch)
    return batch


# -- the ops against the reference's ---------------------------------------------------------------------------
def test_block_attention_reads_the_window_before_the_call_and_the_whole_block(drafters):
    """Two sequences at once: one at position 5 (its window partly filled), one at 19 (wrapped);
    every query reads its own sequence's window and every row of its block, both ways; rings unchanged."""
    gen = torch.Generator().manual_seed(1)
    a, positions, lengths, il = SMALL, [5, 19], [5, 3], 1
    rings = [[torch.randn(a.window, a.head_dim, generator=gen) for _ in range(D.stages)] for _ in positions]
    n = sum(lengths)
    q = torch.randn(n, a.n_heads, a.head_dim, generator=gen)
    kv = torch.randn(n, a.head_dim, generator=gen)
    out = {}
    for name, draft in zip(("triton", "reference"), drafters, strict=True):
        states = [at(draft, p, r) for p, r in zip(positions, rings, strict=True)]
        batch = prepared(draft, lengths, states)
        out[name] = draft.stages.ops.block_attention(il, on(draft, q), on(draft, kv), batch).cpu()
        for state, ring in zip(states, rings, strict=True):
            assert torch.equal(state.part(il, "raw").cpu(), ring[il])
    assert out["triton"].shape == (n, a.n_heads, a.head_dim)
    assert rel_err(out["triton"], out["reference"]) < TOL


@pytest.mark.parametrize("lengths", [[11], [1]], ids=["wrapping-rows", "one-row"])
def test_context_rows_join_the_window_as_the_reference_keeps_them(drafters, lengths):
    """`norm_rope` of the KV rows, then `extend_window`, from position 6: 11 rows wrap the 8-row ring;
    one row is prepared as a decode step on Triton (its KV row left as projected until the window)."""
    gen = torch.Generator().manual_seed(2)
    a, il, pos = SMALL, 2, 6
    rings = [torch.randn(a.window, a.head_dim, generator=gen) for _ in range(D.stages)]
    kv = torch.randn(sum(lengths), a.head_dim, generator=gen)
    windows = []
    for draft in drafters:
        state = at(draft, pos, rings)
        batch, ops = prepared(draft, lengths, [state]), draft.stages.ops
        ops.extend_window(il, ops.norm_rope(il, Rows.KV, on(draft, kv), batch), batch)
        windows.append(state.raw_window(il, pos + sum(lengths)).cpu())
    assert windows[0].shape == windows[1].shape == (min(a.window, pos + sum(lengths)), a.head_dim)
    assert rel_err(*windows) < TOL


def test_collapse_and_output_norm_are_the_head_in_two_steps(drafters):
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(5, SMALL.hc_mult, SMALL.dim, generator=gen)
    (triton, reference), out = drafters, {}
    for name, draft in (("triton", triton), ("reference", reference)):
        batch, ops = prepared(draft, [5], [draft.new_state()]), draft.stages.ops
        collapsed = ops.hc_collapse(on(draft, h), batch)
        out[name] = collapsed, ops.output_norm(collapsed, batch), ops.hc_head(on(draft, h), None, batch)
    for got, want in zip(out["triton"], out["reference"], strict=True):
        assert rel_err(got, want) < TOL
    torch.testing.assert_close(out["triton"][1], out["triton"][2], rtol=TOL, atol=TOL)


# -- the drafter -------------------------------------------------------------------------------------------------
def test_the_block_on_triton_matches_the_reference(drafters):
    """Context of 11 rows (the rings wrap), then one (a decode-shaped call), then a block: its collapsed
    rows and logits, as the reference's; the same greedy drafts."""
    gen = torch.Generator().manual_seed(4)
    triton, reference = drafters
    states = triton.new_state(), reference.new_state()
    for n in (11, 1):
        main_x = torch.randn(n, SMALL.dim, generator=gen)
        for draft, state in zip(drafters, states, strict=True):
            draft.context(main_x, state)
    got, want = (draft.forward.block(4242, state) for draft, state in zip(drafters, states, strict=True))
    assert states[0].pos == 12 and got[1].shape == (D.block_size, SMALL.vocab_size)
    assert rel_err(got[0], want[0]) < KV_TOL and rel_err(got[1], want[1]) < KV_TOL
    assert torch.equal(got[1].cpu().argmax(-1), want[1].argmax(-1))


@pytest.fixture(scope="module")
def plain(backends) -> list[int]:
    """The prompt and N_TOKENS of plain greedy decoding on Triton, each the argmax of the last logits
    (as the session's greedy sampler takes it, without its top-k kernel, slow in the interpreter)."""
    backend, tokens, step = backends[0], list(PROMPT), PROMPT
    state = backend.new_state()
    for _ in range(N_TOKENS):
        step = [int(backend.forward(step, state, all_logits=False)[-1].argmax())]
        tokens += step
    return tokens


# the scripted drafts' run is slow: 25 s more in the interpreter on two cores (`pytest -m slow` runs it)
@pytest.mark.parametrize(
    "scripted", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["dspark-drafts", "scripted-drafts"]
)
def test_greedy_speculation_with_dspark_on_triton_emits_plain_greedy(backends, drafters, plain, scripted):
    """With the random drafter every step rolls back; with scripted drafts (wrong at every odd position)
    a step accepts none, the next one of two. Either way the output is plain greedy's on the same backend."""
    spec = speculative(backends[0], drafters[0], PROMPT, 3)
    if scripted:
        spec.drafter = ScriptedDrafter(plain, wrong_every=2)
    got = list(spec.generate(N_TOKENS, GREEDY))
    assert first_gap(got, plain[len(PROMPT) :]) is None and len(got) == N_TOKENS
    assert spec.stats.steps > 1 and spec.stats.drafted[0] > 0 and spec.stats.rollbacks > 0
    if scripted:
        assert 0 < sum(spec.stats.accepted) < sum(spec.stats.drafted)


def test_tapped_layer_streams_are_each_layers_own(backends):
    """The target layers' streams a DSpark capture taps are each layer's as it was: Triton's fused
    hc_post_pre updates the streams in place later in the pass, so a tap must not alias them."""
    from dwarfstar.speculative.decode import capturing

    triton, reference, _, _ = backends
    taps = []
    for model in (reference, triton):
        with capturing(model, D.target_layers) as captured:
            model.forward(PROMPT, model.new_state())
        taps.append({il: captured[il].cpu() for il in D.target_layers})
    want, got = taps
    for il in D.target_layers:
        assert rel_err(got[il], want[il]) < KV_TOL, (il, rel_err(got[il], want[il]))
    assert not torch.equal(got[D.target_layers[0]], got[D.target_layers[-1]])
