"""What one replica knows about a deployment's health: its breaker, latency and load."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.routing.breaker import BreakerSettings, CircuitBreaker

EWMA_ALPHA = 0.2  # weight of the newest sample: about the last ten requests matter


@dataclass
class DeploymentHealth:
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    latency_ewma_s: float | None = None  # time to the upstream's first byte
    in_flight: int = 0
    successes: int = 0
    failures: int = 0

    @classmethod
    def with_settings(cls, settings: BreakerSettings) -> DeploymentHealth:
        return cls(breaker=CircuitBreaker(settings))

    def observe_latency(self, seconds: float) -> None:
        if self.latency_ewma_s is None:
            self.latency_ewma_s = seconds
        else:
            self.latency_ewma_s += EWMA_ALPHA * (seconds - self.latency_ewma_s)

    def succeeded(self, latency_s: float) -> None:
        self.successes += 1
        self.observe_latency(latency_s)
        self.breaker.record_success()

    def failed(self) -> None:
        self.failures += 1
        self.breaker.record_failure()

    def public(self) -> dict[str, object]:
        snap = self.breaker.snapshot()
        return {
            "breaker": {"state": snap.state, "recent_failures": snap.recent_failures,
                        "retry_in_s": snap.retry_in_s, "times_opened": snap.times_opened},
            "latency_ewma_ms": None if self.latency_ewma_s is None
            else round(self.latency_ewma_s * 1000, 3),
            "in_flight": self.in_flight, "successes": self.successes, "failures": self.failures,
        }
