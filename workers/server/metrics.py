"""Prometheus metrics of one worker, on a registry per app.

Request outcomes and latency histograms are recorded as requests finish; the engine's gauges
(queue, running, KV use) and counters (preemptions, adapter loads) are read at scrape time,
so the step loop does no metrics work. No label carries a tenant or adapter name, which keeps
cardinality bounded whatever the fleet serves.

Beside ours, the figures schedulers built for vLLM read (the Gateway API Inference Extension's
endpoint picker, llm-d, KServe, vLLM's production stack), under vLLM's names and labels:
`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (0 to 1;
also as the older `vllm:gpu_cache_usage_perc`), `vllm:num_preemptions_total`,
`vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total` (tokens), each labelled
`model_name` and `engine`; `vllm:cache_config_info` (block size and blocks); and, when adapters
are served, `vllm:lora_requests_info` (its value the scrape's wall-clock time, as vLLM's is
the last update's). Its `running_lora_adapters` lists the adapters with requests in flight
that sit in device slots, `waiting_lora_adapters` those with requests whose adapter is not on
the device yet (in host memory or on disk), `max_lora` the device slots. This one does carry
adapter names, as vLLM's does: at most the adapters with requests in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from workers.engine.sequence import RequestMetrics
from workers.lora.manager import AdapterStatus

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


# Engine stats key -> (vLLM's metric name, its help, is a counter), labelled like vLLM's.
VLLM_FIGURES: dict[str, tuple[str, str, bool]] = {
    "num_running": ("vllm:num_requests_running",
                    "Number of requests in model execution batches.", False),
    "num_waiting": ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    False),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc",
                       "KV-cache usage. 1 means 100 percent usage.", False),
    "num_preemptions": ("vllm:num_preemptions", "Cumulative number of preemption from the "
                        "engine.", True),
    "prefix_cache_queried_tokens": ("vllm:prefix_cache_queries", "Prefix cache queries, in "
                                    "terms of number of queried tokens.", True),
    "prefix_cache_hit_tokens": ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of "
                                "number of cached tokens.", True),
}
LEGACY_KV = ("vllm:gpu_cache_usage_perc", "GPU KV-cache usage (the name before "
             "vllm:kv_cache_usage_perc). 1 means 100 percent usage.")
VLLM_LABELS = ["model_name", "engine"]


@dataclass(frozen=True, slots=True)
class EngineShape:
    """What vLLM's info gauges describe: the KV cache and, when adapters are on, the slots."""

    block_size: int
    num_blocks: int
    prefix_caching: bool
    max_loras: int | None  # None: adapters off


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


class _VllmCollector(Collector):
    """vLLM's names for the same figures, for schedulers written against vLLM."""

    def __init__(self, stats: Callable[[], dict[str, float]], model_name: str,
                 shape: Callable[[], EngineShape | None],
                 adapters: Callable[[], list[AdapterStatus]]) -> None:
        self._stats = stats
        self._labels = [model_name, "0"]
        self._shape = shape
        self._adapters = adapters

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for key, (name, doc, counter) in VLLM_FIGURES.items():
            if key in stats:
                yield self._family(name, doc, counter, stats[key])
        if "kv_cache_usage" in stats:
            yield self._family(*LEGACY_KV, False, stats["kv_cache_usage"])
        shape = self._shape()
        if shape is None:  # not loaded yet
            return
        info = GaugeMetricFamily("vllm:cache_config_info",
                                 "Information of the LLMEngine CacheConfig",
                                 labels=[*VLLM_LABELS, "block_size", "num_gpu_blocks",
                                         "enable_prefix_caching"])
        info.add_metric([*self._labels, str(shape.block_size), str(shape.num_blocks),
                         str(shape.prefix_caching)], 1.0)
        yield info
        if shape.max_loras is not None:
            yield _lora_info(shape.max_loras, self._adapters())

    def _family(self, name: str, doc: str, counter: bool, value: float) -> Metric:
        family = (CounterMetricFamily if counter else GaugeMetricFamily)(
            name, doc, labels=VLLM_LABELS)
        family.add_metric(self._labels, float(value))
        return family


def _lora_info(max_loras: int, adapters: list[AdapterStatus]) -> Metric:
    """vLLM's `vllm:lora_requests_info`: the adapters in use as comma-joined label values."""
    busy = sorted((a for a in adapters if a.num_requests > 0), key=lambda a: a.name)
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                               labels=["running_lora_adapters", "max_lora",
                                       "waiting_lora_adapters"])
    family.add_metric([",".join(a.name for a in busy if a.tier == "device"), str(max_loras),
                       ",".join(a.name for a in busy if a.tier != "device")], time.time())
    return family


class WorkerMetrics:
    def __init__(self, stats: Callable[[], dict[str, float]], *, model_name: str = "",
                 shape: Callable[[], EngineShape | None] = lambda: None,
                 adapters: Callable[[], list[AdapterStatus]] = list) -> None:
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
        self.registry.register(_VllmCollector(stats, model_name, shape, adapters))

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
