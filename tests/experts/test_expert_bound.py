"""The independent-reference bound on the synthetic skewed trace: inclusion probabilities of a weighted
draw without replacement, checked against enumerating the draws; no online policy passes the bound
on an i.i.d. trace; `bench experts-bound` reports it next to the policies."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.experts.bound import inclusion_probabilities, online_bound, zipf_weights
from dwarfstar.experts.replay import simulate
from dwarfstar.experts.routing_trace import skewed_trace

_register_commands()


def enumerated_inclusion(w: np.ndarray, k: int) -> np.ndarray:
    """P(e drawn) summed over every ordered draw of k: each pick proportional to the weight left."""
    q = np.zeros(len(w))
    for order in itertools.permutations(range(len(w)), k):
        p, left = 1.0, 1.0
        for e in order:
            p *= w[e] / left
            left -= w[e]
        q[list(order)] += p
    return q


@pytest.mark.parametrize("k", [1, 2, 3])
def test_inclusion_probabilities_match_the_enumerated_draws(k):
    w = np.array([0.4, 0.25, 0.15, 0.12, 0.08])
    np.testing.assert_allclose(inclusion_probabilities(w, k), enumerated_inclusion(w, k), atol=1e-6)


def test_the_bound_takes_the_largest_probabilities_of_every_layer():
    # two layers of [0.5, 0.3, 0.2]: three slots hold 0.5, 0.5 and 0.3 of a token's 2.0 uses
    assert online_bound(np.array([0.2, 0.5, 0.3]), 2, 3) == pytest.approx(1.3 / 2.0)
    assert online_bound(np.array([0.2, 0.5, 0.3]), 2, 6) == pytest.approx(1.0)


def test_no_online_policy_passes_the_bound_on_an_iid_trace():
    layers, experts, k, tokens = 2, 8, 2, 600
    trace = skewed_trace(layers, experts, k, tokens, zipf=1.0, drift_every=tokens + 1, seed=5)
    q = inclusion_probabilities(zipf_weights(experts, 1.0), k)
    for capacity in (2, 4, 6):
        bound = online_bound(q, layers, capacity)
        # 2,400 uses: a hit rate's sampling error is about 0.01, so 0.03 is three of them
        for name in ("ds4", "lfu", "lru"):
            assert simulate(trace, capacity, name).stats.hit_rate <= bound + 0.03, (name, capacity)
    # Belady knows the order of the draws, so it can pass the bound (0.68 against 0.64 here)
    assert simulate(trace, 6, "belady").stats.hit_rate > online_bound(q, layers, 6) + 0.02


def test_bench_experts_bound_reports_each_budget(tmp_path):
    out = tmp_path / "bound.json"
    args = ["bench", "experts-bound", "--layers", "2", "--experts", "8", "--k", "2", "--tokens", "100"]
    done = CliRunner().invoke(app, [*args, "--budgets", "25,100", "--json", str(out)])
    assert done.exit_code == 0, done.output
    low, full = json.loads(out.read_text())["rows"]
    assert (low["capacity"], full["capacity"]) == (4, 16) and full["online_bound"] == 1.0
    for kind in ("iid", "drift"):
        assert low[f"{kind}_ds4"] <= low[f"{kind}_belady"] and full[f"{kind}_goal_reachable"] is True
        assert low[f"{kind}_goal_reachable"] == (low["online_bound"] >= 0.9 * low[f"{kind}_belady"])
