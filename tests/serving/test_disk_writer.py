"""Disk-cache saves run on the cache's writer thread, from a copy of the state taken when asked."""

from __future__ import annotations

import threading

from dwarfstar.kvcache.kvpolicy import SaveReason
from dwarfstar.serving.disk import DiskCache
from dwarfstar.serving.pool import LiveSession
from dwarfstar.serving.replay import ToolMemory
from dwarfstar.session.session import Session

TEXT = "A conversation long enough to be worth a file on disk. " * 4


def held_writes(disk: DiskCache) -> threading.Event:
    """Make the writer wait before each file write until the returned event is set."""
    release = threading.Event()
    real_write = disk.store.write

    def write(planned):
        release.wait(timeout=60)
        return real_write(planned)

    disk.store.write = write
    return release


def test_a_save_returns_before_the_write_and_keeps_the_state_as_it_was(engine, tmp_path):
    opened = dict(space_mb=64, min_tokens=8, ctx=4096, chunk=256, memory=ToolMemory(100))
    disk = DiskCache.open(tmp_path, engine=engine, **opened)
    release = held_writes(disk)
    session = Session(engine.backend, ctx=4096, chunk=256)
    session.prefill(engine.tokenizer.encode(TEXT))
    saved_tokens = list(session.tokens)

    disk.save(LiveSession(session), SaveReason.COLD)  # returns with the write still held
    assert not list(tmp_path.glob("*.kv"))
    session.prefill(engine.tokenizer.encode(" The conversation went on."))  # the live state moves on

    # a lookup while the file is not written yet is served from the queued copy
    queued_hit = disk.restore((TEXT + " Later.").encode(), better_than=0)
    assert queued_hit is not None and queued_hit.tokens == saved_tokens

    release.set()
    disk.flush()
    (written,) = tmp_path.glob("*.kv")
    disk.close()
    reader = DiskCache.open(tmp_path, engine=engine, **opened)
    hit = reader.restore((TEXT + " Later.").encode(), better_than=0)
    assert hit is not None and hit.tokens == saved_tokens  # the state as it was when the save was asked
    assert hit.logits.equal(queued_hit.logits)
    reader.close()


def test_a_failed_write_does_not_stop_the_writer(engine, tmp_path):
    opened = dict(space_mb=64, min_tokens=8, ctx=4096, chunk=256, memory=ToolMemory(100))
    disk = DiskCache.open(tmp_path, engine=engine, **opened)
    real_write, calls = disk.store.write, []

    def write(planned):
        calls.append(planned.path)
        if len(calls) == 1:
            raise RuntimeError("disk went away")
        return real_write(planned)

    disk.store.write = write
    for text in (TEXT, TEXT + " Another one, longer."):
        session = Session(engine.backend, ctx=4096, chunk=256)
        session.prefill(engine.tokenizer.encode(text))
        disk.save(LiveSession(session), SaveReason.COLD)
    disk.close()
    assert len(calls) == 2 and [p.name for p in tmp_path.glob("*.kv")] == [calls[1].name]
