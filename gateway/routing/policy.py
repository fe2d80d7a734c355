"""Order a route's deployments for one request: the cheapest healthy one that can serve it
first, latency-aware among equals, and for LoRA requests those holding the adapter first.

Pure functions over what the registry knows, so the choice is testable without a network.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gateway.deployments.base import Deployment
from gateway.features import Refusal, unsupported
from gateway.routing.health import DeploymentHealth
from workers.protocol.requests import OpenAIRequest

# Where an adapter lives on a deployment, best first; anything else (not registered) is last.
RESIDENCY_RANK = {"device": 0, "cpu": 1, "disk": 2}


# Ties' lottery: one generator for the process (a new one per request seeded itself from
# os.urandom, 1-2% of a request's CPU).
_RNG = random.Random()


@dataclass(frozen=True, slots=True)
class Needs:
    """What the request needs of a deployment."""

    logprobs: bool = False
    adapter: str | None = None  # the adapter's engine name, for affinity
    request: OpenAIRequest | None = None  # its fields, each of which the deployment must serve
    # deployment name -> prompt tokens its prefix cache holds (prefix-aware routing)
    cached_tokens: Mapping[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0  # the prompt's length, where prefix-aware routing tokenized it


@dataclass(frozen=True, slots=True)
class Ranked:
    """The deployments to try in order, and why others were left out (for the error)."""

    order: list[Deployment]
    incapable: int = 0
    unhealthy: int = 0
    busy: int = 0
    retry_in_s: float | None = None  # the soonest a left-out breaker allows a probe
    refusal: tuple[str, Refusal] | None = None  # the first deployment left out for a field


def refusal_of(deployment: Deployment, needs: Needs) -> Refusal | None:
    """The field of the request this deployment cannot serve, if any."""
    if needs.logprobs and not deployment.config.capabilities.logprobs:
        return Refusal("logprobs", "is not supported by the model")
    if needs.request is None:
        return None
    return unsupported(deployment.config, needs.request)


def rank(deployments: Sequence[Deployment], health: Callable[[str], DeploymentHealth],
         needs: Needs, *, policy: str, rng: random.Random | None = None) -> Ranked:
    rng = rng or _RNG
    usable: list[Deployment] = []
    incapable = unhealthy = busy = 0
    retry_in: float | None = None
    first_refusal: tuple[str, Refusal] | None = None
    for d in deployments:
        h = health(d.name)
        refused = refusal_of(d, needs)
        if refused is not None or (needs.adapter is not None and not d.serves_adapters):
            incapable += 1
            if refused is not None and first_refusal is None:
                first_refusal = (d.name, refused)
        elif not d.accepting:
            unhealthy += 1
        elif not h.breaker.available():
            unhealthy += 1
            snap = h.breaker.snapshot()
            if snap.retry_in_s is not None:
                retry_in = snap.retry_in_s if retry_in is None else min(retry_in, snap.retry_in_s)
        elif d.config.max_concurrency is not None and h.in_flight >= d.config.max_concurrency:
            busy += 1
        else:
            usable.append(d)
    if policy == "cost":
        usable = _by_cost(usable, health, needs, rng)
    elif needs.adapter is not None:
        usable.sort(key=lambda d: _residency(d, needs.adapter))  # stable: config order next
    return Ranked(usable, incapable, unhealthy, busy, retry_in, first_refusal)


def _by_cost(usable: list[Deployment], health: Callable[[str], DeploymentHealth],
             needs: Needs, rng: random.Random) -> list[Deployment]:
    """Adapter residency, then price, then load less cached prefix, then expected latency
    under load per unit of weight; ties (e.g. nothing measured yet) are broken at random in
    proportion to weight.

    Load is what a worker reports (queued requests plus KV use, a second old at most) plus
    this replica's own requests in flight there, which are always current. A worker holding
    the request's prompt prefix gets one unit of load off per `prefix_load_penalty_tokens`
    cached tokens: the longest cached prefix wins among equally loaded workers, and loses to
    a worker idle enough to recompute it sooner. Where a worker reports its KV working set
    (`kv_room`), the tokens the prompt's uncached part would push out of that set count
    against it the same way: they are someone's next turn, recomputed later. So new chats go
    where the pool has room, and a chat whose worker overflows may move to one that has."""
    measured = [h.latency_ewma_s for d in usable
                if (h := health(d.name)).latency_ewma_s is not None]
    unknown = min(measured) if measured else 0.0  # untried deployments look as good as the best

    def key(d: Deployment) -> tuple[int, object, float, float, float]:
        h = health(d.name)
        latency = h.latency_ewma_s if h.latency_ewma_s is not None else unknown
        expected = latency * (1 + h.in_flight) / d.config.weight
        reported = d.load()
        pressure = 0.0 if reported is None else (reported + h.in_flight) / d.config.weight
        lottery = -rng.random() ** (1.0 / d.config.weight)  # weighted random order
        residency = _residency(d, needs.adapter) if needs.adapter is not None else 0
        cached = needs.cached_tokens.get(d.name, 0)
        saved = cached - _evicted(d, needs.prompt_tokens - cached)
        affinity = saved / d.config.prefix_load_penalty_tokens
        return (residency, d.price.per_1m, round(pressure - affinity, 2), round(expected, 4),
                lottery)

    return sorted(usable, key=key)


def _evicted(deployment: Deployment, new_tokens: int) -> int:
    """Tokens of the deployment's KV working set that `new_tokens` more would push out: what
    they need beyond the pool's room (0 where the worker reports no working set)."""
    room = deployment.kv_room() if new_tokens > 0 else None
    if room is None:
        return 0
    hot, capacity = room
    return max(0, min(new_tokens, hot + new_tokens - capacity))


def _residency(deployment: Deployment, adapter: str | None) -> int:
    where = deployment.adapter_residency(adapter) if adapter is not None else None
    return RESIDENCY_RANK.get(where or "", len(RESIDENCY_RANK))
