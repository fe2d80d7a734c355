"""Prometheus metrics of one gateway process, on a registry of its own.

The registry is not prometheus_client's global one: tests build many apps in one process, and
each app's figures must start from zero. Label values are bounded: the first `tenant_cap`
tenants (and `model_cap` models, ...) keep their own label, later ones are counted as `other`,
so a flood of new tenants cannot grow the series without limit. Breaker state, in-flight
requests and engine figures are read from the deployments at scrape time, never pushed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from gateway.deployments.registry import DeploymentRegistry

PREFIX = "switchboard"
OTHER = "other"
BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_NOT_NAME = re.compile(r"[^a-zA-Z0-9_]")


class CappedLabel:
    """A label's values: the first `cap` distinct ones as they are, any later one as `other`."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) < self.cap:
            self._seen.add(value)
            return value
        return OTHER


class GatewayMetrics:
    """Counters and histograms fed by the request path, plus the deployments at scrape time."""

    def __init__(self, deployments: DeploymentRegistry | None = None, *, tenant_cap: int = 500,
                 model_cap: int = 200, deployment_cap: int = 200, code_cap: int = 50) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.tenant = CappedLabel(tenant_cap)
        self.model = CappedLabel(model_cap)
        self.deployment = CappedLabel(deployment_cap)
        self.code = CappedLabel(code_cap)
        reg = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "Completions by how they ended.",
                                ["tenant", "model", "status", "cache"], registry=reg)
        self.tokens = Counter(f"{PREFIX}_tokens", "Billed tokens (cached: prefix-cache hits).",
                              ["tenant", "model", "kind"], registry=reg)
        self.cost = Counter(f"{PREFIX}_cost_micro_usd", "Charged cost in micro-USD.",
                            ["tenant"], registry=reg)
        self.ttft = Histogram(f"{PREFIX}_ttft_seconds", "Arrival to first byte (answered).",
                              ["model"], buckets=LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram(f"{PREFIX}_request_seconds", "Arrival to last byte (answered).",
                             ["model"], buckets=LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram(f"{PREFIX}_tpot_seconds", "Time per output token after the "
                              "first (streamed answers).", ["model"], buckets=TPOT_BUCKETS,
                              registry=reg)
        self.rejections = Counter(f"{PREFIX}_ratelimit_rejections", "Admissions refused.",
                                  ["reason"], registry=reg)
        self.cache_lookups = Counter(f"{PREFIX}_cache_lookups", "Response cache lookups.",
                                     ["kind", "result"], registry=reg)
        self.attempts = Counter(f"{PREFIX}_upstream_attempts", "Calls sent to a deployment.",
                                ["deployment"], registry=reg)
        self.upstream_errors = Counter(f"{PREFIX}_upstream_errors", "Failed upstream calls.",
                                       ["deployment", "code"], registry=reg)
        # Bound children by label values: `labels()` costs more than the increment itself.
        self._requests: dict[tuple[str, str, str, str], Any] = {}
        self._series: dict[tuple[str, str], _Series] = {}
        if deployments is not None:
            reg.register(DeploymentCollector(deployments, self.deployment))

    def model_label(self, model: str, *, adapter: bool) -> str:
        """Adapters are per tenant: counted under their base model, never by their name."""
        return self.model(f"{model}:adapter" if adapter else model)

    def finished(self, *, tenant: str, model: str, status: str, cache: str,
                 prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                 cost_micros: int, ttft_s: float | None, total_s: float,
                 streamed: bool) -> None:
        """One admitted request is over (`model` already labelled by `model_label`)."""
        tenant = self.tenant(tenant)
        key = (tenant, model, status, cache)
        request = self._requests.get(key)
        if request is None:
            request = self._requests[key] = self.requests.labels(*key)
        request.inc()
        series = self._series.get((tenant, model))
        if series is None:
            series = self._series[(tenant, model)] = _Series(self, tenant, model)
        if prompt_tokens:
            series.prompt.inc(prompt_tokens)
        if completion_tokens:
            series.completion.inc(completion_tokens)
        if cached_tokens:
            series.cached.inc(cached_tokens)
        if cost_micros:
            series.cost.inc(cost_micros)
        if status != "ok":
            return  # latencies of answers only: failures would blur them
        ttft = total_s if ttft_s is None else ttft_s
        series.ttft.observe(ttft)
        series.e2e.observe(total_s)
        if streamed and cache == "none" and completion_tokens > 1:
            series.tpot.observe((total_s - ttft) / (completion_tokens - 1))

    def refused(self, *, tenant: str, model: str, reason: str | None) -> None:
        self.rejections.labels(reason or "unknown").inc()
        self.requests.labels(self.tenant(tenant), model, "refused", "none").inc()

    def cache_lookup(self, kinds: Iterable[str], hit: str | None) -> None:
        """`kinds`: the lookups made in order (exact, semantic); `hit`: the kind that hit."""
        for kind in kinds:
            self.cache_lookups.labels(kind, "hit" if kind == hit else "miss").inc()
            if kind == hit:
                return

    def attempt(self, deployment: str, error_code: str | None = None) -> None:
        """An upstream call ended; `error_code` when it failed."""
        name = self.deployment(deployment)
        self.attempts.labels(name).inc()
        if error_code is not None:
            self.upstream_errors.labels(name, self.code(error_code)).inc()

    def render(self) -> bytes:
        """The Prometheus text format of everything, as of now."""
        return generate_latest(self.registry)


class _Series:
    """The children of one (tenant, model): bounded, as both labels are capped."""

    __slots__ = ("cached", "completion", "cost", "e2e", "prompt", "tpot", "ttft")

    def __init__(self, metrics: GatewayMetrics, tenant: str, model: str) -> None:
        self.prompt = metrics.tokens.labels(tenant, model, "prompt")
        self.completion = metrics.tokens.labels(tenant, model, "completion")
        self.cached = metrics.tokens.labels(tenant, model, "cached")
        self.cost = metrics.cost.labels(tenant)
        self.ttft = metrics.ttft.labels(model)
        self.e2e = metrics.e2e.labels(model)
        self.tpot = metrics.tpot.labels(model)


class DeploymentCollector(Collector):
    """Breaker state, in-flight calls and engine figures of each deployment, at scrape time."""

    def __init__(self, deployments: DeploymentRegistry, label: CappedLabel) -> None:
        self.deployments = deployments
        self.label = label

    def describe(self) -> Iterable[Metric]:
        return []  # names are only known at scrape time; nothing is collected at registration

    def collect(self) -> Iterator[Metric]:
        breaker = GaugeMetricFamily(f"{PREFIX}_breaker_state", "Circuit breaker: 0 closed, "
                                    "1 half_open, 2 open.", labels=["deployment"])
        in_flight = GaugeMetricFamily(f"{PREFIX}_upstream_in_flight", "Calls in flight.",
                                      labels=["deployment"])
        engine: dict[str, GaugeMetricFamily] = {}
        for deployment in self.deployments.deployments():
            name = self.label(deployment.name)
            health = self.deployments.health(deployment.name)
            breaker.add_metric([name], BREAKER_STATES.get(health.breaker.state, 2))
            in_flight.add_metric([name], health.in_flight)
            try:
                stats = deployment.stats()
            except Exception:  # an engine not (yet) running: no figures
                stats = {}
            for key, value in stats.items():
                if not isinstance(value, int | float):
                    continue
                metric_name = f"{PREFIX}_engine_{_NOT_NAME.sub('_', key)}"
                family = engine.get(metric_name)
                if family is None:
                    family = engine[metric_name] = GaugeMetricFamily(
                        metric_name, f"Figure {key!r} of an engine or a polled worker.",
                        labels=["deployment"])
                family.add_metric([name], float(value))
        yield breaker
        yield in_flight
        yield from engine.values()
