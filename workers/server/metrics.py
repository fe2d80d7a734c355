"""Prometheus metrics of one worker, on a registry per app.

Request outcomes and latency histograms are recorded as requests finish; the engine's gauges
(queue, running, KV use) and counters (preemptions, adapter loads) are read at scrape time,
so the step loop does no metrics work. No label carries a tenant or adapter name, which keeps
cardinality bounded whatever the fleet serves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from workers.engine.sequence import RequestMetrics

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
STATUSES = ("ok", "aborted", "invalid", "overloaded", "error", "draining")

# Engine stats key -> (metric name, help, is a counter).
ENGINE_FIGURES: dict[str, tuple[str, str, bool]] = {
    "num_waiting": ("switchboard_worker_requests_waiting", "requests queued for the engine", False),
    "num_running": ("switchboard_worker_requests_running", "requests in the running batch", False),
    "kv_cache_usage": ("switchboard_worker_kv_cache_usage_ratio",
                       "fraction of KV cache blocks in use", False),
    "num_preemptions": ("switchboard_worker_preemptions", "sequences preempted", True),
    "num_grammar_errors": ("switchboard_worker_grammar_errors",
                           "samples failed: a structured-output grammar refused its own "
                           "masked token", True),
    "prefix_cache_hit_rate": ("switchboard_worker_prefix_cache_hit_ratio",
                              "prompt tokens served from the prefix cache / queried", False),
    "num_loras": ("switchboard_worker_adapters_registered", "adapters registered", False),
    "num_loras_on_device": ("switchboard_worker_adapters_on_device",
                            "adapters in device slots", False),
    "lora_device_loads": ("switchboard_worker_adapter_loads", "adapter copies into slots", True),
    "lora_device_evictions": ("switchboard_worker_adapter_device_evictions",
                              "adapters evicted from device slots", True),
    "lora_cpu_evictions": ("switchboard_worker_adapter_cpu_evictions",
                           "adapters evicted from host memory to disk", True),
    "spec_proposed_tokens": ("switchboard_worker_spec_proposed_tokens",
                             "speculative decoding: tokens proposed", True),
    "spec_accepted_tokens": ("switchboard_worker_spec_accepted_tokens",
                             "speculative decoding: proposed tokens the model kept", True),
}
# Per proposal position (1 = the first token proposed in a step), from `spec_position_<i>_*`.
SPEC_POSITIONS = {
    "proposed": ("switchboard_worker_spec_position_proposed_tokens",
                 "speculative decoding: tokens proposed at this position"),
    "accepted": ("switchboard_worker_spec_position_accepted_tokens",
                 "speculative decoding: tokens kept at this position"),
}


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for key, (name, doc, counter) in ENGINE_FIGURES.items():
            if key not in stats:
                continue
            family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc)
            family.add_metric([], float(stats[key]))
            yield family
        yield from _positions(stats)


def _positions(stats: dict[str, float]) -> Iterator[Metric]:
    """Acceptance by proposal position, as counters labelled `position` (at most k labels)."""
    for kind, (name, doc) in SPEC_POSITIONS.items():
        family = CounterMetricFamily(name, doc, labels=["position"])
        for key, value in stats.items():
            head, _, tail = key.partition("spec_position_")
            position, _, suffix = tail.partition("_")
            if not head and suffix == kind:
                family.add_metric([position], float(value))
        if family.samples:
            yield family


class WorkerMetrics:
    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("switchboard_worker_requests", "requests by kind and outcome",
                                ["kind", "status"], registry=self.registry)
        self.prompt_tokens = Counter("switchboard_worker_prompt_tokens", "prompt tokens",
                                     registry=self.registry)
        self.generation_tokens = Counter("switchboard_worker_generation_tokens",
                                         "generated tokens", registry=self.registry)
        self.queue = Histogram("switchboard_worker_queue_time_seconds", "arrival to first step",
                               buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("switchboard_worker_time_to_first_token_seconds",
                              "arrival to first token", buckets=LATENCY_BUCKETS,
                              registry=self.registry)
        self.tpot = Histogram("switchboard_worker_time_per_output_token_seconds",
                              "mean time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("switchboard_worker_e2e_request_latency_seconds",
                             "arrival to finish", buckets=LATENCY_BUCKETS, registry=self.registry)
        for kind in ("chat", "completion"):
            for status in STATUSES:
                self.requests.labels(kind, status)
        self.registry.register(_EngineCollector(stats))

    def observe(self, *, kind: str, status: str, metrics: RequestMetrics | None,
                prompt_tokens: int, completion_tokens: int) -> None:
        self.requests.labels(kind, status).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if metrics is None:
            return
        for histogram, value in ((self.queue, metrics.queue_time), (self.ttft, metrics.ttft),
                                 (self.tpot, metrics.tpot)):
            if value is not None:
                histogram.observe(value)
        if metrics.finished_time is not None:
            self.e2e.observe(metrics.finished_time - metrics.arrival_time)
