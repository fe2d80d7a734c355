"""Resolve what a request asked for to the deployments to try, in order.

A name is an alias (ordered deployments), `auto` (every deployment, by cost tier), a deployed
model, or one of the caller's own LoRA adapters. The key and plan narrow that to the models and
tiers they may use; a request may ask for a tier; the policy orders what is left.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from gateway.adapters.cache import AdapterCache
from gateway.deployments.base import AdapterRef, Deployment, engine_adapter_name
from gateway.deployments.registry import DeploymentRegistry
from gateway.errors import APIError, bad_request, forbidden, model_not_found, unavailable
from gateway.features import Refusal
from gateway.routing.policy import Needs, rank
from gateway.routing.prefix import PrefixMatch, cached_tokens
from tenancy.context import KeyContext
from workers.protocol.requests import OpenAIRequest


@dataclass(frozen=True, slots=True)
class RoutePlan:
    order: list[Deployment]  # to try in this order; fallbacks walk it
    adapter: AdapterRef | None
    model_key: str  # what the response cache keys on: the name asked, or base + adapter id


async def plan_route(registry: DeploymentRegistry, adapters: AdapterCache, key: KeyContext,
                     model: str, *, tier: str | None, logprobs: bool,
                     request: OpenAIRequest | None = None,
                     rng: random.Random | None = None) -> RoutePlan:
    """404 for models that don't exist (another tenant's adapter is exactly that); 403 for what
    the key or plan may not use; 400 for what no deployment can do; 503 when every deployment
    that could serve is unhealthy or full."""
    route = registry.route(model)
    adapter: AdapterRef | None = None
    chain = route.deployments
    model_key = model
    if not chain and not route.alias:
        found = await adapters.find(key.tenant_id, model)  # this tenant's only; cached
        if found is None:
            raise model_not_found(model)
        if not key.may_use_adapter(found.name):
            raise forbidden(f"Your API key is not allowed to use the adapter '{found.name}'.",
                            code="adapter_not_allowed")
        adapter = AdapterRef(found.id, engine_adapter_name(key.tenant_id, found.name),
                             found.path, found.pinned)
        chain = [d for d in registry.route(found.base_model).deployments if d.serves_adapters]
        model_key = f"{found.base_model}:{found.name}@{found.id}"
    if not chain:
        raise model_not_found(model)
    chain = _permitted(key, chain, asked=model, tier=tier)
    prefix = PrefixMatch() if adapter is not None else await cached_tokens(
        chain, request, tenant_id=key.tenant_id)
    needs = Needs(logprobs=logprobs, adapter=None if adapter is None else adapter.engine_name,
                  request=request, cached_tokens=prefix.cached,
                  prompt_tokens=prefix.prompt_tokens)
    ranked = rank(chain, registry.health, needs, policy=route.policy, rng=rng)
    if not ranked.order:
        raise _no_deployment(model, ranked.incapable, ranked.busy, ranked.retry_in_s,
                             total=len(chain), logprobs=logprobs, refusal=ranked.refusal)
    return RoutePlan(ranked.order, adapter, model_key)


def _permitted(key: KeyContext, chain: list[Deployment], *, asked: str, tier: str | None
               ) -> list[Deployment]:
    """The deployments the key may use: its model (or the alias it asked for) and the tiers
    of its plan, narrowed to the tier the request asked for."""
    by_model = [d for d in chain
                if key.may_use_model(d.config.model_name) or key.may_use_model(asked)]
    if not by_model:
        raise forbidden(f"Your API key is not allowed to use the model '{asked}'.",
                        code="model_not_allowed")
    if tier is not None and not key.may_use_tier(tier):
        raise forbidden(f"Your plan does not include the tier '{tier}'.",
                        code="tier_not_allowed")
    allowed = [d for d in by_model if key.may_use_tier(d.config.tier)]
    if not allowed:
        raise forbidden(f"Your plan does not include the tier that serves '{asked}'.",
                        code="tier_not_allowed")
    if tier is not None:
        allowed = [d for d in allowed if d.config.tier == tier]
        if not allowed:
            raise bad_request(f"No deployment of the tier '{tier}' serves '{asked}'.",
                              param="tier", code="tier_unavailable")
    return allowed


def _no_deployment(model: str, incapable: int, busy: int, retry_in_s: float | None, *,
                   total: int, logprobs: bool,
                   refusal: tuple[str, Refusal] | None = None) -> APIError:
    if incapable == total and refusal is not None:
        name, why = refusal
        return bad_request(f"Unsupported parameter: '{why.param}' {why.reason} "
                           f"(model '{model}', deployment '{name}').", param=why.param,
                           code="unsupported_parameter")
    if incapable == total:
        what = "logprobs" if logprobs else "this request"
        return bad_request(f"No deployment of '{model}' supports {what}.",
                           param="logprobs" if logprobs else None, code="unsupported_parameter")
    if busy:
        error = unavailable(f"Every deployment of '{model}' is at its concurrency limit; "
                            "retry shortly.", code="deployments_busy")
        error.headers["retry-after"] = "1"
        return error
    error = unavailable(f"Every deployment of '{model}' is failing; retry later.",
                        code="no_healthy_deployment")
    error.headers["retry-after"] = str(max(1, math.ceil(retry_in_s or 1)))
    return error
