"""Steering in the server: the per-request extension fields, and the steering setting as part of the
KV cache key (live sessions and the disk cache), on the tiny model and the reference backend."""

from __future__ import annotations

import pytest
import torch
from starlette.testclient import TestClient

from dwarfstar.engine.load import load_engine
from dwarfstar.engine.spec import EngineSpec
from dwarfstar.serving.app import create_app
from dwarfstar.serving.config import ServerConfig
from dwarfstar.serving.pool import SessionPool
from dwarfstar.serving.replay import ToolMemory
from dwarfstar.serving.service import Service
from dwarfstar.session.session import Session
from dwarfstar.steering.apply import SteeringOptions
from dwarfstar.steering.direction import SteeringScale, write_direction

PROMPT = torch.randint(3, 120000, (24,), generator=torch.Generator().manual_seed(5)).tolist()
CHUNK = 8


@pytest.fixture(scope="module")
def direction_file(tiny_model_file, tmp_path_factory):
    from dwarfstar.model.loader import open_model

    args = open_model(tiny_model_file(4)).args
    rows = torch.randn(args.n_layers, args.dim, generator=torch.Generator().manual_seed(2))
    path = tmp_path_factory.mktemp("steer") / "dir.f32"
    write_direction(path, rows / rows.norm(dim=-1, keepdim=True), "ffn_out", {})
    return path


@pytest.fixture(scope="module")
def engine(tiny_model_file, direction_file):
    return load_engine(
        EngineSpec(tiny_model_file(4), backend="reference", steering=SteeringOptions(direction_file, 1.0, 0.0))
    )


class RecordingDisk:
    """A disk cache that holds nothing and records what the pool asks of it."""

    def __init__(self) -> None:
        self.restores = 0

    def save(self, live, reason) -> None:
        pass

    def key(self, prompt, ids) -> bytes:
        return b""

    def restore(self, key, better_than):
        self.restores += 1
        return None


def run_lease(pool: SessionPool, ids: list[int], steering: SteeringScale | None):
    lease = pool.acquire(None, ids, steering)
    lease.session.prefill(lease.plan.suffix)
    pool.release(lease, len(ids))
    return lease


def test_a_prefix_computed_without_steering_is_not_reused_with_it(engine):
    pool = SessionPool(engine.backend, engine.tokenizer, ctx=128, chunk=CHUNK, max_sessions=4)
    plain = run_lease(pool, PROMPT[:16], None)
    steering = SteeringScale(ffn=1.0)
    steered = run_lease(pool, PROMPT, steering)  # extends the plain conversation: only its setting differs
    assert steered.source == "cold" and steered.plan.keep == 0 and steered.live is not plain.live
    fresh = Session(engine.backend, ctx=128, chunk=CHUNK)
    engine.backend.assign(fresh, steering)
    fresh.prefill(PROMPT)
    assert torch.equal(steered.session.state.logits, fresh.state.logits)
    # each setting finds its own conversation again
    assert run_lease(pool, PROMPT + [7], steering).live is steered.live
    again = run_lease(pool, PROMPT[:16] + [9], None)
    assert again.source == "memory" and again.live is plain.live
    other = run_lease(pool, PROMPT + [7, 8], SteeringScale(ffn=-1.0))
    assert other.source == "cold" and other.live not in (plain.live, steered.live)


def test_a_steered_request_never_reads_the_disk_cache(engine):
    disk = RecordingDisk()
    pool = SessionPool(engine.backend, engine.tokenizer, ctx=128, chunk=CHUNK, max_sessions=4, disk=disk)
    prompt = object()  # the pool only hands it to the disk cache
    pool.acquire(prompt, PROMPT, SteeringScale(ffn=2.0))
    assert disk.restores == 0
    pool.acquire(prompt, PROMPT, None)
    assert disk.restores == 1


def test_disk_cache_keeps_only_unsteered_states(engine, tmp_path):
    from dwarfstar.kvcache.kvpolicy import SaveReason
    from dwarfstar.serving.disk import DiskCache
    from dwarfstar.serving.pool import LiveSession

    disk = DiskCache.open(
        tmp_path, space_mb=64, min_tokens=4, engine=engine, ctx=128, chunk=CHUNK, memory=ToolMemory(100)
    )
    texts = {SteeringScale(ffn=0.5): "Quel ramo del lago di Como, che volge", None: "Renzo e Lucia, promessi sposi"}
    for steering, text in texts.items():
        session = Session(engine.backend, ctx=128, chunk=CHUNK)
        engine.backend.assign(session, steering or SteeringScale())
        session.prefill(engine.tokenizer.encode(text))
        disk.save(LiveSession(session, steering=steering), SaveReason.EVICT)
    # the disk cache answers a prompt by its rendered text (the pool passes a `Prompt`)
    found = {steering: disk.restore((text + " e altro").encode(), 0) for steering, text in texts.items()}
    assert found[SteeringScale(ffn=0.5)] is None
    assert found[None] is not None and found[None].tokens == engine.tokenizer.encode(texts[None])


def completion(client: TestClient, **extra):
    body = {"prompt": "Quel ramo", "max_tokens": 2, "temperature": 0, **extra}
    return client.post("/v1/completions", json=body)


def test_request_fields_set_the_session_steering(engine):
    service = Service(engine, ServerConfig(ctx=256, max_sessions=4, prefill_chunk=CHUNK))
    with TestClient(create_app(service)) as client:
        assert completion(client, dir_steering_ffn=0.5).status_code == 200
        assert completion(client).status_code == 200  # the server's own scales: ffn 1, attn 0
        assert completion(client, dir_steering_ffn=0, dir_steering_attn=0).status_code == 200
        assert completion(client, dir_steering_attn=-3).status_code == 200
        keys = {live.steering for live in service.pool.live}
        assert keys == {SteeringScale(0.5), SteeringScale(1.0), None, SteeringScale(1.0, -3.0)}
        for live in service.pool.live:  # what each session's forward calls are steered with
            assert engine.backend.scale_of(live.session.state) == (live.steering or SteeringScale())
        bad = completion(client, dir_steering_ffn=100.5)
        assert bad.status_code == 400 and "dir_steering_ffn must be between -100.0 and 100.0" in bad.text
        wrong = completion(client, dir_steering_attn="strong")
        assert wrong.status_code == 400 and "dir_steering_attn must be a number" in wrong.text


def test_request_fields_need_a_server_with_a_direction(tiny_model_file):
    engine = load_engine(EngineSpec(tiny_model_file(4), backend="reference"))
    service = Service(engine, ServerConfig(ctx=256, prefill_chunk=CHUNK))
    with TestClient(create_app(service)) as client:
        refused = completion(client, dir_steering_ffn=1.0)
        assert refused.status_code == 400
        assert "dir_steering_ffn needs a server started with --dir-steering-file" in refused.text
        assert completion(client).status_code == 200
