"""Turn a key, a deployment and a call into one atomic limits-and-budget reservation."""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import datetime
from typing import TYPE_CHECKING

from starlette.requests import Request

from gateway.budgets import tenant_budget
from gateway.deployments.base import Call
from gateway.deployments.config import Price
from gateway.errors import APIError, unavailable
from gateway.observability.metrics import OTHER
from gateway.observability.tracing import annotate
from tenancy.context import KeyContext
from tenancy.limits import AdmissionRequest, Decision, Limits

if TYPE_CHECKING:
    from gateway.state import GatewayState


def admission_request(
    *, request_id: str, key: KeyContext, call: Call, price: Price, exact: bool = True,
    now: datetime | None = None,
) -> AdmissionRequest:
    """The call's admission. Not `exact` (an estimate, the prompt not tokenized yet): it is
    checked, not held; `admit_exactly` reserves the exact count once it is known."""
    plan = key.plan
    budget = None
    if plan.budget_micros is not None:
        budget = tenant_budget(key.tenant_id, plan.budget_micros, plan.budget_period, now)
    return AdmissionRequest(request_id=request_id, scopes=limit_scopes(key), budget=budget,
                            hold=exact, **reserved(call, price))


def reserved(call: Call, price: Price) -> dict[str, int]:
    """What a call reserves: its prompt and most output against TPM, their price against
    the budget."""
    return {"tokens": call.prompt_tokens + call.max_output_tokens,
            "cost_micros": price.cost_micros(call.prompt_tokens, call.max_output_tokens)}


def limit_scopes(key: KeyContext) -> tuple[tuple[str, Limits], ...]:
    """The key's own limits, then its tenant's plan's."""
    plan = key.plan
    return (
        (f"key:{key.key_id}", Limits(rpm=key.rpm, tpm=key.tpm, max_concurrent=key.max_concurrent)),
        (f"tenant:{key.tenant_id}",
         Limits(rpm=plan.rpm, tpm=plan.tpm, max_concurrent=plan.max_concurrent)),
    )


def ratelimit_headers(decision: Decision) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers, from whichever limits apply."""
    headers: dict[str, str] = {}
    if decision.limit_requests is not None:
        headers["x-ratelimit-limit-requests"] = str(decision.limit_requests)
        headers["x-ratelimit-remaining-requests"] = str(max(0, decision.remaining_requests or 0))
        headers["x-ratelimit-reset-requests"] = _duration(decision.reset_requests_s)
    if decision.limit_tokens is not None:
        headers["x-ratelimit-limit-tokens"] = str(decision.limit_tokens)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, decision.remaining_tokens or 0))
        headers["x-ratelimit-reset-tokens"] = _duration(decision.reset_tokens_s)
    return headers


def refusal(decision: Decision) -> APIError:
    """The client-facing error for a refused admission."""
    if decision.reason == "unavailable":
        return unavailable("Rate limiting is unavailable; try again shortly.",
                           code="limiter_unavailable")
    headers = ratelimit_headers(decision)
    headers["retry-after"] = str(max(1, math.ceil(decision.retry_after_s)))
    scope = (decision.scope or "").split(":", 1)[0] or "key"
    if decision.reason == "budget":
        return APIError(429, "You exceeded your current quota: the spend budget for this "
                        "period is used up.", type_="insufficient_quota",
                        code="insufficient_quota", headers=headers)
    what = {"rpm": "requests per minute", "tpm": "tokens per minute",
            "concurrency": "concurrent requests"}.get(decision.reason or "", "requests")
    return APIError(429, f"Rate limit reached for {what} on this {scope}. Please retry after "
                    f"{headers['retry-after']}s.", type_=decision.reason or "requests",
                    code="rate_limit_exceeded", headers=headers)


def _duration(seconds: float | None) -> str:
    seconds = max(0.0, seconds or 0.0)
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest}s"


async def admit(gw: GatewayState, admission: AdmissionRequest, *, key: KeyContext,
                model: str, adapter: bool) -> Decision:
    """Reserve, in the request's `limits` span; a refusal is counted and raised (429/503)."""
    with gw.tracing.span("limits") as limits:
        decision = await gw.limiter.admit(admission)
        annotate(limits, {"switchboard.admitted": decision.admitted,
                          "switchboard.refused_by": decision.reason})
    if not decision.admitted:
        raise refused(gw, key, decision, gw.metrics.model_label(model, adapter=adapter))
    return decision


async def admit_exactly(gw: GatewayState, admission: AdmissionRequest, *, call: Call,
                        price: Price, key: KeyContext, model: str,
                        adapter: bool) -> tuple[AdmissionRequest, Decision]:
    """Admission's second step, once the prompt is tokenized: the exact count is reserved,
    atomically against TPM and the budget (the first step checked an estimate and held only
    the request). A refusal gives the request's slot back and is raised (429), before any
    work; so what is metered overshoots a limit by at most one request, whatever the
    alphabet."""
    exact = replace(admission, hold=True, **reserved(call, price))
    with gw.tracing.span("limits") as limits:
        decision = await gw.limiter.resize(exact)
        annotate(limits, {"switchboard.admitted": decision.admitted,
                          "switchboard.refused_by": decision.reason})
    if not decision.admitted:
        gw.spawn(gw.limiter.settle(exact, tokens=0, cost_micros=0))
        raise refused(gw, key, decision, gw.metrics.model_label(model, adapter=adapter))
    return exact, decision


def refused(gw: GatewayState, key: KeyContext, decision: Decision, model: str) -> APIError:
    """Count a refusal, remember it for the hold (RPM only), and give the error to raise."""
    gw.metrics.refused(tenant=key.tenant_id, reason=decision.reason, model=model)
    gw.refusals.remember(decision)
    return refusal(decision)


@contextlib.asynccontextmanager
async def counted_if_refused(gw: GatewayState, key: KeyContext) -> AsyncIterator[None]:
    """Around what an authenticated request goes through before admission (parsing,
    routing, the cheap context bound): a request refused there with a 4xx still counts
    against its key's and tenant's RPM. Else bodies refused by a cheap check (an oversized
    prompt, bad JSON) could be sent without limit, each one read and parsed. Once over the
    RPM the 429 replaces the 4xx, and the hold (`refuse_if_held`) keeps the next ones from
    being parsed at all. Nothing else is reserved, and an unavailable limiter keeps the 4xx."""
    try:
        yield
    except APIError as exc:
        if 400 <= exc.status < 500:
            await _count_request(gw, key, exc)
        raise


async def _count_request(gw: GatewayState, key: KeyContext, error: APIError) -> None:
    admission = AdmissionRequest(request_id=f"refused-{uuid.uuid4().hex}",
                                 scopes=limit_scopes(key), tokens=0)
    decision = await gw.limiter.admit(admission)
    if decision.admitted:
        await gw.limiter.settle(admission, tokens=0, cost_micros=0)
    elif decision.reason == "rpm":
        raise refused(gw, key, decision, OTHER) from error


async def refuse_if_held(gw: GatewayState, request: Request, key: KeyContext) -> None:
    """Before the body is parsed: a key (or tenant) refused for RPM a moment ago is refused
    again, once the hold is over (gateway/recent_refusals.py). Its body is received and
    dropped, unparsed (the body guard still bounds it): answered before the client has sent
    it all, the closed connection would reach the client as a reset instead of this 429. The
    model is not known yet."""
    held = gw.refusals.refusal(key)
    if held is None:
        return
    async for _ in request.stream():
        pass
    await asyncio.sleep(held.hold_left_s)
    gw.metrics.refused(tenant=key.tenant_id, reason=held.decision.reason, model=OTHER)
    raise refusal(held.decision)
