"""Ordering deployments for a request: capability, health, cost, latency, weight, affinity."""

from __future__ import annotations

import random
from decimal import Decimal
from typing import Any

from gateway.deployments.config import DeploymentConfig
from gateway.deployments.http import HttpDeployment
from gateway.deployments.http_pool import HttpPool
from gateway.routing.health import DeploymentHealth
from gateway.routing.policy import Needs, rank


class Adapterful(HttpDeployment):
    """An HTTP deployment that claims adapters, with a fixed residency table (policy only)."""

    def __init__(self, config: DeploymentConfig, residency: dict[str, str]) -> None:
        super().__init__(config, HttpPool(max_connections=1))
        self.residency = residency

    @property
    def serves_adapters(self) -> bool:
        return True

    def adapter_residency(self, engine_name: str) -> str | None:
        return self.residency.get(engine_name)


def dep(name: str, price: str = "1", **more: Any) -> HttpDeployment:
    config = DeploymentConfig(name=name, model_name="m", provider="openai",
                              base_url="http://127.0.0.1:9/v1", input_price_per_1m=Decimal(price),
                              output_price_per_1m=Decimal(price), **more)
    return HttpDeployment(config, HttpPool(max_connections=1))


class Healths(dict[str, DeploymentHealth]):
    def __missing__(self, name: str) -> DeploymentHealth:
        self[name] = DeploymentHealth()
        return self[name]


def names(deployments: list[Any]) -> list[str]:
    return [d.name for d in deployments]


def test_cost_policy_puts_the_cheapest_first() -> None:
    ds = [dep("a", "3"), dep("b", "1"), dep("c", "2")]
    ranked = rank(ds, Healths().__getitem__, Needs(), policy="cost")
    assert names(ranked.order) == ["b", "c", "a"]


def test_ordered_policy_keeps_the_configured_order() -> None:
    ds = [dep("a", "3"), dep("b", "1"), dep("c", "2")]
    ranked = rank(ds, Healths().__getitem__, Needs(), policy="ordered")
    assert names(ranked.order) == ["a", "b", "c"]


def test_open_breakers_and_full_deployments_are_left_out() -> None:
    health = Healths()
    ds = [dep("a", "1"), dep("b", "2", max_concurrency=2), dep("c", "3")]
    for _ in range(5):
        health["a"].failed()
    health["b"].in_flight = 2
    ranked = rank(ds, health.__getitem__, Needs(), policy="cost")
    assert names(ranked.order) == ["c"]
    assert (ranked.unhealthy, ranked.busy, ranked.incapable) == (1, 1, 0)
    assert ranked.retry_in_s is not None and ranked.retry_in_s > 0


def test_latency_decides_among_equal_prices() -> None:
    health = Healths()
    ds = [dep("slow"), dep("fast"), dep("pricier", "5")]
    health["slow"].observe_latency(0.200)
    health["fast"].observe_latency(0.020)
    health["pricier"].observe_latency(0.001)
    ranked = rank(ds, health.__getitem__, Needs(), policy="cost")
    assert names(ranked.order) == ["fast", "slow", "pricier"]


def test_load_counts_against_latency() -> None:
    health = Healths()
    ds = [dep("x"), dep("y")]
    health["x"].observe_latency(0.010)
    health["y"].observe_latency(0.015)
    health["x"].in_flight = 3  # 10 ms x 4 > 15 ms x 1
    ranked = rank(ds, health.__getitem__, Needs(), policy="cost")
    assert names(ranked.order) == ["y", "x"]


def test_weight_splits_ties_in_proportion() -> None:
    ds = [dep("light", weight=1), dep("heavy", weight=3)]
    rng = random.Random(7)
    firsts = [rank(ds, Healths().__getitem__, Needs(), policy="cost", rng=rng).order[0].name
              for _ in range(2000)]
    share = firsts.count("heavy") / len(firsts)
    assert 0.70 < share < 0.80  # 3 / (3 + 1)


def test_logprobs_need_the_capability() -> None:
    ds = [dep("nolp", "1", capabilities={"logprobs": False}), dep("lp", "2")]
    ranked = rank(ds, Healths().__getitem__, Needs(logprobs=True), policy="cost")
    assert names(ranked.order) == ["lp"] and ranked.incapable == 1


def test_adapter_requests_prefer_where_the_adapter_lives() -> None:
    cfg = {"input_price_per_1m": Decimal(1), "output_price_per_1m": Decimal(1)}

    def adapterful(name: str, price: str, residency: dict[str, str]) -> Adapterful:
        config = DeploymentConfig(name=name, model_name="m", provider="openai",
                                  base_url="http://127.0.0.1:9/v1", **{
                                      **cfg, "input_price_per_1m": Decimal(price)})
        return Adapterful(config, residency)

    ds = [adapterful("cheap-cold", "1", {}), adapterful("on-cpu", "2", {"t/a": "cpu"}),
          adapterful("on-device", "3", {"t/a": "device"}), dep("plain", "0")]
    ranked = rank(ds, Healths().__getitem__, Needs(adapter="t/a"), policy="cost")
    assert names(ranked.order) == ["on-device", "on-cpu", "cheap-cold"]
    assert ranked.incapable == 1
    other = rank(ds, Healths().__getitem__, Needs(adapter="t/b"), policy="cost")
    assert names(other.order) == ["cheap-cold", "on-cpu", "on-device"]


class Loaded(HttpDeployment):
    """An HTTP deployment reporting a fixed load and KV working set, as a worker's /stats
    would (policy only)."""

    def __init__(self, config: DeploymentConfig, load: float,
                 room: tuple[int, int] | None = None) -> None:
        super().__init__(config, HttpPool(max_connections=1))
        self._load = load
        self._room = room

    def load(self) -> float:
        return self._load

    def kv_room(self) -> tuple[int, int] | None:
        return self._room


def loaded(name: str, load: float, room: tuple[int, int] | None = None) -> Loaded:
    return Loaded(dep(name, prefix_load_penalty_tokens=256).config, load, room)


def test_cached_prefix_is_traded_against_load() -> None:
    """Score = load - cached tokens / 256: 512 cached tokens are worth two queued requests."""
    def first(load_a: float, load_b: float, cached_b: int) -> str:
        ds = [loaded("a", load_a), loaded("b", load_b)]
        needs = Needs(cached_tokens={"b": cached_b})
        return rank(ds, Healths().__getitem__, needs, policy="cost").order[0].name

    assert first(1.0, 1.0, 512) == "b"  # equal load: the cached prefix wins
    assert first(0.0, 1.5, 512) == "b"  # 1.5 - 2 < 0
    assert first(0.0, 3.0, 512) == "a"  # 3 - 2 > 0: recomputing on the idle one is sooner
    assert first(1.0, 0.0, 0) == "b"  # nothing cached: plain least-loaded


def test_what_a_prompt_would_evict_counts_against_its_worker() -> None:
    """Score = load - (cached - evicted) / 256, where evicted is what the uncached part of
    the prompt needs beyond the pool's room (working set + new tokens - pool)."""
    def first(a: tuple[float, tuple[int, int] | None], b: tuple[float, tuple[int, int] | None],
              cached_b: int = 0, prompt: int = 512) -> str:
        ds = [loaded("a", *a), loaded("b", *b)]
        needs = Needs(cached_tokens={"b": cached_b}, prompt_tokens=prompt)
        return rank(ds, Healths().__getitem__, needs, policy="cost").order[0].name

    full, roomy = (4000, 4096), (1000, 4096)
    # a new chat (nothing cached): equally loaded, it goes where it evicts nothing...
    assert first((1.0, full), (1.0, roomy)) == "b"
    assert first((1.0, roomy), (1.0, full)) == "a"
    # ...unless the roomy one is busier than the 416 evicted tokens are worth (1.6 units)
    assert first((0.0, full), (1.0, roomy)) == "b"
    assert first((0.0, full), (2.0, roomy)) == "a"
    # a follow-up: 1,024 tokens cached on a full b, 512 new ones that evict 416 of others'
    assert first((1.0, roomy), (1.0, full), cached_b=1024, prompt=1536) == "b"
    assert first((0.0, roomy), (1.0, full), cached_b=1024, prompt=1536) == "b"  # 1 < 2.375
    assert first((0.0, roomy), (3.0, full), cached_b=1024, prompt=1536) == "a"  # 3 > 2.375
    # a worker that reports no working set evicts nothing as far as routing knows
    assert first((1.0, None), (1.0, full)) == "a"
    assert first((1.0, full), (1.0, None)) == "b"
    # no prompt length (not tokenized): plain load and cached prefix, as before
    assert first((1.0, full), (1.0, full), cached_b=512, prompt=0) == "b"
