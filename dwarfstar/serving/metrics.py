"""Server counters and gauges, served at `/metrics` in the Prometheus text format (version 0.0.4)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from enum import Enum, unique

from dwarfstar.experts.store import ExpertStore
from dwarfstar.experts.telemetry import summary as expert_summary

COUNTER, GAUGE = "counter", "gauge"


@unique  # two members with the same type and help would silently be one
class Metric(Enum):
    """Every metric the server reports, with its type and help text. `/metrics` lists them all from the
    start (at 0); `Metrics` takes nothing else, so a metric cannot be reported without being declared."""

    REQUESTS_TOTAL = COUNTER, "Generation requests accepted, by API."
    REJECTED_REQUESTS_TOTAL = COUNTER, "Requests answered with an error status, by status."
    FINISHED_REQUESTS_TOTAL = COUNTER, "Generations finished, by finish reason."
    CANCELLED_REQUESTS_TOTAL = COUNTER, "Generations stopped because the client left, by phase."
    FAILED_REQUESTS_TOTAL = COUNTER, "Generations that failed inside the engine."
    LOOP_GUARD_TOTAL = COUNTER, "Loop guard interventions, by kind (repetition, tool_note, tool_stop)."
    INVALID_TOOL_CALLS_TOTAL = COUNTER, "Tool-call blocks the parser gave up, answered as text."
    PROMPT_TOKENS_TOTAL = COUNTER, "Prompt tokens of admitted requests."
    IMAGES_TOTAL = COUNTER, "Images in admitted requests (serve --vision)."
    IMAGES_ENCODED_TOTAL = COUNTER, "Images run through the vision encoder (the others came from its cache)."
    CACHED_TOKENS_TOTAL = COUNTER, "Prompt tokens reused from a live session or the disk cache."
    PREFILL_TOKENS_TOTAL = COUNTER, "Prompt tokens run through the model."
    GENERATED_TOKENS_TOTAL = COUNTER, "Tokens generated."
    PREFILL_SECONDS_TOTAL = COUNTER, "Time spent in prefill."
    DECODE_SECONDS_TOTAL = COUNTER, "Time spent in decode steps."
    PREFILL_TOKENS_PER_SECOND = GAUGE, "Prefill rate of the last prompt slice."
    DECODE_TOKENS_PER_SECOND = GAUGE, "Aggregate decode rate over all requests of the last step."
    DECODE_STEPS_TOTAL = COUNTER, "Batched decode steps."
    BATCHED_DECODE_STEPS_TOTAL = COUNTER, "Decode steps that advanced more than one request."
    DECODE_BATCH_MAX = GAUGE, "Largest number of requests advanced in one decode step."
    SPECULATIVE_STEPS_TOTAL = COUNTER, "Draft-verify rounds of requests (serve --mtp), one per request."
    DRAFT_TOKENS_TOTAL = COUNTER, "MTP draft tokens verified."
    ACCEPTED_DRAFT_TOKENS_TOTAL = COUNTER, "MTP draft tokens accepted."
    CACHE_LOOKUPS_TOTAL = COUNTER, "Where each request's session came from (memory, fork, disk, cold)."
    QUEUE_DEPTH = GAUGE, "Requests waiting for a session."
    ACTIVE_REQUESTS = GAUGE, "Requests holding a session (prefill or decode)."
    LIVE_SESSIONS = GAUGE, "Live KV sessions in memory."
    SESSION_BYTES = GAUGE, "Bytes held by the live KV sessions."
    # with --ssd-streaming (`expert_collector`); 0 without
    EXPERT_HITS_TOTAL = COUNTER, "Routed-expert uses served from the expert cache."
    EXPERT_MISSES_TOTAL = COUNTER, "Routed-expert uses read from the model file."
    EXPERT_EVICTIONS_TOTAL = COUNTER, "Experts evicted from the expert cache."
    EXPERT_READ_BYTES_TOTAL = COUNTER, "Bytes of routed experts read from the model file."
    EXPERT_READ_BUSY_SECONDS_TOTAL = COUNTER, "Wall time with at least one expert read in flight."
    EXPERT_STALL_SECONDS_TOTAL = COUNTER, "Time the compute waited for expert reads."
    EXPERT_HIT_RATE = GAUGE, "Expert cache hits over uses since the start."
    EXPERT_READ_BYTES_PER_TOKEN = GAUGE, "Expert bytes read per token since the start."
    EXPERT_READ_GBPS = GAUGE, "Expert read rate: bytes over read busy time, GB/s."
    EXPERT_MISS_LATENCY_SECONDS = GAUGE, "Expert miss latency (request to bytes), by quantile."
    EXPERT_RESIDENT = GAUGE, "Experts in the expert cache."
    EXPERT_CAPACITY = GAUGE, "Experts the expert cache's budget holds."
    EXPERT_LAYER_HITS_TOTAL = COUNTER, "Routed-expert cache hits, by layer."
    EXPERT_LAYER_MISSES_TOTAL = COUNTER, "Routed-expert cache misses, by layer."
    EXPERT_LAYER_READ_BYTES_TOTAL = COUNTER, "Bytes of routed experts read from the file, by layer."

    @property
    def key(self) -> str:
        """Its name in /metrics: `dwarfstar_` and the member's name in lower case."""
        return "dwarfstar_" + self.name.lower()

    @property
    def kind(self) -> str:
        return self.value[0]

    @property
    def help(self) -> str:
        return self.value[1]


Labels = tuple[tuple[str, str], ...]


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[Labels, float]] = {metric.key: {} for metric in Metric}
        # called at each render, to copy in figures kept elsewhere (the expert cache's telemetry)
        self.collectors: list[Callable[[Metrics], None]] = []

    def inc(self, metric: Metric, value: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._values[metric.key]
            series[key] = series.get(key, 0.0) + float(value)

    def set(self, metric: Metric, value: float, **labels: str) -> None:
        with self._lock:
            self._values[metric.key][tuple(sorted(labels.items()))] = float(value)

    def raise_to(self, metric: Metric, value: float) -> None:
        with self._lock:
            series = self._values[metric.key]
            series[()] = max(series.get((), 0.0), float(value))

    def value(self, name: str, **labels: str) -> float:
        """A series' value, by its name in /metrics."""
        with self._lock:
            return self._values[name].get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> str:
        for collect in self.collectors:
            collect(self)
        lines: list[str] = []
        with self._lock:
            for metric in Metric:
                name = metric.key
                lines += [f"# HELP {name} {metric.help}", f"# TYPE {name} {metric.kind}"]
                series = self._values[name] or {(): 0.0}
                for labels, value in sorted(series.items()):
                    label_text = ",".join(f'{k}="{v}"' for k, v in labels)
                    number = str(int(value)) if value.is_integer() else repr(value)
                    lines.append(f"{name}{{{label_text}}} {number}" if labels else f"{name} {number}")
        return "\n".join(lines) + "\n"


QUANTILES = {"0.5": "miss_latency_p50_ms", "0.99": "miss_latency_p99_ms"}  # of the expert miss latency


def expert_collector(store: ExpertStore) -> Callable[[Metrics], None]:
    """A `Metrics` collector copying the expert cache's figures (--ssd-streaming) in at each `/metrics` render."""

    def collect(metrics: Metrics) -> None:
        figures = expert_summary(store)
        stats = store.stats
        for metric, value in (
            (Metric.EXPERT_HITS_TOTAL, stats.hits),
            (Metric.EXPERT_MISSES_TOTAL, stats.misses),
            (Metric.EXPERT_EVICTIONS_TOTAL, stats.evictions),
            (Metric.EXPERT_READ_BYTES_TOTAL, stats.bytes_read),
            (Metric.EXPERT_READ_BUSY_SECONDS_TOTAL, stats.busy_seconds),
            (Metric.EXPERT_STALL_SECONDS_TOTAL, stats.stall_seconds),
            (Metric.EXPERT_HIT_RATE, stats.hit_rate),
            (Metric.EXPERT_READ_BYTES_PER_TOKEN, figures["bytes_per_token"]),
            (Metric.EXPERT_READ_GBPS, stats.read_gbps),
            (Metric.EXPERT_RESIDENT, len(store.where)),
            (Metric.EXPERT_CAPACITY, store.capacity),
        ):
            metrics.set(metric, value)
        for quantile, field in QUANTILES.items():
            metrics.set(Metric.EXPERT_MISS_LATENCY_SECONDS, figures[field] / 1e3, quantile=quantile)
        # per layer, labelled: a layer whose experts miss more than the others shows up here
        for il, counts in enumerate(stats.layers):
            metrics.set(Metric.EXPERT_LAYER_HITS_TOTAL, counts.hits, layer=str(il))
            metrics.set(Metric.EXPERT_LAYER_MISSES_TOTAL, counts.misses, layer=str(il))
            metrics.set(Metric.EXPERT_LAYER_READ_BYTES_TOTAL, counts.bytes_read, layer=str(il))

    return collect
