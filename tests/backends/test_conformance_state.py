"""Sequence states on every backend: snapshot and restore, the DSV4 payload continued in a fresh
process, and the disk KV cache. Each continuation must give exactly the logits of the uninterrupted
run: the same ops on the same state in the same order, so bit-identical, no tolerance.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conformance import CHUNK, CTX, PROMPT, child_env, payload_of, state_from_payload

from dwarfstar.kvcache.kvfile import ModelIdentity
from dwarfstar.kvcache.kvpolicy import KVCacheOptions, SaveReason
from dwarfstar.kvcache.kvstore import KVStore
from dwarfstar.model.loader import open_model
from dwarfstar.model.state import SequenceState
from dwarfstar.tokenizer.tokenizer import Tokenizer

# The reference prefills PROMPT[:28]; the backend adds 28 and 29 (a chunk that writes its own raw
# rows and frontiers mid-window), so the state is the backend's own at position 30. Continuing
# with 30 and 31 completes ratio-4 row 8 at 31: a restore must also rewind the compressed rows.
# Two steps only: a decode step takes the Triton interpreter several seconds.
IMPORTED, START = 28, 30
CONTINUE = PROMPT[START : START + 2]


@pytest.fixture(scope="session")
def state_at_start(backend, reference_payload) -> Callable[[], SequenceState]:
    """make() -> a new state of the backend after PROMPT[:START], its last chunk run by the backend."""

    def make() -> SequenceState:
        state = state_from_payload(reference_payload(IMPORTED, True), backend)
        backend.forward(PROMPT[IMPORTED:START], state, all_logits=False)
        return state

    return make


def continue_with(backend, state: SequenceState, tokens: list[int]) -> torch.Tensor:
    """Decode `tokens` one at a time, as a session does; their next-token logits [len, vocab] on the CPU."""
    return torch.cat([backend.forward([t], state, all_logits=False).cpu() for t in tokens])


def test_snapshot_restore_replays_identically(backend, state_at_start):
    state = state_at_start()
    snap = state.snapshot()
    first = continue_with(backend, state, CONTINUE)
    assert state.pos == START + len(CONTINUE)
    state.restore(snap)
    assert state.pos == START and state.tokens == PROMPT[:START]
    again = continue_with(backend, state, CONTINUE)
    assert torch.equal(again, first)
    assert torch.equal(state.logits.flatten().cpu(), again[-1])


def kv_store(directory: Path, model_path: Path, new_state: Callable[[], SequenceState]) -> KVStore:
    return KVStore(
        directory,
        open_model(model_path).args,
        ModelIdentity.of(open_model(model_path)),
        CTX,
        CHUNK,
        render_key=Tokenizer.from_gguf(model_path).decode_bytes,
        options=KVCacheOptions(min_tokens=16, budget_bytes=1 << 30),
        new_state=new_state,
    )


@dataclass
class Saved:
    payload: bytes  # the DSV4 payload of the backend's state at START
    store_dir: Path  # a KV cache directory holding the same state
    continued: torch.Tensor  # the uninterrupted run's logits after each token of CONTINUE


@pytest.fixture(scope="session")
def saved(backend, state_at_start, model_path, tmp_path_factory) -> Saved:
    """Shared by the payload and the KV cache tests, so the uninterrupted run is computed once."""
    state = state_at_start()
    payload = payload_of(state, backend)
    store_dir = tmp_path_factory.mktemp("kv")
    assert kv_store(store_dir, model_path, backend.new_state).save(state, SaveReason.COLD) is not None
    return Saved(payload, store_dir, continue_with(backend, state, CONTINUE))


# Run by the fresh process: load the same backend, read the payload back, continue, save the logits.
CHILD = """
import sys
from pathlib import Path

import torch
from conformance import BackendKind, load, state_from_payload

name, runs_on, model, payload, tokens, out = sys.argv[1:]
backend = load(BackendKind(name, runs_on), Path(model), qat=True)
state = state_from_payload(Path(payload).read_bytes(), backend)
tokens = [int(t) for t in tokens.split(",")]
torch.save(torch.cat([backend.forward([t], state, all_logits=False).cpu() for t in tokens]), out)
"""


def test_payload_continues_identically_in_a_fresh_process(kind, saved, model_path, tmp_path):
    (tmp_path / "state.dsv4").write_bytes(saved.payload)
    out = tmp_path / "logits.pt"
    tokens = ",".join(map(str, CONTINUE))
    args = [kind.name, kind.runs_on, str(model_path), str(tmp_path / "state.dsv4"), tokens, str(out)]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *args], env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert torch.equal(torch.load(out), saved.continued)


def test_kv_cache_round_trip_continues_identically(backend, saved, model_path):
    """A new KVStore over the directory (a restarted server) finds the state by its rendered prefix."""
    store = kv_store(saved.store_dir, model_path, backend.new_state)
    longer = store.render_key(PROMPT[: START + len(CONTINUE)])
    hit = store.lookup(longer)
    assert hit is not None and hit.state.pos == START and hit.state.tokens == PROMPT[:START]
    assert torch.equal(continue_with(backend, hit.state, CONTINUE), saved.continued)


def test_a_fork_continues_identically_on_both_sides(backend, state_at_start, saved):
    """A fork of the state (sharing its row pages where the backend's cache block has room), then
    both continue with the same tokens: each gives the uninterrupted run's logits exactly, whichever
    writes first into the page they share (the ratio-4 rows' first page is partly filled)."""
    state = state_at_start()
    twin = copy.deepcopy(state)
    # the reference and Triton take 4 sequences to a block by default, MLX one (forks there copy)
    assert (twin.block == state.block) == (state.cache.block_slots > 1)
    if twin.block == state.block:  # the rows are shared, not copied
        assert (twin.row_pages(4).host[twin.index] == state.row_pages(4).host[state.index]).all()
    assert torch.equal(continue_with(backend, twin, CONTINUE), saved.continued)
    assert torch.equal(continue_with(backend, state, CONTINUE), saved.continued)
