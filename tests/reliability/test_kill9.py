"""Kill -9 during disk-cache saves: a process saving checkpoints without pause is killed at random
moments; after each kill, every file the cache can load holds exactly a state that was saved (none
corrupt), leftovers of the dead writer are cleaned, and the cache still serves a hit.

The suite kills 3 times; `nox -s reliability` sets DWARFSTAR_KILLS=50.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import torch

from dwarfstar.kvcache import kvfile
from dwarfstar.kvcache.kvfile import KVFileError, ModelIdentity
from dwarfstar.kvcache.kvpolicy import KVCacheOptions
from dwarfstar.kvcache.kvstore import KVStore
from dwarfstar.kvcache.payload import PayloadError, read_payload
from dwarfstar.model.state import KVCache, TorchStorage
from dwarfstar.model.synthetic import TINY
from dwarfstar.session.accounting import random_state

KILLS = int(os.environ.get("DWARFSTAR_KILLS", "3"))
CTX, CHUNK = 2048, 64
IDENTITY = ModelIdentity(32, bytes(range(32)))
OPTIONS = KVCacheOptions(min_tokens=8, budget_bytes=64 << 20)
SIZES = [64, 200, 640, 1500]  # tokens of the states the writer saves, in turn (the largest ~3 MB)

WRITER = textwrap.dedent(
    """
    import itertools, sys
    from dwarfstar.model.synthetic import TINY
    from dwarfstar.session.accounting import random_state
    from dwarfstar.kvcache.kvfile import ModelIdentity
    from dwarfstar.kvcache.kvpolicy import KVCacheOptions, SaveReason
    from dwarfstar.kvcache.kvstore import KVStore
    directory, sizes = sys.argv[1], [int(n) for n in sys.argv[2].split(",")]
    store = KVStore(directory, TINY, ModelIdentity(32, bytes(range(32))), {ctx}, {chunk},
                    lambda t: repr(list(t)).encode(), KVCacheOptions(min_tokens=8, budget_bytes=64 << 20))
    print("saving", flush=True)
    for n in itertools.cycle(sizes):
        store.save(random_state(TINY, n, seed=n), SaveReason.CONTINUED)
    """
).format(ctx=CTX, chunk=CHUNK)


def render(tokens) -> bytes:
    return repr(list(tokens)).encode()


def check_directory(directory, expected) -> int:
    """Every file that loads is one of the saved states, bit for bit; returns how many load."""
    loaded = 0
    for path in directory.glob("*.kv"):
        try:
            ckpt = kvfile.read_checkpoint(path)
            state = read_payload(ckpt.payload, TINY, CTX, CHUNK, KVCache(TINY, CTX, TorchStorage()).new_state)
        except (KVFileError, PayloadError):
            continue  # refused by name: the cache removes it, nobody loads it
        want = expected[len(state.tokens)]
        assert state.tokens == want.tokens and torch.equal(state.logits, want.logits), path.name
        loaded += 1
    return loaded


def test_kill_9_during_saves_never_leaves_a_corrupt_loadable_file(tmp_path):
    expected = {n: random_state(TINY, n, seed=n) for n in SIZES}
    rng = random.Random(0)
    for _ in range(KILLS):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), ",".join(map(str, SIZES))], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "saving"
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        check_directory(tmp_path, expected)
    store = KVStore(tmp_path, TINY, IDENTITY, CTX, CHUNK, render, OPTIONS)  # a restart: leftovers go
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]
    assert check_directory(tmp_path, expected) == len(store.entries()) > 0
    longest = max(store.entries(), key=lambda e: e.tokens)
    hit = store.lookup(longest.key + b" and more")
    assert hit is not None and hit.state.tokens == expected[longest.tokens].tokens
    print(f"kill -9: {KILLS} kills during saves, {len(store.entries())} files left, all intact, a hit served")
