"""Server counters and gauges, served at `/metrics` in the Prometheus text format (version 0.0.4)."""

from __future__ import annotations

import threading
from collections.abc import Callable

# name: (type, help). Every metric the server reports is declared here, so /metrics lists them all
# from the start (at 0) and a typo in a name fails loudly instead of creating a new series.
METRICS: dict[str, tuple[str, str]] = {
    "dwarfstar_requests_total": ("counter", "Generation requests accepted, by API."),
    "dwarfstar_rejected_requests_total": ("counter", "Requests answered with an error status, by status."),
    "dwarfstar_finished_requests_total": ("counter", "Generations finished, by finish reason."),
    "dwarfstar_cancelled_requests_total": ("counter", "Generations stopped because the client left, by phase."),
    "dwarfstar_failed_requests_total": ("counter", "Generations that failed inside the engine."),
    "dwarfstar_prompt_tokens_total": ("counter", "Prompt tokens of admitted requests."),
    "dwarfstar_cached_tokens_total": ("counter", "Prompt tokens reused from a live session or the disk cache."),
    "dwarfstar_prefill_tokens_total": ("counter", "Prompt tokens run through the model."),
    "dwarfstar_generated_tokens_total": ("counter", "Tokens generated."),
    "dwarfstar_prefill_seconds_total": ("counter", "Time spent in prefill."),
    "dwarfstar_decode_seconds_total": ("counter", "Time spent in decode steps."),
    "dwarfstar_prefill_tokens_per_second": ("gauge", "Prefill rate of the last prompt slice."),
    "dwarfstar_decode_tokens_per_second": ("gauge", "Aggregate decode rate over all requests of the last step."),
    "dwarfstar_decode_steps_total": ("counter", "Batched decode steps."),
    "dwarfstar_batched_decode_steps_total": ("counter", "Decode steps that advanced more than one request."),
    "dwarfstar_decode_batch_max": ("gauge", "Largest number of requests advanced in one decode step."),
    "dwarfstar_speculative_steps_total": ("counter", "Draft-verify rounds of requests (serve --mtp), one per request."),
    "dwarfstar_draft_tokens_total": ("counter", "MTP draft tokens verified."),
    "dwarfstar_accepted_draft_tokens_total": ("counter", "MTP draft tokens accepted."),
    "dwarfstar_cache_lookups_total": ("counter", "Where each request's session came from (memory, fork, disk, cold)."),
    "dwarfstar_queue_depth": ("gauge", "Requests waiting for a session."),
    "dwarfstar_active_requests": ("gauge", "Requests holding a session (prefill or decode)."),
    "dwarfstar_live_sessions": ("gauge", "Live KV sessions in memory."),
    "dwarfstar_session_bytes": ("gauge", "Bytes held by the live KV sessions."),
    # with --ssd-streaming (`dwarfstar.experts.telemetry`); 0 without
    "dwarfstar_expert_hits_total": ("counter", "Routed-expert uses served from the expert cache."),
    "dwarfstar_expert_misses_total": ("counter", "Routed-expert uses read from the model file."),
    "dwarfstar_expert_evictions_total": ("counter", "Experts evicted from the expert cache."),
    "dwarfstar_expert_read_bytes_total": ("counter", "Bytes of routed experts read from the model file."),
    "dwarfstar_expert_read_busy_seconds_total": ("counter", "Wall time with at least one expert read in flight."),
    "dwarfstar_expert_stall_seconds_total": ("counter", "Time the compute waited for expert reads."),
    "dwarfstar_expert_hit_rate": ("gauge", "Expert cache hits over uses since the start."),
    "dwarfstar_expert_read_bytes_per_token": ("gauge", "Expert bytes read per token since the start."),
    "dwarfstar_expert_read_gbps": ("gauge", "Expert read rate: bytes over read busy time, GB/s."),
    "dwarfstar_expert_miss_latency_seconds": ("gauge", "Expert miss latency (request to bytes), by quantile."),
    "dwarfstar_expert_resident": ("gauge", "Experts in the expert cache."),
    "dwarfstar_expert_capacity": ("gauge", "Experts the expert cache's budget holds."),
    "dwarfstar_expert_layer_hits_total": ("counter", "Routed-expert cache hits, by layer."),
    "dwarfstar_expert_layer_misses_total": ("counter", "Routed-expert cache misses, by layer."),
    "dwarfstar_expert_layer_read_bytes_total": ("counter", "Bytes of routed experts read from the file, by layer."),
}

Labels = tuple[tuple[str, str], ...]


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[Labels, float]] = {name: {} for name in METRICS}
        # called at each render, to copy in figures kept elsewhere (the expert cache's telemetry)
        self.collectors: list[Callable[[Metrics], None]] = []

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._values[name]
            series[key] = series.get(key, 0.0) + float(value)

    def set(self, name: str, value: float, **labels: str) -> None:
        with self._lock:
            self._values[name][tuple(sorted(labels.items()))] = float(value)

    def raise_to(self, name: str, value: float) -> None:
        with self._lock:
            series = self._values[name]
            series[()] = max(series.get((), 0.0), float(value))

    def value(self, name: str, **labels: str) -> float:
        with self._lock:
            return self._values[name].get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> str:
        for collect in self.collectors:
            collect(self)
        lines: list[str] = []
        with self._lock:
            for name, (kind, text) in METRICS.items():
                lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
                series = self._values[name] or {(): 0.0}
                for labels, value in sorted(series.items()):
                    label_text = ",".join(f'{k}="{v}"' for k, v in labels)
                    number = str(int(value)) if value.is_integer() else repr(value)
                    lines.append(f"{name}{{{label_text}}} {number}" if labels else f"{name} {number}")
        return "\n".join(lines) + "\n"
