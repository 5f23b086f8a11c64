"""The policy simulator: recorded routing replayed through the cache's bookkeeping, checking ds4's
invariants (pinned never evicted, the current token's experts protected, decay, recency ties) and
Belady's optimum as the floor of every policy's misses."""

from __future__ import annotations

import numpy as np
import pytest

from dwarfstar.backends.reference.model import ReferenceModel
from dwarfstar.experts.layout import ExpertLayout
from dwarfstar.experts.policy import FrequencyPolicy, LRUPolicy, make_policy
from dwarfstar.experts.replay import frequency_oracle, replay, simulate
from dwarfstar.experts.routing_trace import RoutingTrace, TraceError, TraceRecorder, skewed_trace
from dwarfstar.experts.store import ExpertCache, ExpertStore
from dwarfstar.model.loader import open_model

PROMPT = [0, 300, 17, 4242, 99, 12001, 7, 8, 9, 600]


def record(path, decode_steps: int) -> RoutingTrace:
    """A prefill call then greedy decode on the reference, routing recorded."""
    model_file = open_model(path)
    model = ReferenceModel(model_file)
    recorder = TraceRecorder(model.args.n_layers, model.args.n_routed_experts)
    model.ops.route_observer = recorder
    state = model.new_state()
    logits = model.forward(PROMPT, state, all_logits=False)
    for _ in range(decode_steps):
        logits = model.forward([int(logits[-1].argmax())], state, all_logits=False)
    return recorder.trace()


@pytest.fixture(scope="module")
def nano_trace(nano_path) -> RoutingTrace:
    return record(nano_path, 40)


@pytest.fixture(scope="module")
def skewed() -> RoutingTrace:
    return skewed_trace(n_layers=4, n_experts=32, k=3, n_tokens=300, zipf=1.0, drift_every=50, seed=1)


class Checked:
    """A policy whose every eviction is checked against the cache's pins and protection."""

    def __init__(self, inner):
        self.inner, self.name, self.protects = inner, inner.name, inner.protects
        self.evictions, self.protected_evictions = [], 0

    def seed(self, counts):
        self.inner.seed(counts)

    def used(self, key):
        self.inner.used(key)

    def preloaded(self, key):
        self.inner.preloaded(key)

    def evicted(self, key):
        self.inner.evicted(key)

    def victim(self, resident, pinned, protected):
        key = self.inner.victim(resident, pinned, protected)
        assert key in resident and key not in pinned
        if key in protected:  # a protecting policy: only when everything else is protected or pinned
            assert not self.protects or all(k in protected or k in pinned for k in resident)
            self.protected_evictions += 1
        self.evictions.append(key)
        return key


def checked_run(trace: RoutingTrace, capacity: int, name: str) -> tuple[ExpertCache, Checked]:
    n_keys = trace.n_layers * trace.n_experts
    inner = make_policy(name, n_keys, trace.accesses() if name == "belady" else None)
    policy = Checked(inner)
    cache = ExpertCache(trace.n_layers, trace.n_experts, trace.k, capacity, policy)
    return replay(cache, trace), policy


@pytest.mark.parametrize("name", ["ds4", "lfu", "lru", "belady"])
@pytest.mark.parametrize("trace_name", ["nano_trace", "skewed"])
def test_invariants_hold_on_recorded_traces(request, trace_name, name):
    trace = request.getfixturevalue(trace_name)
    token_set = trace.n_layers * trace.k
    for capacity in (trace.k, token_set, token_set + trace.n_experts):
        cache, policy = checked_run(trace, capacity, name)
        uses = len(trace.accesses())
        assert cache.stats.hits + cache.stats.misses == uses
        assert cache.stats.misses == len(policy.evictions) + len(cache.where)  # each miss filled a slot
        assert len(cache.where) <= capacity
        decode = RoutingTrace(trace.ids[trace.calls[0] :], trace.calls[1:], trace.n_experts)
        if capacity >= token_set and policy.protects:
            # in decode, a cache that holds a whole token's experts never evicts one of the current token's
            assert checked_run(decode, capacity, name)[1].protected_evictions == 0


@pytest.mark.parametrize("trace_name", ["nano_trace", "skewed"])
def test_belady_is_the_floor(request, trace_name):
    trace = request.getfixturevalue(trace_name)
    total = trace.n_layers * trace.n_experts
    for capacity in (trace.k, total // 4, total // 2):
        best = simulate(trace, capacity, "belady").stats.misses
        for name in ("ds4", "lfu", "lru"):
            assert best <= simulate(trace, capacity, name).stats.misses


def test_counts_halve_every_period():
    policy = FrequencyPolicy(4, halve_every=5)
    for key in (0, 0, 0, 0, 1):
        policy.used(key)
    assert policy.counts.tolist() == [2, 0, 0, 0]  # 4 and 1, halved at the 5th use
    for key in (2, 2, 2, 2, 2):
        policy.used(key)
    assert policy.counts.tolist() == [1, 0, 2, 0]  # [2, 0, 5, 0] at the 10th use, halved


def test_smallest_count_leaves_and_ties_go_to_the_least_recent():
    policy = FrequencyPolicy(4)
    for key in (0, 0, 0, 1, 2, 3):
        policy.used(key)
    # 1, 2, 3 have one use each: the least recent (1) leaves, not 0 although it is the oldest
    assert policy.victim({0, 1, 2, 3}, pinned=set(), protected=set()) == 1
    policy.evicted(1)
    assert policy.victim({0, 2, 3}, pinned={2}, protected=set()) == 3  # pinned 2 is skipped
    assert policy.victim({0, 2, 3}, pinned={2}, protected={3}) == 0  # protected 3 yields to 0
    assert policy.victim({0, 2, 3}, pinned={0, 2}, protected={3}) == 3  # nothing else: protection gives


def test_halving_lets_recency_decide_between_faded_counts():
    policy = FrequencyPolicy(3, halve_every=6)
    for key in (0, 0, 0, 1, 1, 2):  # counts 3, 2, 1, then halved at the 6th use: 1, 1, 0
        policy.used(key)
    assert policy.victim({0, 1, 2}, set(), set()) == 2
    policy.evicted(2)
    assert policy.victim({0, 1}, set(), set()) == 0  # without the halving 1 (count 2 < 3) would leave


def test_seeded_counts_keep_the_hot_experts():
    policy = FrequencyPolicy(4)
    policy.seed(np.array([0, 50, 0, 0]))
    for key in (1, 0, 2):
        policy.used(key)
    assert policy.victim({0, 1, 2}, set(), set()) == 0  # 1 was used first but the profile says it is hot
    lru = LRUPolicy()
    for key in (1, 0, 2):
        lru.used(key)
    assert lru.victim({0, 1, 2}, set(), set()) == 1


def test_simulator_and_store_agree(tiny_k_path):
    """The bookkeeping-only replay counts exactly the hits and misses the real store has."""
    model_file = open_model(tiny_k_path)
    trace = skewed_trace(model_file.args.n_layers, model_file.args.n_routed_experts, 2, 60, zipf=1.0, seed=4)
    layout = ExpertLayout.of(model_file.gguf, model_file.args)
    for name in ("ds4", "lru"):
        store = ExpertStore(layout, 10, make_policy(name, layout.total_experts))
        try:
            replay(store, trace)
        finally:
            store.close()
        sim = simulate(trace, 10, name)
        assert (store.stats.hits, store.stats.misses) == (sim.stats.hits, sim.stats.misses)
        assert store.stats.bytes_read == store.stats.misses * layout.max_expert_bytes  # one layout for all layers


def test_trace_round_trip_and_bad_files(tmp_path, skewed):
    path = tmp_path / "t.npz"
    skewed.save(path)
    back = RoutingTrace.load(path, skewed.n_layers, skewed.n_experts)
    assert np.array_equal(back.ids, skewed.ids) and np.array_equal(back.calls, skewed.calls)
    assert back.counts().sum() == skewed.n_tokens * skewed.n_layers * skewed.k
    with pytest.raises(TraceError, match="the model has"):
        RoutingTrace.load(path, skewed.n_layers + 1, skewed.n_experts)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(TraceError, match="not a routing trace"):
        RoutingTrace.load(tmp_path / "junk.npz")


def test_frequency_oracle_keeps_the_most_used():
    # one layer, k = 1: uses 0 0 1 0 2 1; a cache of 2 keeps 0 (3 uses) and 1 (2 uses), each missing once
    ids = np.array([0, 0, 1, 0, 2, 1], dtype=np.int16).reshape(6, 1, 1)
    trace = RoutingTrace(ids, np.ones(6, dtype=np.int64), 4)
    assert frequency_oracle(trace, 2) == 3 / 6
    assert frequency_oracle(trace, 4) == 3 / 6  # 2 is used once: holding it gains nothing
    assert frequency_oracle(trace, 1) == 2 / 6


def test_lfu_admits_by_frequency_where_ds4_protects():
    """A cold expert the current token just used leaves before a hot one under lfu; ds4 protects it."""
    for protect, want in ((True, 0), (False, 1)):
        policy = FrequencyPolicy(4, protect=protect)
        for key in (0, 0, 0, 1):
            policy.used(key)
        assert policy.name == ("ds4" if protect else "lfu")
        assert policy.victim({0, 1}, pinned=set(), protected={1}) == want
        assert policy.victim({0, 1}, pinned={0}, protected={1}) == 1  # pins hold for both
