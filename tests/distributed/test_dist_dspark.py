"""DSpark speculative decoding on a route: the last stage captures the drafter's target layers in its
own passes and drafts, the coordinator verifies through the route and truncates every stage.

As for MTP (test_dist_mtp), without QAT rounding and with 32-bit activations a route computes what
one process computes: the routed speculator emits the one-process speculator's tokens (the plain
greedy text) with the same drafts accepted, and leaves the same state behind, byte for byte. The
bundled model's trained drafter gets drafts accepted; a random drafter on the tiny model rejects
them, so every step rolls back. A last stage without every target layer is refused by name.
"""

from __future__ import annotations

import pytest
from conftest import CTX, Cluster, connected
from test_dist_mtp import TEXT, figures, generate_through_a_replay, payload

from dwarfstar.distributed.membership import LayerSlice, Registration
from dwarfstar.distributed.protocol import PROTOCOL, DistError, DraftRequest
from dwarfstar.distributed.stage import StageWorker
from dwarfstar.engine.launch import stage_draft
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.model.bundled import default_model_path
from dwarfstar.model.dspark import DSparkArgs
from dwarfstar.model.synthetic import TINY, write_synthetic_dspark
from dwarfstar.sampling import GREEDY, SamplingParams
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import Speculator, load_speculation
from dwarfstar.speculative.mtp_options import BUNDLED_DSPARK, DSparkOptions

N_TOKENS = 60
TINY_D = DSparkArgs(block_size=5, markov_rank=16, noise_token_id=128799, target_layers=(3, 4, 5), stages=3)
NANO_DSPARK = default_model_path().with_name(BUNDLED_DSPARK)  # target layers 3, 4, 5 of the 6


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("dspark-logs")


@pytest.fixture(scope="module")
def tiny_dspark(tmp_path_factory):
    path = tmp_path_factory.mktemp("dspark") / "tiny-dspark.gguf"
    write_synthetic_dspark(path, TINY, TINY_D, seed=1)
    return path


@pytest.fixture(scope="module")
def nano_route(exact_nano, logs):
    """The bundled model on two stages, the last (2:output) drafting with its trained drafter."""
    cluster = Cluster(default_model_path(), ["0:2", "2:output"], logs, dspark=NANO_DSPARK, qat=False)
    yield connected(cluster, exact_nano)
    cluster.close()


@pytest.fixture(scope="module")
def tiny_exact(tiny_model_file):
    return load_engine(EngineSpec(tiny_model_file(0), "reference", ctx=CTX, qat=False))


@pytest.fixture(scope="module")
def tiny_route(tiny_model_file, tiny_exact, tiny_dspark, logs):
    """The tiny model on two stages, the last (3:output) drafting with a random drafter."""
    cluster = Cluster(tiny_model_file(0), ["0:3", "3:output"], logs, dspark=tiny_dspark, qat=False)
    yield connected(cluster, tiny_exact)
    cluster.close()


def plain(engine, prompt: list[int], tokens: int = N_TOKENS) -> list[int]:
    session = Session(engine.backend, ctx=CTX)
    session.prefill(prompt)
    return list(session.generate(tokens, GREEDY))


def speculate(backend, model, options: DSparkOptions, prompt, sampling=GREEDY, tokens=N_TOKENS, rollback="truncate"):
    draft = load_speculation(options, backend, model).draft
    spec = Speculator(Session(backend, ctx=CTX), draft, draft.d.block_size, rollback=rollback)
    spec.prefill(prompt)
    return list(spec.generate(tokens, sampling)), spec


def both(cluster: Cluster, options: DSparkOptions, prompt, sampling=GREEDY, tokens=N_TOKENS, rollback="truncate"):
    """(one process's tokens and speculator, the route's), the route replaying nothing."""
    want, local = speculate(cluster.local, cluster.engine.model, options, prompt, sampling, tokens, rollback)
    replays, mismatches = cluster.route.replays, cluster.route.mismatches
    got, routed = speculate(cluster.backend, cluster.engine.model, options, prompt, sampling, tokens, rollback)
    assert (cluster.route.replays, cluster.route.mismatches) == (replays, mismatches)
    return want, local, got, routed


@pytest.mark.parametrize("rollback", ["truncate", "rerun"])
def test_greedy_dspark_through_the_route_is_one_process(nano_route, exact_nano, rollback):
    """A rejection truncates every stage in place (TRUNCATE) or restores them to the verify pass's
    snapshot (RESTORE); either way the last stage's held rows are cut with them."""
    prompt = exact_nano.tokenizer.encode(TEXT)
    want, local, got, routed = both(nano_route, DSparkOptions(NANO_DSPARK), prompt, rollback=rollback)
    assert got == want == plain(exact_nano, prompt)
    assert figures(routed) == figures(local)
    assert sum(local.stats.accepted) > 0 and local.stats.rollbacks > 0  # drafts accepted, and truncations ran
    assert payload(routed) == payload(local)


def test_the_confidence_cut_is_the_coordinators_on_a_route(nano_route, exact_nano):
    """--dspark-confidence travels with the track's start: the last stage cuts the blocks where one
    process cuts them (which is not where it drafts without the cut), and the text stays the greedy one."""
    prompt = exact_nano.tokenizer.encode(TEXT)
    options = DSparkOptions(NANO_DSPARK, confidence=0.5)
    want, local, got, routed = both(nano_route, options, prompt, tokens=40)
    assert got == want == plain(exact_nano, prompt, 40)
    assert figures(routed) == figures(local)
    _, uncut = speculate(exact_nano.backend, exact_nano.model, DSparkOptions(NANO_DSPARK), prompt, tokens=40)
    assert figures(local) != figures(uncut) and any(local.stats.drafted[:5])


def test_sampled_dspark_through_the_route_is_one_process(nano_route, exact_nano):
    """The last stage draws its drafts from the coordinator's sampler stream and returns their logits."""
    prompt = exact_nano.tokenizer.encode(TEXT)
    sampling = SamplingParams(temperature=0.8, seed=7)
    want, local, got, routed = both(nano_route, DSparkOptions(NANO_DSPARK), prompt, sampling, tokens=40)
    assert got == want
    assert figures(routed) == figures(local) and sum(local.stats.accepted) > 0


def test_a_lost_track_restarts_where_the_target_is(nano_route, exact_nano, capfd):
    """A replayed session loses its track on the last stage: drafting restarts at the current
    position, with a message, and the text stays the plain greedy one."""
    prompt = exact_nano.tokenizer.encode(TEXT)
    speculation = load_speculation(DSparkOptions(NANO_DSPARK), nano_route.backend, exact_nano.model)
    spec = speculation.start(Session(nano_route.backend, ctx=CTX))
    spec.prefill(prompt)
    replays = nano_route.route.replays
    got, accepted_then = generate_through_a_replay(spec, N_TOKENS)
    assert got == plain(exact_nano, prompt)
    assert nano_route.route.replays == replays + 1
    assert "the DSpark draft of session" in capfd.readouterr().err
    assert sum(spec.stats.accepted) > accepted_then  # drafting resumed


def test_a_random_drafter_on_the_tiny_route_emits_plain_greedy(tiny_route, tiny_exact, tiny_dspark):
    """Every step rejects the random drafts and truncates each stage (and the last stage's held rows)."""
    prompt = list(range(1000, 1020))
    want, local, got, routed = both(tiny_route, DSparkOptions(tiny_dspark), prompt)
    assert got == want == plain(tiny_exact, prompt)
    assert figures(routed) == figures(local) and local.stats.rollbacks > 0 and local.stats.drafted[0] > 0
    assert payload(routed) == payload(local)


def test_a_last_stage_without_the_target_layers_is_refused(tiny_engine, tiny_dspark, tiny_exact, tmp_path):
    """At the worker's start (before it registers), for a stage built by hand, and on the coordinator
    whose route's last stage does not hold the drafter's target layers."""
    engine, _ = tiny_engine
    options = DSparkOptions(tiny_dspark)
    why = "DSpark on a route needs the drafter's target layers 3, 4, 5 on the last stage; it holds 4:output, without 3"
    with pytest.raises(DistError, match=why):
        stage_draft(engine, engine.backend, LayerSlice(4, 6, 6), options)
    draft = stage_draft(engine, engine.backend, LayerSlice(3, 6, 6), options)
    with pytest.raises(DistError, match=why):
        StageWorker(engine.backend, LayerSlice(4, 6, 6), draft)
    assert stage_draft(engine, engine.backend, LayerSlice(0, 3, 6), options) is None  # not the last stage


def test_the_coordinator_refuses_a_drafter_whose_layers_its_last_stage_lacks(nano_route, exact_nano, tmp_path):
    early = tmp_path / "early-dspark.gguf"
    write_synthetic_dspark(early, exact_nano.model.args, DSparkArgs(5, 16, 128799, (1, 2, 3), 3), seed=3)
    with pytest.raises(DistError, match="target layers 1, 2, 3 on the last stage; it holds 2:output, without 1"):
        load_speculation(DSparkOptions(early), nano_route.backend, exact_nano.model)


def test_a_draft_request_and_a_registration_carry_the_dspark_fields():
    request = DraftRequest(7, start=12, shift=0, confidence=0.25, feeds=[[5, 6]], pending=9, n=5)
    assert DraftRequest.unpack(request.pack()) == request
    assert DraftRequest.unpack(DraftRequest(7).pack()).confidence == 0.0  # an MTP track's: no cut
    reg = Registration("id", "F32", 2, 6, CTX, "127.0.0.1", mtp=True, dspark=True)
    assert Registration.from_json(reg.to_json()) == reg and reg.protocol == PROTOCOL == 3
