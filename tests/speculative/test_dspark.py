"""The DSpark drafter (dwarfstar/model/dspark.py, dwarfstar/speculative/dspark.py) against an independent
numpy implementation written from the public descriptions (dwarfstar/speculative/NOTES.md), on a random
drafter for the tiny model; and the support file's bad inputs."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from conftest import PROMPT, SMALL
from spec_support import ScriptedDrafter, first_gap, plain_greedy, speculative
from test_rejection_sampling import SIGNIFICANCE, chi_square_p, first_two_tokens, sampled_pairs

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.errors import DwarfStarError, ModelFileError
from dwarfstar.model.dspark import DSparkArgs
from dwarfstar.model.loader import open_model
from dwarfstar.model.synthetic import TINY, write_synthetic_dspark
from dwarfstar.sampling import GREEDY, Sampler
from dwarfstar.speculative.dspark import DSparkDraft

D = DSparkArgs(block_size=5, markov_rank=16, noise_token_id=128799, target_layers=(3, 4, 5), stages=3)
CONTEXT = list(range(1000, 1020))  # 20 positions: the stages' 8-row windows wrap


@pytest.fixture(scope="module")
def files(tiny_model_file, tmp_path_factory):
    support = tmp_path_factory.mktemp("dspark") / "tiny-dspark.gguf"
    write_synthetic_dspark(support, TINY, D, seed=1)
    return tiny_model_file(0), support


@pytest.fixture(scope="module")
def drafted(files):
    """The drafter's block after CONTEXT, and the target streams it was fed."""
    model_path, support = files
    model = open_model(model_path)
    target = ReferenceModel(model, qat=False)
    draft = DSparkDraft(target, model, support)
    captured = {}
    target.taps.append(lambda il, h, batch: captured.__setitem__(il, h.clone()))
    target.forward(CONTEXT, target.new_state())
    streams = [captured[il] for il in D.target_layers]
    state = draft.new_state()
    draft.feed(streams, state)
    anchor = 4242
    collapsed, logits = draft.forward.block(anchor, state)
    drafts, rows = draft.propose(anchor, state, D.block_size, Sampler(GREEDY))
    return [s.numpy() for s in streams], anchor, collapsed.numpy(), logits.numpy(), drafts, rows, draft, state


# -- the independent implementation ---------------------------------------------------------------------------
def tensors(path) -> dict[str, np.ndarray]:
    return {t.name: np.asarray(t.data, dtype=np.float64) for t in gguf.GGUFReader(path).tensors}


def rms(x, w=None):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + TINY.norm_eps)
    return y if w is None else y * w


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def rope(x, positions, inverse=False):
    """Rotate the pairs (2i, 2i+1) of the last rope_dim dims by position * theta^(-2i/rope_dim)."""
    r = TINY.rope_dim
    angles = positions[:, None] * TINY.rope_theta ** (-np.arange(0, r, 2) / r)
    cos, sin = np.cos(angles), np.sin(angles) * (-1 if inverse else 1)
    cos, sin = (a.reshape(a.shape[0], *([1] * (x.ndim - 2)), a.shape[1]) for a in (cos, sin))
    out = x.copy()
    a, b = x[..., -r::2], x[..., -r + 1 :: 2]
    out[..., -r::2], out[..., -r + 1 :: 2] = a * cos - b * sin, a * sin + b * cos
    return out


def hc_mix(h, fn, scale, base):
    """(sublayer input, post, comb) of the streams h [T, n, D]."""
    t, n, _ = h.shape
    flat = h.reshape(t, -1)
    mix = flat @ fn.T / np.sqrt((flat * flat).mean(-1, keepdims=True) + TINY.norm_eps)
    pre = sigmoid(mix[:, :n] * scale[0] + base[:n]) + TINY.hc_eps
    post = 2 * sigmoid(mix[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    logits = mix[:, 2 * n :].reshape(t, n, n) * scale[2] + base[2 * n :].reshape(n, n)
    comb = np.exp(logits - logits.max(-1, keepdims=True))
    comb = comb / comb.sum(-1, keepdims=True) + TINY.hc_eps
    comb = comb / (comb.sum(-2, keepdims=True) + TINY.hc_eps)
    for _ in range(TINY.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + TINY.hc_eps)
        comb = comb / (comb.sum(-2, keepdims=True) + TINY.hc_eps)
    return (pre[..., None] * h).sum(1), post, comb


def hc_post(out, h, post, comb):
    return post[..., None] * out[:, None, :] + np.swapaxes(comb, 1, 2) @ h


def swiglu(x, gate, up, down, scale=1.0):
    g, u = x @ gate.T, x @ up.T
    g = np.minimum(g, TINY.swiglu_limit)
    return (g * sigmoid(g) * np.clip(u, -TINY.swiglu_limit, TINY.swiglu_limit) * scale) @ down.T


def stage(w, k, h, ring, positions):
    """Stage k over the block's streams h [B, n, D], attending to its ring rows and the whole block."""
    p = f"mtp.{k}."
    x, post, comb = hc_mix(h, w[p + "hc_attn_fn.weight"], w[p + "hc_attn_scale.weight"], w[p + "hc_attn_base.weight"])
    x = rms(x, w[p + "attn_norm.weight"])
    q = rms(x @ w[p + "attn_q_a.weight"].T, w[p + "attn_q_a_norm.weight"]) @ w[p + "attn_q_b.weight"].T
    q = rope(rms(q.reshape(len(x), TINY.n_heads, TINY.head_dim)), positions)
    kv = rope(rms(x @ w[p + "attn_kv.weight"].T, w[p + "attn_kv_a_norm.weight"]), positions)
    keys = np.concatenate((ring, kv))  # every query: the ring and the block, both ways
    scores = np.einsum("bhd,nd->bhn", q, keys) / np.sqrt(TINY.head_dim)
    sinks = np.broadcast_to(w[p + "attn_sinks.weight"][None, :, None], (len(x), TINY.n_heads, 1))
    full = np.concatenate((scores, sinks), -1)
    probs = np.exp(full - full.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True))[..., :-1]
    o = rope(np.einsum("bhn,nd->bhd", probs, keys), positions, inverse=True).reshape(len(x), TINY.o_groups, -1)
    wo_a = w[p + "attn_output_a.weight"].reshape(TINY.o_groups, TINY.o_lora_rank, -1)
    o = np.concatenate([o[:, g] @ wo_a[g].T for g in range(TINY.o_groups)], -1) @ w[p + "attn_output_b.weight"].T
    h = hc_post(o, h, post, comb)
    x, post, comb = hc_mix(h, w[p + "hc_ffn_fn.weight"], w[p + "hc_ffn_scale.weight"], w[p + "hc_ffn_base.weight"])
    x = rms(x, w[p + "ffn_norm.weight"])
    logits = x @ w[p + "ffn_gate_inp.weight"].T
    scores = np.sqrt(np.logaddexp(0, logits))
    out = swiglu(x, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"], w[p + "ffn_down_shexp.weight"])
    for t in range(len(x)):
        chosen = np.argsort(-(scores[t] + w[p + "exp_probs_b.bias"]))[: TINY.n_activated_experts]
        weights = scores[t, chosen] / scores[t, chosen].sum() * TINY.route_scale
        for e, we in zip(chosen, weights, strict=True):
            gate, up, down = (w[p + f"ffn_{name}_exps.weight"][e] for name in ("gate", "up", "down"))
            out[t] += swiglu(x[t : t + 1], gate, up, down, we)[0]
    return hc_post(out, h, post, comb)


def numpy_block(w, streams, anchor):
    """(collapsed rows, logits [B, vocab]) of the block after the captured streams' positions."""
    main = np.concatenate([s.astype(np.float64).mean(1) for s in streams], -1) @ w["mtp.0.main_proj.weight"].T
    main_x = rms(main, w["mtp.0.main_norm.weight"])
    context = np.arange(len(main_x))[-TINY.window :]
    positions = np.arange(len(main_x), len(main_x) + D.block_size)
    ids = [anchor] + [D.noise_token_id] * (D.block_size - 1)
    h = np.repeat(w["token_embd.weight"][ids][:, None, :], TINY.hc_mult, axis=1)
    for k in range(D.stages):
        p = f"mtp.{k}."
        ring = rope(rms(main_x[context] @ w[p + "attn_kv.weight"].T, w[p + "attn_kv_a_norm.weight"]), context)
        h = stage(w, k, h, ring, positions)
    last = f"mtp.{D.stages - 1}."
    flat = h.reshape(len(h), -1)
    mix = flat @ w[last + "hc_head_fn.weight"].T / np.sqrt((flat * flat).mean(-1, keepdims=True) + TINY.norm_eps)
    gate = sigmoid(mix * w[last + "hc_head_scale.weight"] + w[last + "hc_head_base.weight"]) + TINY.hc_eps
    collapsed = (gate[..., None] * h).sum(1)
    return collapsed, rms(collapsed, w[last + "norm.weight"]) @ w["output.weight"].T


def test_the_block_matches_an_independent_implementation(files, drafted):
    streams, anchor, collapsed, logits, drafts, rows, _, _ = drafted
    w = {**tensors(files[0]), **tensors(files[1])}
    want_collapsed, want_logits = numpy_block(w, streams, anchor)
    assert np.abs(collapsed - want_collapsed).max() < 1e-4 * np.abs(want_collapsed).max()
    assert np.abs(logits - want_logits).max() < 1e-4 * np.abs(want_logits).max()
    # the Markov head: each row's bias from the token chosen before it, the anchor for the first
    last = f"mtp.{D.stages - 1}."
    w1, w2 = w[last + "markov_head.markov_w1.weight"], w[last + "markov_head.markov_w2.weight"]
    previous, want = anchor, []
    for i in range(D.block_size):
        row = want_logits[i] + w2 @ w1[previous]
        previous = int(row.argmax())
        want.append(previous)
        assert np.abs(rows[i].numpy() - row).max() < 1e-4 * np.abs(row).max()
    assert drafts == want


def test_the_confidence_cut_stops_at_the_first_row_below_the_threshold(files, drafted):
    streams, anchor, _, _, drafts, _, draft, state = drafted
    w = {**tensors(files[1])}
    last = f"mtp.{D.stages - 1}."
    collapsed, _ = numpy_block({**tensors(files[0]), **w}, streams, anchor)
    w1, proj = w[last + "markov_head.markov_w1.weight"], w[last + "confidence_head.proj.weight"][0]
    confidence = [sigmoid(np.concatenate((collapsed[i], w1[p])) @ proj) for i, p in enumerate([anchor, *drafts[:-1]])]
    for threshold in sorted(confidence):
        cut, _ = draft.propose(anchor, state, D.block_size, Sampler(GREEDY), threshold=float(threshold) + 1e-6)
        below = [i for i, c in enumerate(confidence) if c < threshold + 1e-6]
        assert cut == drafts[: below[0]]
    assert draft.propose(anchor, state, D.block_size, Sampler(GREEDY), threshold=0.0)[0] == drafts
    assert state.pos == len(CONTEXT)  # proposing never moves the drafter's state


# -- bad input --------------------------------------------------------------------------------------------------
def rewrite(src, dst, drop: str | None = None, metadata: dict | None = None) -> None:
    """A copy of the support file without tensor `drop`, or with other `dspark.*` values."""
    from dwarfstar.gguf.constants import ValueType
    from dwarfstar.gguf.reader import GGUFFile
    from dwarfstar.gguf.writer import GGUFWriter

    source = GGUFFile(src)
    u32 = ValueType.UINT32
    meta = {
        "general.architecture": (ValueType.STRING, source.metadata["general.architecture"]),
        **{k: (u32, v) for k, v in source.metadata.items() if k.startswith("dspark.") and not isinstance(v, list)},
        "dspark.target_layer_ids": (ValueType.ARRAY, (u32, list(source.metadata["dspark.target_layer_ids"]))),
    }
    meta.update(metadata or {})
    names = [n for n in source.tensors if n != drop]
    with GGUFWriter(dst, meta) as writer:
        for name in names:
            info = source.tensors[name]
            writer.add_tensor(name, tuple(info.shape), info.ggml_type)
        for name in names:
            writer.write_tensor(name, iter([source.raw(name)]))
    source.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"drop": "mtp.2.norm.weight"}, "missing tensor 'mtp.2.norm.weight'"),
        ({"metadata": {"dspark.target_layer_ids": (9, (4, [40, 41, 42]))}}, "a drafter for another model"),
        ({"metadata": {"general.architecture": (8, "deepseek4")}}, "not a DSpark support file"),
        ({"metadata": {"dspark.stage_count": (4, 4)}}, "no tensors of stage [3]"),
    ],
)
def test_a_support_file_that_does_not_fit_is_refused_by_name(files, tmp_path, change, message):
    model_path, support = files
    bad = tmp_path / "bad.gguf"
    rewrite(support, bad, **change)
    model = open_model(model_path)
    with pytest.raises(ModelFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        DSparkDraft(ReferenceModel(model, qat=False), model, bad)


def test_a_missing_file_and_a_drafter_for_a_wider_model_are_refused(files, tmp_path):
    model_path, _ = files
    model = open_model(model_path)
    target = ReferenceModel(model, qat=False)
    with pytest.raises(ModelFileError, match="not found"):
        DSparkDraft(target, model, tmp_path / "none.gguf")
    wide = tmp_path / "wide.gguf"
    write_synthetic_dspark(wide, TINY.with_(dim=96), D)
    with pytest.raises(ModelFileError, match="does not fit"):
        DSparkDraft(target, model, wide)
    assert issubclass(ModelFileError, DwarfStarError)


# -- speculation ------------------------------------------------------------------------------------------------
SPEC_D = DSparkArgs(block_size=5, markov_rank=16, noise_token_id=128799, target_layers=(1, 2, 3), stages=3)


@pytest.fixture(scope="module")
def small_drafter(mtp_files, tmp_path_factory):
    path = tmp_path_factory.mktemp("dspark") / "small-dspark.gguf"
    write_synthetic_dspark(path, SMALL, SPEC_D, seed=2)
    return path


@pytest.mark.parametrize("scripted", [False, True], ids=["dspark-drafts", "scripted-drafts"])
def test_greedy_speculation_with_dspark_emits_what_plain_decoding_does(engines, backend_name, small_drafter, scripted):
    """With the random drafter every step rolls back; with scripted drafts (right but every seventh)
    steps accept all, some or none. Either way the output is plain greedy's, and the drafter's rings
    hold exactly the committed positions' rows: its block after the sequence equals the block of a
    drafter fed once from a plain pass over the whole sequence."""

    engine = engines(backend_name, "plain")
    n = 60
    plain = plain_greedy(engine.backend, PROMPT, n)
    draft = DSparkDraft(engine.backend, engine.model, small_drafter)
    spec = speculative(engine.backend, draft, PROMPT, 5)
    if scripted:
        spec.drafter = ScriptedDrafter(plain.tokens, wrong_every=7)
    got = list(spec.generate(n, GREEDY))
    assert first_gap(got, plain.tokens[len(PROMPT) :]) is None and len(got) == n
    assert spec.stats.steps > 0 and spec.stats.drafted[0] > 0
    if scripted:
        assert 0 < spec.stats.accepted[0] < spec.stats.drafted[0] and spec.stats.accepted[4] > 0
    track = spec.track
    track.feed([], spec.state.pos)
    assert track.fed_to == spec.state.pos == len(spec.session.tokens)
    captured = {}
    engine.backend.taps.append(lambda il, h, batch: captured.__setitem__(il, h))
    try:
        engine.backend.forward(spec.session.tokens, engine.backend.new_state())
    finally:
        engine.backend.taps.clear()
    fresh = draft.new_state()
    draft.feed([captured[il] for il in SPEC_D.target_layers], fresh)
    anchor = spec.session.tokens[-1]
    _, want = draft.forward.block(anchor, fresh)
    _, have = draft.forward.block(anchor, track.state)
    assert (have - want).abs().max() < 1e-3 * want.abs().max()


def test_run_with_dspark_prints_the_plain_greedy_text(mtp_files, engines, small_drafter):
    import re

    from typer.testing import CliRunner

    from dwarfstar.cli import _register_commands, app
    from dwarfstar.session.session import Session

    _register_commands()
    engine = engines("reference", "plain")
    session = Session(engine.backend, ctx=1024)
    session.prefill(PROMPT)
    want = engine.tokenizer.decode(list(session.generate(24, GREEDY, [engine.model.args.eos_token_id])))
    base = ["run", "-m", str(mtp_files["plain"]), "--backend", "reference", "--temp", "0", "-n", "24", "-c", "1024"]
    ids = ["--prompt-tokens", ",".join(map(str, PROMPT))]
    done = CliRunner().invoke(app, [*base, *ids, "--dspark", str(small_drafter), "--dspark-confidence", "0.2"])
    assert done.exit_code == 0, done.output
    assert done.stdout == want + "\n"
    assert re.search(r"dspark confidence 0.2: \d+ steps, [\d.]+ accepted per step", done.stderr)
    cases = [
        ([*ids, "--dspark", str(small_drafter), "--mtp-draft", "2"], "--dspark and --mtp choose two drafters"),
        ([*ids, "--dspark", str(small_drafter), "--dspark-confidence", "1.5"], "--dspark-confidence must be in"),
        ([*ids, "--dspark-confidence", "0.5"], "--dspark-confidence needs --dspark FILE"),
        ([*ids, "--dspark", str(mtp_files["ds4"])], "not a DSpark support file"),
        (["--dspark", str(small_drafter)], "needs a one-shot prompt"),
    ]
    for args, message in cases:
        done = CliRunner().invoke(app, [*base, *args])
        assert done.exit_code != 0
        assert message in str(done.exception) + done.output, (args, done.output)


def test_serve_with_dspark_gives_the_replies_of_the_server_without_it(engines, small_drafter):
    """Three greedy requests at once: speculation inside the server's batched decode, each request with
    its own drafter state, verified together."""
    from concurrent.futures import ThreadPoolExecutor

    from starlette.testclient import TestClient

    from dwarfstar.serving.app import create_app
    from dwarfstar.serving.config import ServerConfig
    from dwarfstar.serving.service import Service
    from dwarfstar.speculative.mtp_options import DSparkOptions

    engine = engines("reference", "plain")
    prompts, lengths = ["Quel ramo del lago di Como", "Renzo e Lucia", "Don Abbondio"], [30, 17, 6]

    def replies(speculation) -> tuple[list[str], int]:
        """The replies' texts, and the drafts their usage counts."""
        config = ServerConfig(ctx=512, max_sessions=3, prefill_chunk=64, mtp=speculation)
        with TestClient(create_app(Service(engine, config))) as client:

            def ask(i: int) -> dict:
                body = {"model": "deepseek-v4-flash", "prompt": prompts[i], "raw": True, "max_tokens": lengths[i]}
                response = client.post("/v1/completions", json={**body, "temperature": 0})
                assert response.status_code == 200, response.text
                return response.json()

            with ThreadPoolExecutor(3) as pool:
                out = list(pool.map(ask, range(3)))
        details = [r["usage"].get("completion_tokens_details") or {} for r in out]
        drafted = sum(d.get("accepted_prediction_tokens", 0) + d.get("rejected_prediction_tokens", 0) for d in details)
        return [r["choices"][0]["text"] for r in out], drafted

    (speculated, drafted), (plain, _) = replies(DSparkOptions(small_drafter)), replies(None)
    assert speculated == plain and drafted > 0


def test_bench_measures_plain_mtp_and_dspark_in_one_run(mtp_files, small_drafter):
    import re

    from typer.testing import CliRunner

    from dwarfstar.cli import _register_commands, app

    _register_commands()
    args = ["bench", "mtp", "-m", str(mtp_files["nextn"]), "--backend", "reference", "-n", "12", "--drafts", "2"]
    done = CliRunner().invoke(app, [*args, "--dspark", str(small_drafter)])
    assert done.exit_code == 0, done.output
    rows = re.findall(r"^(mtp 2 next|mtp 2 same|dspark 0)\s+.*\s(yes|NO)$", done.stdout, flags=re.M)
    assert rows == [("mtp 2 next", "yes"), ("mtp 2 same", "yes"), ("dspark 0", "yes")]


def test_a_trained_drafter_round_trips_through_its_support_file(mtp_files, engines, tmp_path):
    """`tools/train_nano.py --dspark`'s trainer: a step moves the drafter and not the model, and the
    exported support file loads back with the trained values."""
    import dataclasses

    import torch

    from dwarfstar.errors import ModelFileError
    from dwarfstar.gguf.constants import GGMLType
    from dwarfstar.gguf.reader import GGUFFile
    from dwarfstar.model import tensors as tt
    from dwarfstar.train.dspark import DSparkRecipe, DSparkTrainer

    model = open_model(mtp_files["plain"])
    ids = np.random.default_rng(0).permutation(np.arange(3, model.args.vocab_size))  # every id: every choice a target
    recipe = DSparkRecipe(steps=2, sequences=2, seq_len=40, prompt_tokens=(8, 16), batch=1, anchors=3)
    d = dataclasses.replace(SPEC_D, markov_rank=32)  # Markov rows of a whole Q8_0 block
    trainer = DSparkTrainer(model, d, ids, 0, recipe, seed=0)
    for tokens, choices, first in zip(trainer.samples, trainer.choices, trainer.first_anchor, strict=True):
        # a book window continued by the model's greedy choices: after the prompt, each token is the
        # frozen model's argmax at the position before it
        assert len(tokens) == 40 and 9 <= first <= 17
        assert np.array_equal(tokens[first:], choices[first - 1 : -1].numpy())
        assert not np.array_equal(tokens[1:first], choices[: first - 1].numpy())
    embedding, before = trainer.params[tt.EMBED].clone(), trainer.head_params["main_proj.weight"].detach().clone()
    for _ in range(2):
        ce, confidence, agree = trainer.train_step()
        assert np.isfinite(ce) and np.isfinite(confidence) and agree.shape == (d.block_size,)
        assert ((0 <= agree) & (agree <= 1)).all()
    assert torch.equal(trainer.params[tt.EMBED], embedding)
    assert not torch.equal(trainer.head_params["main_proj.weight"], before)
    path = tmp_path / "trained-dspark.gguf"
    trainer.export(path)
    engine = engines("reference", "plain")
    draft = DSparkDraft(engine.backend, engine.model, path)
    assert torch.equal(draft.heads.main_proj, trainer.head_params["main_proj.weight"].detach())
    wkv = tt.layer_tensor(2, "attn_kv.weight")
    assert torch.equal(draft.stages.ops.layers[2].proj["kv"], trainer.params[wkv].detach())
    again = DSparkTrainer(model, d, ids, 0, recipe, seed=1, init=path)  # continued training starts from it
    for own, value in [*trainer.params.items(), *trainer.head_params.items()]:
        assert torch.equal({**again.params, **again.head_params}[own], value), own
    with pytest.raises(ModelFileError, match="is not a support file of this drafter"):
        DSparkTrainer(model, d, ids, 0, recipe, seed=0, init=mtp_files["ds4"])
    small = tmp_path / "trained-dspark-q8.gguf"  # the bundled form: matrices in Q8_0, the rest F32
    trainer.export(small, GGMLType.Q8_0)
    types = {name: info.ggml_type for name, info in GGUFFile(small).tensors.items()}
    assert types["mtp.2.markov_head.markov_w1.weight"] == types["mtp.0.attn_kv.weight"] == GGMLType.Q8_0
    assert types["mtp.0.main_norm.weight"] == GGMLType.F32 and types["mtp.2.hc_head_fn.weight"] == GGMLType.F32
    assert small.stat().st_size < path.stat().st_size / 3
    draft = DSparkDraft(engine.backend, engine.model, small)
    w1 = trainer.head_params["markov_head.markov_w1.weight"].detach()
    assert 0 < (draft.heads.markov_w1 - w1).abs().max() <= w1.abs().max() / 127


def test_sampled_speculation_with_dspark_follows_plain_sampling(engines, small_drafter):
    """The first two sampled tokens over many seeds, drafted by the DSpark drafter (the second is the
    first speculative one: a drafted block, accepted or resampled), against their exact distribution."""
    from dwarfstar.sampling import SamplingParams

    engine = engines("reference", "plain")
    backend = engine.backend
    params = SamplingParams(temperature=1.0, min_p=0.0, top_k=2)
    spec = speculative(backend, DSparkDraft(backend, engine.model, small_drafter), PROMPT, 5)
    start = (spec.state.snapshot(), spec.track.state.snapshot())
    expected = first_two_tokens(backend, spec.state, params)

    def rewind() -> None:
        spec.state.restore(start[0])
        spec.track.state.restore(start[1])
        spec.track.hidden = None

    trials = 150
    counts = sampled_pairs(spec, params, trials, rewind)
    assert spec.stats.drafted[0] == trials
    assert chi_square_p(counts, expected, trials) > SIGNIFICANCE


def test_bench_runs_every_drafter_over_the_same_held_out_prompts(mtp_files, small_drafter, tmp_path):
    """`--prompts N` continues N paragraph openings of the text's held-out tail (its last 5%), each
    drafter over the same ones; more prompts than the tail has paragraphs is a clear error."""
    import re

    from typer.testing import CliRunner

    from dwarfstar.cli import _register_commands, app
    from dwarfstar.commands.speculate import held_out_prompts
    from dwarfstar.errors import DwarfStarError

    paragraphs = [" ".join(f"p{i:02d}w{j:02d}" for j in range(45)) for i in range(60)]  # 314 characters each
    text = tmp_path / "book.txt"
    text.write_text("\n\n".join(paragraphs), encoding="utf-8")
    # 95% of the 18,958 characters is 18,010, the break after paragraph 56: the tail is 57, 58 and 59
    assert held_out_prompts(2, text) == [" ".join(f"p{i}w{j:02d}" for j in range(20)) for i in (57, 59)]
    _register_commands()
    args = ["bench", "mtp", "-m", str(mtp_files["nextn"]), "--backend", "reference", "-n", "6", "--drafts", "1"]
    done = CliRunner().invoke(app, [*args, "--dspark", str(small_drafter), "--prompts", "3", "--text-file", str(text)])
    assert done.exit_code == 0, done.output
    assert "| 3 prompt(s)" in done.stdout and "over 18 tokens" in done.stdout
    rows = re.findall(r"^(mtp 1 next|mtp 1 same|dspark 0)\s+.*\s(yes|NO)$", done.stdout, flags=re.M)
    assert rows == [("mtp 1 next", "yes"), ("mtp 1 same", "yes"), ("dspark 0", "yes")]
    done = CliRunner().invoke(app, [*args, "--prompts", "4", "--text-file", str(text)])
    assert isinstance(done.exception, DwarfStarError)
    assert "has 3 paragraphs of 40+ words, fewer than --prompts 4" in str(done.exception)


def test_speculation_figures_add_up_over_runs():
    from dwarfstar.speculative.decode import SpecStats

    a = SpecStats(steps=2, drafted=[2, 2, 0], accepted=[2, 1, 0], emitted=5, rollbacks=1)
    a.add(SpecStats(steps=3, drafted=[3, 3, 3], accepted=[1, 0, 0], emitted=4, rollbacks=2))
    assert (a.steps, a.emitted, a.rollbacks) == (5, 9, 3)
    assert a.acceptance() == [3 / 5, 1 / 5, 0.0] and a.mean_accepted == 4 / 5
