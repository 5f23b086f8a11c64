"""DSpark for DeepSeek V4.1 (issue 33 item 6) on `v41-tiny` and its random drafter (`TINY_DSPARK41`): greedy
output with the drafter is plain greedy's (the drafter's own drafts, and scripted ones that steps accept
all, some or none of); the capture point records each target layer's input; the drafter's block equals a
restatement written here from V4.1's reference `DSparkBlock` / `DSparkAttention` / `forward_spec`."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dwarfstar.backends.reference.v41 import mhc, window
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.gguf.reader import GGUFFile
from dwarfstar.model.forward_v41 import Capture41
from dwarfstar.model.synthetic_v41 import TINY_DSPARK41, V41_TINY
from dwarfstar.sampling import GREEDY, Sampler
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import Drafter, Speculator, load_speculation
from dwarfstar.speculative.mtp_options import DSparkOptions

CTX, CHUNK = 256, 8
PROMPT = [(7919 * i + 101) % 120000 for i in range(13)]  # odd: ends inside a ratio-2 group, past the window
SHORT = [4242, 17, 9001]  # generation crosses the window (8) and ratio-2 groups from here
N = 12


@pytest.fixture(scope="module")
def engine(v41_tiny_file):
    return load_engine(EngineSpec(v41_tiny_file, "reference", ctx=CTX))


@pytest.fixture(scope="module")
def draft(engine, v41_dspark_file):
    return load_speculation(DSparkOptions(v41_dspark_file), engine.backend, engine.model).draft


def plain(engine, prompt: list[int]) -> Session:
    session = Session(engine.backend, ctx=CTX, chunk=CHUNK)
    session.prefill(prompt)
    list(session.generate(N, GREEDY))
    return session


class Scripted(Drafter):
    """Proposes the known greedy continuation `truth`, wrong at the positions p with p % 3 == 1."""

    def __init__(self, truth: list[int]) -> None:
        self.truth = truth

    def propose(self, spec, n, sampler):
        first = spec.state.pos + 1  # the pending token sits at state.pos
        return [self.truth[p] + (p % 3 == 1) if p < len(self.truth) else 3 for p in range(first, first + n)], None


@pytest.mark.parametrize("prompt", [PROMPT, SHORT], ids=["past-window", "short"])
def test_greedy_with_the_drafter_is_plain_greedy(engine, draft, prompt):
    want = plain(engine, prompt)
    spec = Speculator(Session(engine.backend, ctx=CTX, chunk=CHUNK), draft, TINY_DSPARK41.d.block_size)
    spec.prefill(prompt)
    got = list(spec.generate(N, GREEDY))
    print(f"[v41 dspark] random drafter: acceptance by position {spec.stats.acceptance()}, {spec.stats.steps} steps")
    assert got == want.tokens[len(prompt) :]
    assert spec.state.tokens == want.tokens and torch.equal(spec.state.logits, want.state.logits)
    assert spec.stats.steps > 1 and spec.stats.drafted[0] > 1  # it drafted, and rolled back what was wrong


def test_steps_that_accept_all_some_or_none_keep_plain_greedy(engine, draft):
    want = plain(engine, SHORT)
    spec = Speculator(Session(engine.backend, ctx=CTX, chunk=CHUNK), draft, 4, drafter=Scripted(want.tokens))
    spec.prefill(SHORT)
    assert list(spec.generate(N, GREEDY)) == want.tokens[len(SHORT) :]
    assert spec.state.tokens == want.tokens and torch.equal(spec.state.logits, want.state.logits)
    assert spec.stats.rollbacks and sum(spec.stats.accepted) > spec.stats.steps  # partly accepted steps
    # the drafter followed every committed position: its context is the target's
    assert spec.track.fed_to + spec.track.held == spec.state.pos


def test_the_capture_records_each_layers_input_and_changes_nothing(engine):
    model = engine.backend
    ops, seen = model.transformer.ops, {}
    mix = ops.mix

    def watching(il, site, h):
        if site == "attn":
            seen[il] = h.clone()
        return mix(il, site, h)

    layers = (1, 6, 11)  # an Engram layer (its input is after the Engram), a kv source, the last
    capture = Capture41(layers)
    ops.mix = watching
    try:
        got = model.forward(PROMPT, model.new_state(), all_logits=False, capture=capture)
    finally:
        del ops.mix
    assert torch.equal(got, model.forward(PROMPT, model.new_state(), all_logits=False))
    assert len(capture.calls) == 1
    for il, h in zip(layers, capture.calls[0], strict=True):
        assert torch.equal(h, seen[il])


# -- the drafter against the reference's text -------------------------------------------------------------------
def restate(support, model, captured: list[torch.Tensor], anchor: int) -> torch.Tensor:
    """The block's logits with the Markov bias (greedy, as `forward_head`), from the target layers' inputs
    [N, n, dim]: written from V4.1's reference DSpark code, plain torch but the tested window rows and mHC
    mix."""
    a, d, eps = V41_TINY, TINY_DSPARK41.d, V41_TINY.norm_eps
    sup = GGUFFile(support)
    hc = mhc.HcConfig(a.hc_sinkhorn_iters, a.hc_eps, eps)
    inv = 1.0 / (a.rope_theta ** (torch.arange(0, a.rope_dim, 2, dtype=torch.float64) / a.rope_dim))  # no YaRN

    def rms(x, w):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w

    def rotate(x, pos, sign=1.0):
        ang = pos[:, None].double() * inv[None, :]
        cos, sin = ang.cos().float()[:, None, :], sign * ang.sin().float()[:, None, :]
        r = x[..., -a.rope_dim :]
        turned = torch.stack((r[..., 0::2] * cos - r[..., 1::2] * sin, r[..., 0::2] * sin + r[..., 1::2] * cos), -1)
        return torch.cat((x[..., : -a.rope_dim], turned.flatten(-2)), -1)

    def post(h, out, p, comb):
        return p[..., None] * out[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, h)

    def collapse(h, p):
        return (p[..., None] * h).sum(1)

    main = torch.cat([c.mean(1) for c in captured], -1)
    main_x = rms(main @ sup.tensor("mtp.0.main_proj.weight").T, sup.tensor("mtp.0.main_norm.weight"))
    n_ctx, size = main_x.shape[0], d.block_size
    pos_ctx, pos = torch.arange(n_ctx), torch.arange(n_ctx, n_ctx + size)
    ids = torch.tensor([anchor] + [d.noise_token_id] * (size - 1))
    h = model.gguf.tensor("token_embd.weight")[ids][:, None, :].repeat(1, a.hc_mult, 1)
    pre = F.one_hot(torch.zeros(size, dtype=torch.long), a.hc_mult).float()
    for k in range(d.stages):

        def w(leaf: str, k=k) -> torch.Tensor:
            return sup.tensor(f"mtp.{k}.{leaf}")

        kv_w, kv_norm = w("attn_kv.weight"), w("attn_kv_a_norm.weight")
        ring = window.window_rows(main_x @ kv_w.T, kv_norm, pos_ctx, inv, eps)[-a.window :]  # the window ring
        a_pre, a_post, a_comb = mhc.mix(
            h, mhc.HcWeights(*(w(f"hc_attn_{p}.weight") for p in ("fn", "scale", "base"))), hc
        )
        x = rms(collapse(h, pre), w("attn_norm.weight"))
        qr = rms(x @ w("attn_q_a.weight").T, w("attn_q_a_norm.weight"))
        q = rotate((qr @ w("attn_q_b.weight").T).view(size, a.n_heads, a.head_dim), pos)
        keys = torch.cat((ring, window.window_rows(x @ kv_w.T, kv_norm, pos, inv, eps)))  # window + the whole block
        scores = torch.einsum("thd,nd->thn", q, keys) / math.sqrt(a.head_dim)
        sink = w("attn_sinks.weight")[None, :, None].expand(size, -1, 1)
        probs = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
        o = rotate(torch.einsum("thn,nd->thd", probs, keys), pos, sign=-1.0)
        wo_a = w("attn_output_a.weight").view(a.o_groups, a.o_lora_rank, -1)
        o = torch.einsum("tgi,gri->tgr", o.reshape(size, a.o_groups, -1), wo_a).flatten(1)
        h = post(h, o @ w("attn_output_b.weight").T, a_post, a_comb)
        f_pre, f_post, f_comb = mhc.mix(
            h, mhc.HcWeights(*(w(f"hc_ffn_{p}.weight") for p in ("fn", "scale", "base"))), hc
        )
        x = rms(collapse(h, a_pre), w("ffn_norm.weight"))
        s = F.softplus(x @ w("ffn_gate_inp.weight").T).sqrt()
        chosen = (s + w("exp_probs_b.bias")).topk(TINY_DSPARK41.top_k, -1).indices  # drafts are text: no VL bias
        gates = s.gather(1, chosen)
        gates = gates / (gates.sum(-1, keepdim=True) + 1e-20) * a.route_scale

        def swiglu(v, g, u):
            return F.silu((v @ g.T).clamp(max=a.swiglu_limit)) * (v @ u.T).clamp(-a.swiglu_limit, a.swiglu_limit)

        y = swiglu(x, w("ffn_gate_shexp.weight"), w("ffn_up_shexp.weight")) @ w("ffn_down_shexp.weight").T
        g_w, u_w, d_w = (w(f"ffn_{p}_exps.weight") for p in ("gate", "up", "down"))
        for i in range(size):
            for e, g in zip(chosen[i].tolist(), gates[i], strict=True):
                y[i] += ((g * swiglu(x[i : i + 1], g_w[e], u_w[e])) @ d_w[e].T)[0]
        h = post(h, y, f_post, f_comb)
        pre = f_pre
    last = f"mtp.{d.stages - 1}."
    logits = rms(collapse(h, pre), sup.tensor(last + "norm.weight")) @ model.gguf.tensor("output.weight").T
    w1, w2 = sup.tensor(last + "markov_head.markov_w1.weight"), sup.tensor(last + "markov_head.markov_w2.weight")
    previous, rows = anchor, []
    for i in range(size):
        rows.append(logits[i] + w2 @ w1[previous])
        previous = int(rows[-1].argmax())
    sup.close()
    return torch.stack(rows)


def test_the_drafters_block_equals_the_reference_restatement(engine, draft, v41_dspark_file):
    gen = torch.Generator().manual_seed(3)
    layers = len(TINY_DSPARK41.d.target_layers)
    captured = [torch.randn(11, V41_TINY.hc_mult, V41_TINY.dim, generator=gen) for _ in range(layers)]  # > window
    state = draft.new_state()
    draft.feed(captured, state)
    anchor = 4242
    drafts, rows = draft.propose(anchor, state, TINY_DSPARK41.d.block_size, Sampler(GREEDY))
    want = restate(v41_dspark_file, engine.model, captured, anchor)
    err = float((torch.stack(rows) - want).abs().max() / want.abs().max())
    print(f"[v41 dspark] block vs restatement: max error {err:.3g} (relative to max |logit|)")
    assert err < 1e-4
    assert drafts == want.argmax(-1).tolist()
    assert state.pos == 11  # drafting left the context as it was
