"""A route survives what a network does: a worker dying mid-request, a worker that lost a session;
and a session saved through one route loads into another, byte-identical to one process."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import CTX, DIE_AT_ROWS, WAIT_S

from dwarfstar.distributed.link import Message
from dwarfstar.distributed.protocol import Header, Op, RouteIncompleteError, SegmentRecord
from dwarfstar.kvcache.payload import read_payload, write_payload
from dwarfstar.session.session import Session

PROMPT = [5, 17, 42, 7, 99, 1000, 5, 31, 64, 2]


def test_worker_killed_mid_request_then_restarted(fragile):
    local, routed = Session(fragile.local, ctx=CTX), Session(fragile.backend, ctx=CTX)
    for session in (local, routed):
        session.prefill(PROMPT)
    with pytest.raises(RouteIncompleteError, match=r"layers 3:output .* disconnected during the request"):
        routed.prefill(list(range(100, 100 + DIE_AT_ROWS)))
    assert routed.tokens == PROMPT  # the failed request left the session where it was
    assert fragile.workers["3:output"].wait(timeout=30) == 17
    with pytest.raises(RouteIncompleteError, match=r"layers 3:output have no worker"):
        routed.decode(11)
    fragile.start_worker("3:output")
    fragile.route.wait_complete(WAIT_S)
    replays = fragile.route.replays
    local.decode(11)
    routed.decode(11)
    assert fragile.route.replays == replays + 1  # the session was rebuilt on the new worker
    assert torch.equal(routed.logits.cpu(), local.logits)
    assert routed.tokens == local.tokens == [*PROMPT, 11]


def test_worker_that_lost_a_session_reports_a_mismatch_and_replay_fixes_it(tiny2):
    local, routed = Session(tiny2.local, ctx=CTX), Session(tiny2.backend, ctx=CTX)
    for session in (local, routed):
        session.prefill(PROMPT)
    # the worker forgets the session behind the coordinator's back: it is at position 0 there now
    (stage,) = tiny2.route.stages
    forget = Message(Header(Op.RESET, 999, 1), [SegmentRecord(routed.state.session_id, 0, 0, 0, 0)])
    stage.link.request(forget, 30)
    mismatches, replays = tiny2.route.mismatches, tiny2.route.replays
    local.decode(3)
    routed.decode(3)
    assert tiny2.route.mismatches == mismatches + 1
    assert tiny2.route.replays == replays + 1
    assert torch.equal(routed.logits.cpu(), local.logits)


def test_payload_through_two_stages_is_byte_identical_and_loads_into_three(tiny2, tiny3):
    args, chunk = tiny2.local.args, 4096
    images = []
    for backend in (tiny2.local, tiny2.backend):
        session = Session(backend, ctx=CTX)
        session.prefill(list(range(300, 341)))  # 41 tokens: past the raw window, ratio-4 rows, a frontier
        out = io.BytesIO()
        write_payload(out, session.state, args, CTX, chunk)
        images.append(out.getvalue())
    assert images[0] == images[1]
    loaded = read_payload(images[1], args, CTX, chunk, tiny3.backend.new_state)
    reference = read_payload(images[0], args, CTX, chunk, tiny3.local.new_state)
    got = tiny3.backend.forward([8, 9], loaded, all_logits=True)
    want = tiny3.local.forward([8, 9], reference, all_logits=True)
    assert torch.equal(got.cpu(), want)
    again = io.BytesIO()
    write_payload(again, loaded, args, CTX, chunk)  # and gathers back from the 3-stage route
    direct = io.BytesIO()
    write_payload(direct, reference, args, CTX, chunk)
    assert again.getvalue() == direct.getvalue()
