"""The whole tiny model through the Triton backend against the reference backend's logits.

Prefill of a chunk, then single-token decode steps, on `tiny` (float32 weights) and on `tiny-k`
(ds4 layout: Q8_0 projections, F16 mHC/compressor/indexer/router, IQ2_XXS and Q2_K experts). The
prompt is long enough to fill the raw window (8), emit compressed rows in the ratio-4 layers and
make the indexer pick 4 of more visible rows; decode steps cross a ratio-4 compression boundary.
Tolerances are the spec's for QAT rounding on (§9): top-1 identical, mean KL < 1e-6, max relative
error <= 1e-3 (a rounding decision an fp32 ulp away from its boundary may flip).
"""

from __future__ import annotations

import copy

import pytest
import torch

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.backends.triton import load_backend
from dwarfstar.backends.triton.kernels import expert_int8, moe_experts
from dwarfstar.errors import ContextOverflowError, DwarfStarError
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, TINY_K, write_synthetic_model

pytestmark = pytest.mark.whole_model  # tests/triton/conftest.py: no int32 overflow checks

PROMPT = torch.randint(3, 120000, (30,), generator=torch.Generator().manual_seed(7)).tolist()
DECODE_STEPS = 3  # positions 30, 31 (completes ratio-4 window 7), 32


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def mean_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = p_logits.log_softmax(-1)
    return (p.exp() * (p - q_logits.log_softmax(-1))).sum(-1).mean().item()


@pytest.fixture(scope="module", params=["tiny-f32", "tiny-k-ds4"])
def model_file(request, tmp_path_factory):
    args, layout = (TINY, "f32") if request.param == "tiny-f32" else (TINY_K, "ds4")
    path = tmp_path_factory.mktemp("models") / f"{request.param}.gguf"
    write_synthetic_model(path, args, layout=layout, seed=3)
    return open_model(path)


def test_prefill_and_decode_match_reference(model_file, device):
    """Two prefill chunks (the second continues a window and a compressor frontier mid-window,
    and asks for the last logits only), then single-token decode steps."""
    reference = ReferenceModel(model_file, qat=True)
    backend = load_backend(model_file, device=device)
    ref_state, state = reference.new_state(), backend.new_state()
    first, second = PROMPT[:21], PROMPT[21:]
    steps = [(backend.forward(first, state).cpu(), reference.forward(first, ref_state))]
    got = backend.forward(second, state, all_logits=False).cpu()
    want = reference.forward(second, ref_state, all_logits=False)
    assert got.shape == want.shape == (1, model_file.args.vocab_size)
    steps.append((got, want))
    for _ in range(DECODE_STEPS):
        token = [int(want[-1].argmax())]
        want = reference.forward(token, ref_state)
        steps.append((backend.forward(token, state).cpu(), want))
    for i, (g, w) in enumerate(steps):
        assert torch.equal(g.argmax(-1), w.argmax(-1)), f"step {i}"
        assert mean_kl(w, g) < 1e-6, f"step {i}"
        assert rel_err(g, w) < 1e-3, f"step {i}"
    assert state.pos == ref_state.pos == len(PROMPT) + DECODE_STEPS
    assert torch.equal(state.logits.cpu(), steps[-1][0][-1])
    for il in range(model_file.args.n_layers):
        mine, ref = state.host_parts(il), ref_state.host_parts(il)
        assert mine.keys() == ref.keys()
        for name in mine:
            a, b = torch.from_numpy(mine[name]), torch.from_numpy(ref[name])
            if name.endswith("_kv") or name.endswith("_gate"):
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
            else:
                assert rounded_close(a, b), name


def rounded_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """QAT-rounded rows: equal to 1e-3 except the rare element whose rounding flipped by one step."""
    off = (a - b).abs() > 1e-3 * (1 + b.abs())
    return a.shape == b.shape and (off.numel() == 0 or off.float().mean().item() < 0.01)


def test_bad_input_is_refused_before_any_work(model_file, device):
    backend = load_backend(model_file, device=device)
    state = backend.new_state()
    with pytest.raises(DwarfStarError, match="outside the vocabulary"):
        backend.forward([5, model_file.args.vocab_size], state)
    state.pos = model_file.args.max_seq_len
    with pytest.raises(ContextOverflowError):
        backend.forward([5], state)
    assert backend.forward([], backend.new_state()).shape == (0, model_file.args.vocab_size)


def test_batched_decode_steps_match_reference(model_file, device):
    """Decode steps of three sequences in one KV-cache block (the batch-native kernels, QAT on), at
    positions that complete ratio-4 windows in different steps: each sequence's logits as the
    reference computes them, and its state as the chunk kernels leave a twin decoded alone."""
    if model_file.args.dim != 256:
        pytest.skip("the ds4-layout model covers it (compact rows, quantized projections)")
    reference = ReferenceModel(model_file, qat=True)
    backend = load_backend(model_file, device=device)
    prompts = [PROMPT[:21], PROMPT[7:21], PROMPT[3:9]]  # 21, 14 and 6 tokens
    states = [backend.new_state() for _ in prompts]
    ref_states = [reference.new_state() for _ in prompts]
    for prompt, state, ref_state in zip(prompts, states, ref_states, strict=True):
        backend.forward(prompt, state, all_logits=False)
        reference.forward(prompt, ref_state, all_logits=False)
    twins = [copy.deepcopy(s) for s in states]
    assert len({s.block for s in states}) == 1
    for _ in range(3):  # positions 21..23, 14..16, 6..8
        tokens = [[int(s.logits.argmax())] for s in ref_states]
        got = backend.forward_batch(tokens, states)
        for token, ref_state, twin, g in zip(tokens, ref_states, twins, got, strict=True):
            want = reference.forward(token, ref_state, all_logits=False)
            assert torch.equal(g.cpu().argmax(-1), want.argmax(-1))
            assert mean_kl(want, g.cpu()) < 1e-6 and rel_err(g.cpu(), want) < 1e-3
            torch.testing.assert_close(g, backend.forward(token, twin, all_logits=False), rtol=1e-4, atol=1e-4)
    for state, twin in zip(states, twins, strict=True):
        for il in range(model_file.args.n_layers):
            mine, alone = state.host_parts(il), twin.host_parts(il)
            for name in mine:
                a, b = torch.from_numpy(mine[name]), torch.from_numpy(alone[name])
                if name.endswith("_kv") or name.endswith("_gate"):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
                else:
                    assert rounded_close(a, b), (il, name)


def test_fast_decode_experts_take_x_quantized_by_the_routing_launch(monkeypatch, device, tmp_path):
    # the 2-bit experts' int8 form: in a decode step (here the first token) the routing launch
    # quantizes x for them (no launch of its own), to expert_int8's values
    path = tmp_path / "tiny-k.gguf"
    write_synthetic_model(path, TINY_K, layout="ds4", seed=3)
    backend = load_backend(open_model(path), device=device, precision="fast")
    given = []
    decode_ffn = moe_experts.decode_ffn

    def checked(x, *args, xq=None):
        want = expert_int8.reference_rows(x)
        given.append(xq is not None and torch.equal(xq.q, want.q))
        return decode_ffn(x, *args, xq=xq)

    monkeypatch.setattr(moe_experts, "decode_ffn", checked)
    backend.forward(PROMPT[:1], backend.new_state())
    assert len(given) == TINY_K.n_layers and all(given), given
