"""The expert cache's telemetry where a server or a run reports it: `/metrics` and `--trace`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dwarfstar.experts.store import ExpertStore

if TYPE_CHECKING:
    from dwarfstar.serving.metrics import Metrics

QUANTILES = {"0.5": "miss_latency_p50_ms", "0.99": "miss_latency_p99_ms"}


def summary(store: ExpertStore) -> dict[str, Any]:
    """The figures of `run`'s exit line and its `--trace` record (with `per_layer`: each layer's counts)."""
    return store.stats.summary(len(store.where), store.capacity)


def collector(store: ExpertStore) -> Callable[[Metrics], None]:
    """A `Metrics` collector copying the store's figures in at each `/metrics` render."""

    def collect(metrics: Metrics) -> None:
        figures = summary(store)
        stats = store.stats
        for name, value in (
            ("hits_total", stats.hits),
            ("misses_total", stats.misses),
            ("evictions_total", stats.evictions),
            ("read_bytes_total", stats.bytes_read),
            ("read_busy_seconds_total", stats.busy_seconds),
            ("stall_seconds_total", stats.stall_seconds),
            ("hit_rate", stats.hit_rate),
            ("read_bytes_per_token", figures["bytes_per_token"]),
            ("read_gbps", stats.read_gbps),
            ("resident", len(store.where)),
            ("capacity", store.capacity),
        ):
            metrics.set(f"dwarfstar_expert_{name}", value)
        for quantile, field in QUANTILES.items():
            metrics.set("dwarfstar_expert_miss_latency_seconds", figures[field] / 1e3, quantile=quantile)
        # per layer, labelled: a layer whose experts miss more than the others shows up here
        for il, counts in enumerate(stats.layers):
            metrics.set("dwarfstar_expert_layer_hits_total", counts.hits, layer=str(il))
            metrics.set("dwarfstar_expert_layer_misses_total", counts.misses, layer=str(il))
            metrics.set("dwarfstar_expert_layer_read_bytes_total", counts.bytes_read, layer=str(il))

    return collect
