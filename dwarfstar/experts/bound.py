"""The best hit rate any online policy can expect on a synthetic skewed trace: the independent-reference bound.

`skewed_trace` draws each token's k experts of a layer as a weighted sample without replacement
(Gumbel top-k, i.e. Plackett-Luce), independently of every other layer and token given the layer's
current ranking; its drift only permutes which expert holds which weight. Then, for a cache that
loads an expert only when it is used (every policy behind `Policy`: demand paging), the expected
hits of one token are at most the C largest inclusion probabilities q_e:

* the layer-m experts the cache holds when layer m is served are a subset of those it held before
  the token's layer 0 (between the two, only other layers' experts can come in), and those held
  before layer 0 are at most C in all;
* layer m's draw is independent of everything the policy has seen (the past tokens and the token's
  earlier layers), so the expected hits of layer m are the sum of q_e over the experts it holds;
* drift permutes the weights, so the sum of the C largest q is the same at every token.

Summed over the tokens, the expected hit rate is at most (the C largest q) / (n_layers x k), the
uses of a token: the independent-reference model's result (Aho, Denning and Ullman, 1971: under
independent references the optimal online policy keeps the most probable pages, A0). Belady's
optimum knows the order of the future draws as well, so it can pass this bound; no online policy can
in expectation. Where 0.9 x Belady is above the bound, "within 10% of Belady" is out of reach.
"""

from __future__ import annotations

import numpy as np

QUADRATURE_POINTS = 4000  # log-spaced times of the exponential race: the q sum to k within 1e-6


def zipf_weights(n_experts: int, zipf: float) -> np.ndarray:
    """The popularity `skewed_trace` gives the expert of each rank, normalized to sum to 1."""
    weight = 1.0 / np.arange(1, n_experts + 1) ** zipf
    return weight / weight.sum()


def inclusion_probabilities(weights: np.ndarray, k: int, points: int = QUADRATURE_POINTS) -> np.ndarray:
    """P(expert e is among the k drawn), for k draws without replacement proportional to `weights`.

    Gumbel top-k is an exponential race: expert e arrives at an Exp(w_e) time and the k earliest are
    drawn, so P(e drawn) = integral over t of w_e exp(-w_e t) P(fewer than k others arrived by t) dt,
    with the others arriving independently (a Poisson-binomial count, built up expert by expert).
    The integral runs over log t, which covers the fastest and the slowest experts' times alike.
    """
    w = np.asarray(weights, dtype=np.float64)
    # from where even the fastest expert has arrived with probability 1e-9 to where the slowest has but e^-60
    log_t = np.linspace(np.log(1e-9 / w.max()), np.log(60.0 / w.min()), points)
    t = np.exp(log_t)
    arrived = -np.expm1(-np.outer(w, t))  # [expert, time]: P(arrived by t)
    density = w[:, None] * np.exp(-np.outer(w, t)) * t[None, :]  # d/dlog t of P(e arrives by t)
    q = np.empty(len(w))
    for e in range(len(w)):
        count = np.zeros((k, points))  # P(exactly c of the others arrived by t), c < k
        count[0] = 1.0
        for j in range(len(w)):
            if j != e:
                p = arrived[j]
                count[1:] = count[1:] * (1 - p) + count[:-1] * p
                count[0] *= 1 - p
        q[e] = np.trapezoid(density[e] * count.sum(axis=0), log_t)
    return q


def online_bound(q: np.ndarray, n_layers: int, capacity: int) -> float:
    """The expected hit rate no online demand-paging policy can pass with `capacity` experts, when every
    layer's inclusion probabilities are `q` (in some order): the C largest of all layers' q over the
    uses of a token (the sum of all of them)."""
    everything = np.sort(np.tile(q, n_layers))[::-1]
    return float(everything[:capacity].sum() / everything.sum())
