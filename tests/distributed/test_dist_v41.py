"""A DeepSeek V4.1 route (issue 33): `v41-tiny` split at layer 6 (the candidate source, a kv source) into
the coordinator's layers 0..5 and a worker subprocess's 6..11 computes one process's logits bit for bit,
in prefill, one token at a time and in greedy decoding, and through snapshots; a slice that would cut a
layer from its kv or index source is refused by name."""

from __future__ import annotations

import pytest
import torch
from conftest import CTX, Cluster

from dwarfstar.distributed.protocol import DistError
from dwarfstar.distributed.route41 import RouteBackend41, RouteState41
from dwarfstar.engine.launch import DistOptions
from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.errors import DwarfStarError
from dwarfstar.model.forward_v41 import stage_cuts

PROMPT = [(7919 * i + 101) % 120000 for i in range(19)]
CUT = 6
CONSTRAINT = "a stage boundary must not separate a layer from its kv or index source"


def spec(path, **kw) -> EngineSpec:
    return EngineSpec(path, "reference", ctx=CTX, engram_cache=1, **kw)


@pytest.fixture(scope="module")
def v41_one(v41_tiny_file):
    return load_engine(spec(v41_tiny_file))


@pytest.fixture(scope="module")
def v41_route(v41_tiny_file, v41_one, tmp_path_factory):
    cluster = Cluster(v41_tiny_file, [f"0:{CUT}", f"{CUT}:output"], tmp_path_factory.mktemp("v41-dist-logs"))
    try:
        yield cluster.connect(load_engine(spec(v41_tiny_file, layers=(0, CUT))), v41_one)
    finally:
        cluster.close()


def test_the_route_computes_one_process_logits(v41_route, v41_one):
    backend, local = v41_route.backend, v41_one.backend
    assert isinstance(backend, RouteBackend41) and v41_route.route.local.layer_range == range(CUT)
    state, want_state = backend.new_state(), local.new_state()
    assert isinstance(state, RouteState41)
    got = backend.forward(PROMPT, state, all_logits=True)  # a token at a time
    want = local.forward(PROMPT, want_state, all_logits=True)
    assert got.shape == (len(PROMPT), local.args.vocab_size) and torch.equal(got, want)
    # the prompt in one pass, then greedy decoding
    state, want_state = backend.new_state(), local.new_state()
    assert torch.equal(backend.forward(PROMPT, state, False), local.forward(PROMPT, want_state, False))
    text, want_text = [], []
    for _ in range(6):
        text.append(int(state.logits.argmax()))
        want_text.append(int(want_state.logits.argmax()))
        backend.forward(text[-1:], state, False)
        local.forward(want_text[-1:], want_state, False)
    assert text == want_text and torch.equal(state.logits, want_state.logits)
    assert state.pos == want_state.pos == len(PROMPT) + 6


def test_snapshots_forks_and_replays_reach_the_worker(v41_route, v41_one):
    backend, local = v41_route.backend, v41_one.backend
    state, want_state = backend.new_state(), local.new_state()
    backend.forward(PROMPT[:11], state, False)
    local.forward(PROMPT[:11], want_state, False)
    snap = state.snapshot()
    backend.forward(PROMPT[11:], state, False)  # moves the worker's layers past the snapshot
    state.restore(snap)
    twin = state.__deepcopy__({})
    assert state.pos == twin.pos == 11 and twin.session_id != state.session_id
    want = local.forward(PROMPT[11:], want_state, False)
    assert torch.equal(backend.forward(PROMPT[11:], state, False), want)
    assert torch.equal(backend.forward(PROMPT[11:], twin, False), want)  # the fork's own worker session
    # a session the worker lost is replayed from the coordinator's tokens
    replays = v41_route.route.replays
    twin.dirty = True
    assert torch.equal(backend.forward([5], twin, False), local.forward([5], want_state, False))
    assert v41_route.route.replays == replays + 1


def test_a_route_refuses_images(v41_route):
    from dwarfstar.model.image_spans import ImageSpan

    span = ImageSpan(0, torch.zeros(1, v41_route.route.local.args.dim))
    with pytest.raises(DistError, match="image spans do not run over a distributed route"):
        v41_route.backend.forward([0], v41_route.backend.new_state(), False, images=[span])


def test_slices_that_cut_a_layer_from_its_source_are_refused(v41_tiny_file, v41_one):
    args = v41_one.model.args
    assert stage_cuts(args) == (1, 2, 4, 6)  # kv sources 2, 4, 6; layers 3, 5, 7.. read their rows
    with pytest.raises(DwarfStarError, match=f"layer 3 reads the compressed rows of layer 2.*{CONSTRAINT}"):
        load_engine(spec(v41_tiny_file, layers=(3, args.n_layers)))
    opts = DistOptions.resolved(role="worker", layers="8:output", addr="127.0.0.1:1")
    with pytest.raises(DwarfStarError, match=f"layer 8 reads the compressed rows of layer 6.*{CONSTRAINT}"):
        load_engine(spec(v41_tiny_file, dist=opts))
    with pytest.raises(DistError, match="needs --layers A:B"):
        load_engine(spec(v41_tiny_file, dist=DistOptions.resolved(role="worker", addr="127.0.0.1:1")))


def test_a_slice_runs_only_as_a_stage(v41_tiny_file):
    engine = load_engine(spec(v41_tiny_file, layers=(0, CUT)))
    assert engine.backend.layer_range == range(CUT)
    with pytest.raises(DwarfStarError, match="holds layers 0:6 of 12: it runs as one stage of a route"):
        engine.backend.forward(PROMPT, engine.backend.new_state(), False)
