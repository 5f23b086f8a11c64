"""MTP speculative decoding on a route: the last stage drafts with the bundled model's trained block,
the coordinator verifies through the route and truncates every stage after a rejection.

Without QAT rounding (where one process's greedy speculation is bit-exact, tests/speculative) and
with 32-bit activations, a route computes what one process computes, so the routed speculator must
emit the same tokens with the same acceptance as the one-process speculator, which emits the
plain greedy text, and leave the same state behind, byte for byte.
"""

from __future__ import annotations

import io

import pytest
from conftest import CTX, free_port

from dwarfstar.distributed.link import Message
from dwarfstar.distributed.membership import (
    LayerSlice,
    Registration,
    Rendezvous,
    connect_store,
    model_identity,
    register,
)
from dwarfstar.distributed.protocol import DistError, DraftRequest, Header, Op, RegistrationError, SegmentRecord, Status
from dwarfstar.distributed.route import Route, RouteOptions
from dwarfstar.distributed.stage import StageWorker
from dwarfstar.kvcache.payload import write_payload
from dwarfstar.sampling import GREEDY, SamplingParams
from dwarfstar.session.session import Session
from dwarfstar.speculative.decode import Speculator
from dwarfstar.speculative.mtp import load_draft
from dwarfstar.speculative.mtp_options import BUNDLED_MTP

N_TOKENS = 60
TEXT = "Quel ramo del lago di Como, che volge a mezzogiorno"


@pytest.fixture(scope="module")
def reference(exact_nano):
    """The prompt, plain greedy continuation and one-process draft of the exact bundled model."""
    prompt = exact_nano.tokenizer.encode(TEXT)
    session = Session(exact_nano.backend, ctx=CTX)
    session.prefill(prompt)
    plain = list(session.generate(N_TOKENS, GREEDY))
    draft = load_draft(exact_nano.backend, exact_nano.model, exact_nano.model.path.with_name(BUNDLED_MTP))
    return prompt, plain, draft


def speculate(backend, draft, prompt, n_draft, sampling=GREEDY, tokens=N_TOKENS, **options):
    spec = Speculator(Session(backend, ctx=CTX), draft, n_draft, **options)
    spec.prefill(prompt)
    return list(spec.generate(tokens, sampling)), spec


def payload(spec: Speculator) -> bytes:
    buf = io.BytesIO()
    write_payload(buf, spec.state, spec.session.backend.args, CTX, spec.session.chunk)
    return buf.getvalue()


def figures(spec: Speculator) -> tuple:
    stats = spec.stats
    return stats.steps, stats.drafted, stats.accepted, stats.rollbacks, spec.session.stats.computed


@pytest.mark.parametrize(("name", "n_draft"), [("mtp2", 2), ("mtp3", 3)])
def test_greedy_speculation_through_the_route_is_one_process(request, reference, name, n_draft):
    cluster = request.getfixturevalue(name)
    prompt, plain, draft = reference
    want, local = speculate(cluster.local, draft, prompt, n_draft)
    replays, mismatches = cluster.route.replays, cluster.route.mismatches
    got, routed = speculate(cluster.backend, load_draft(cluster.backend, cluster.engine.model), prompt, n_draft)
    assert got == want == plain
    assert figures(routed) == figures(local)
    assert local.stats.rollbacks > 0 and sum(local.stats.accepted) > 0  # truncations and accepted drafts both ran
    # every stage was truncated in step: no replay, and the state is one process's, byte for byte
    assert (cluster.route.replays, cluster.route.mismatches) == (replays, mismatches)
    assert payload(routed) == payload(local)


def test_sampled_speculation_through_the_route_is_one_process(mtp2, reference):
    """The last stage draws its drafts from the coordinator's sampler stream and returns their logits."""
    prompt, _, draft = reference
    sampling = SamplingParams(temperature=0.8, seed=7)
    want, local = speculate(mtp2.local, draft, prompt, 3, sampling, tokens=40)
    got, routed = speculate(mtp2.backend, load_draft(mtp2.backend, mtp2.engine.model), prompt, 3, sampling, tokens=40)
    assert got == want
    assert figures(routed) == figures(local) and sum(local.stats.accepted) > 0


def test_rerun_rollback_restores_every_stage(mtp2, reference, capfd):
    """rollback="rerun": RESTORE to the verify pass's snapshots (the last stage drops the rejected
    rows it held), then the kept tokens again; --debug shows the draft's hop."""
    prompt, plain, draft = reference
    want, local = speculate(mtp2.local, draft, prompt, 3, tokens=30, rollback="rerun")
    replays = mtp2.route.replays
    mtp2.route.options.debug = True
    try:
        got, routed = speculate(
            mtp2.backend, load_draft(mtp2.backend, mtp2.engine.model), prompt, 3, tokens=30, rollback="rerun"
        )
    finally:
        mtp2.route.options.debug = False
    assert got == want == plain[:30]
    assert figures(routed) == figures(local) and local.stats.rollbacks > 0
    assert mtp2.route.replays == replays
    hops = [line for line in capfd.readouterr().err.splitlines() if "mtp draft" in line]
    assert hops and all("(worker" in line and "bytes" in line for line in hops)


def generate_through_a_replay(spec, n: int, at: int = 20) -> tuple[list[int], int]:
    """n greedy tokens, the session marked for a replay after the first `at` (what a replaced worker
    leaves): the tokens, and the drafts accepted up to the replay."""
    got, accepted_then = [], 0
    for token in spec.generate(n, GREEDY):
        got.append(token)
        if len(got) == at:
            spec.state.dirty = True  # the next use replays the session
            accepted_then = sum(spec.stats.accepted)
    return got, accepted_then


def test_a_lost_draft_restarts_where_the_target_is(mtp2, reference, capfd):
    """A replayed session (as after a worker restart) loses its draft on the last stage: drafting
    restarts at the current position, with a message, and the text stays the plain greedy one."""
    prompt, plain, _ = reference
    spec = Speculator(Session(mtp2.backend, ctx=CTX), load_draft(mtp2.backend, mtp2.engine.model), 2)
    spec.prefill(prompt)
    replays = mtp2.route.replays
    got, accepted_then = generate_through_a_replay(spec, N_TOKENS)
    assert got == plain
    assert mtp2.route.replays == replays + 1
    assert "drafting restarts at position" in capfd.readouterr().err
    assert sum(spec.stats.accepted) > accepted_then  # drafting resumed


@pytest.fixture
def drafting_coordinator(exact_nano):
    """A coordinator that drafts with MTP (layers 0:2 of the bundled model), no worker yet."""
    port = free_port()
    route = Route(
        exact_nano.backend,
        LayerSlice(0, 2, 6),
        Rendezvous("127.0.0.1", port, "", 30),
        model_identity(exact_nano.model),
        CTX,
        RouteOptions(timeout_s=10),
        mtp=True,
    )
    yield route, port, exact_nano
    route.close()


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({}, "serves the output head \\(layers 2:output\\) without an MTP block.*--mtp FILE"),
        ({"mtp": True, "protocol": 2}, "speaks stage protocol 2, this coordinator 3"),
    ],
)
def test_a_last_worker_without_the_block_is_refused(drafting_coordinator, fields, why):
    route, port, engine = drafting_coordinator
    model_id, quant = model_identity(engine.model)
    reg = Registration(model_id, quant, 2, 6, CTX, "127.0.0.1", **fields)
    with pytest.raises(RegistrationError, match=why):
        register(connect_store("127.0.0.1", port, 10), reg, "", 20)
    assert route.stages == []


def test_drafting_on_a_route_without_the_block_is_a_clear_error(tiny2, tiny_engine):
    with pytest.raises(DistError, match="last stage .* has no MTP block: start it with --mtp FILE"):
        load_draft(tiny2.backend, tiny_engine[0].model)
    stage = StageWorker(tiny2.local, LayerSlice(3, 6, 6))  # a last stage loaded without a draft
    body = DraftRequest(1, start=0).pack()
    reply = stage.handle(
        Message(Header(Op.DRAFT, 1, 1, payload_bytes=body.numel()), [SegmentRecord(1, 0, 0, 0, 0)], payload=body)
    )
    assert reply.header.status == Status.ERROR
    assert "no MTP block" in bytes(reply.payload.numpy()).decode()
