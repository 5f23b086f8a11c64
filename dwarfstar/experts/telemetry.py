"""The expert cache's figures where a run reports them (its exit line and `--trace`); a server's `/metrics`
copies them in with `dwarfstar.serving.metrics.expert_collector`."""

from __future__ import annotations

from typing import Any

from dwarfstar.experts.store import ExpertStore


def summary(store: ExpertStore) -> dict[str, Any]:
    """The figures of `run`'s exit line and its `--trace` record (with `per_layer`: each layer's counts)."""
    return store.stats.summary(len(store.where), store.capacity)
