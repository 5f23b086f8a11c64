"""Model states of shared prompt prefixes for training: run once without autograd, forked per sample.

A step's tool round trips share one ~420-token tools prefix, run afresh at each step. An agent
prompt is 4-12k tokens, which the reference model takes seconds to run: its state is kept and
reused for `max_age` steps before it is run again with the current weights. The rows it holds are
detached, as at inference, so only their age differs from a fresh run: the samples learn to read
a prefix written by weights at most `max_age` optimizer steps older than theirs.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from dwarfstar.model.forward import Transformer


def run_prefixes(model: Transformer, prefixes: Mapping[bytes, torch.Tensor]) -> dict[bytes, object]:
    """A fresh state for each prefix (model-local ids), run without autograd and unobserved (the
    indexer and router observers see only the trained tokens)."""
    states = {key: model.new_state() for key in prefixes}
    if not prefixes:
        return states
    observers = model.ops.indexer_observer, model.ops.route_observer
    model.ops.indexer_observer = model.ops.route_observer = None
    try:
        with torch.no_grad():
            model.hidden_batch(list(prefixes.values()), list(states.values()), False)
    finally:
        model.ops.indexer_observer, model.ops.route_observer = observers
    return states


class PrefixStates:
    """Kept states of long prefixes, each run again once it is `max_age` steps old."""

    def __init__(self, max_age: int) -> None:
        self.max_age = max_age
        self.kept: dict[bytes, tuple[int, object]] = {}
        self.runs = 0  # prefixes run, for the log

    def fork(self, model: Transformer, key: bytes, ids: torch.Tensor, step: int) -> object:
        """A copy of `key`'s state, run first if missing or too old."""
        kept = self.kept.get(key)
        if kept is None or step - kept[0] >= self.max_age:
            kept = (step, run_prefixes(model, {key: ids})[key])
            self.kept[key] = kept
            self.runs += 1
        return copy.deepcopy(kept[1])
