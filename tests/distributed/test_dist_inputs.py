"""Bad input to a route gets a clear error: layer ranges, workers of another model, a wrong secret,
truncated or inconsistent messages."""

from __future__ import annotations

import pytest
import torch
from conftest import CTX, free_port

from dwarfstar.distributed.backend import RouteBackend
from dwarfstar.distributed.link import Message
from dwarfstar.distributed.membership import (
    LayerSlice,
    Registration,
    Rendezvous,
    connect_store,
    model_identity,
    parse_layers,
    register,
    split_by_bytes,
)
from dwarfstar.distributed.protocol import (
    DistError,
    Header,
    Op,
    ProtocolError,
    RegistrationError,
    RouteIncompleteError,
    SegmentRecord,
    Status,
    decode_activation,
    encode_activation,
    extend_hash,
    prefix_hash,
    unpack_segments,
)
from dwarfstar.distributed.route import Route, RouteOptions
from dwarfstar.distributed.stage import StageWorker
from dwarfstar.model.bundled import default_model_path
from dwarfstar.model.loader import open_model

SECRET = "s3cret"


@pytest.fixture(scope="module")
def lonely(tiny_engine):
    """A coordinator for layers 0:3 with a secret and no worker yet."""
    engine, _ = tiny_engine
    port = free_port()
    rendezvous = Rendezvous("127.0.0.1", port, SECRET, 30)
    route = Route(
        engine.backend, LayerSlice(0, 3, 6), rendezvous, model_identity(engine.model), CTX, RouteOptions(timeout_s=10)
    )
    yield route, port, engine
    route.close()


def registration(
    engine, first: int, last: int, ctx: int = CTX, identity: tuple[str, str] | None = None
) -> Registration:
    model_id, quant = identity or model_identity(engine.model)
    return Registration(model_id, quant, first, last, ctx, "127.0.0.1")


@pytest.mark.parametrize("text", ["3", "a:b", "4:2", "0:99", "6:output", "-1:3"])
def test_bad_layer_ranges(text):
    with pytest.raises(DistError, match="--layers"):
        parse_layers(text, 6)


def test_layer_ranges_and_the_even_split(tiny_engine):
    assert parse_layers("2:output", 6) == LayerSlice(2, 6, 6) and parse_layers("2:output", 6).holds_head
    assert str(parse_layers("1:4", 6)) == "1:4"
    plan = split_by_bytes(tiny_engine[0].model, 3)
    assert [p.first for p in plan] == [0, plan[0].last, plan[1].last] and plan[-1].holds_head
    assert all(p.last > p.first for p in plan)
    with pytest.raises(DistError, match="cannot split"):
        split_by_bytes(tiny_engine[0].model, 7)


@pytest.mark.parametrize(
    ("first", "last", "secret", "ctx", "why"),
    [
        (2, 5, SECRET, CTX, "overlap the coordinator's 0:3"),
        (0, 3, SECRET, CTX, "overlap|are the coordinator's"),
        (3, 6, "wrong", CTX, "did not present the route's shared secret"),
        (3, 6, SECRET, CTX // 2, f"context of {CTX // 2}, the route needs {CTX}"),
    ],
)
def test_refused_registrations(lonely, first, last, secret, ctx, why):
    route, port, engine = lonely
    store = connect_store("127.0.0.1", port, 10)
    with pytest.raises(RegistrationError, match=why):
        register(store, registration(engine, first, last, ctx), secret, 20)
    assert route.stages == []


def test_a_worker_of_another_model_is_refused(lonely):
    route, port, engine = lonely
    nano = open_model(default_model_path())
    try:
        other = registration(engine, 3, 6, identity=model_identity(nano))
    finally:
        nano.close()
    with pytest.raises(RegistrationError, match="serves another model"):
        register(connect_store("127.0.0.1", port, 10), other, SECRET, 20)


def test_an_incomplete_route_names_the_missing_layers(lonely):
    route, _, engine = lonely
    backend = RouteBackend(route)
    with pytest.raises(RouteIncompleteError, match=r"layers 3:output have no worker"):
        backend.forward([1, 2, 3], backend.new_state())


def test_truncated_and_foreign_messages():
    header = Header(Op.FORWARD, 7, 1, 3, 12).pack()
    assert Header.unpack(header) == Header(Op.FORWARD, 7, 1, 3, 12)
    with pytest.raises(ProtocolError, match="truncated header"):
        Header.unpack(header[:-1])
    with pytest.raises(ProtocolError, match="not a DwarfStar stage message"):
        Header.unpack(b"XXXX" + bytes(header[4:].numpy()))
    with pytest.raises(ProtocolError, match="bad header"):
        Header.unpack(bytes(header[:4].numpy()) + b"\x63" + bytes(header[5:].numpy()))
    h = torch.randn(3, 4, 8)
    data = encode_activation(h, 8)
    with pytest.raises(ProtocolError, match="activation of"):
        decode_activation(data[:-1], (3, 4, 8), 8)
    with pytest.raises(ProtocolError, match="segments cover 2 rows"):
        unpack_segments(torch.tensor([[1, 0, 2, 0, 0]]), 3)
    with pytest.raises(DistError, match="activation bits"):
        encode_activation(h, 12)


def test_activation_codec():
    h = torch.randn(5, 4, 16) * 30
    assert torch.equal(decode_activation(encode_activation(h, 32), tuple(h.shape), 32), h)
    for bits, rel in ((16, 1e-3), (8, 1e-2)):
        back = decode_activation(encode_activation(h, bits), tuple(h.shape), bits)
        row_max = h.abs().amax(dim=-1, keepdim=True)
        assert 0 < ((back - h).abs() / row_max).max() < rel


def test_token_prefix_hash_rolls():
    assert extend_hash(prefix_hash([1, 2]), [3, 4]) == prefix_hash([1, 2, 3, 4])
    assert prefix_hash([1, 2]) != prefix_hash([2, 1])
    assert prefix_hash([256]) != prefix_hash([1])


def test_stage_refuses_a_truncated_forward_and_reports_a_session_it_lacks(tiny_engine):
    engine, _ = tiny_engine
    stage = StageWorker(engine.backend, LayerSlice(3, 6, 6))
    args, tokens = engine.backend.args, torch.tensor([4, 5, 6])
    full = encode_activation(torch.zeros(3, args.hc_mult, args.dim), 32)
    fresh = SegmentRecord(1, 0, 3, prefix_hash([]), prefix_hash([4, 5, 6]))
    header = Header(Op.FORWARD, 1, 1, 3, full.numel() - 4)
    reply = stage.handle(Message(header, [fresh], tokens, full[:-4]))
    assert reply.header.status == Status.ERROR
    assert "activation of" in bytes(reply.payload.numpy()).decode()
    late = SegmentRecord(2, 5, 3, prefix_hash([9] * 5), prefix_hash([9] * 5 + [4, 5, 6]))
    reply = stage.handle(Message(Header(Op.FORWARD, 2, 1, 3, full.numel()), [late], tokens, full))
    assert reply.header.status == Status.MISMATCH
    assert bytes(reply.payload.numpy()).decode() == "2"
