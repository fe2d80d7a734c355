"""Budgets: reserve the maximum cost, refuse past the cap, reconcile at settle."""

from __future__ import annotations

import asyncio

from tenancy.limits import AdmissionRequest, Budget, Limiter, Limits

CAP = 1000
COST = 300
BUDGET = Budget(scope="tenant:t", cap_micros=CAP, period="2026-11", period_ttl_s=3600)
SCOPES = (("key:a", Limits(rpm=1000)), ("tenant:t", Limits(rpm=1000, max_concurrent=100)))


def request(n: int, budget: Budget = BUDGET, cost: int = COST) -> AdmissionRequest:
    return AdmissionRequest(f"r{n}", SCOPES, tokens=10, cost_micros=cost, budget=budget)


async def test_concurrent_admits_overshoot_by_at_most_one_request(limiter: Limiter) -> None:
    requests = [request(n) for n in range(40)]
    decisions = await asyncio.gather(*(limiter.admit(r) for r in requests))
    admitted = [r for r, d in zip(requests, decisions, strict=True) if d.admitted]
    refused = [d for d in decisions if not d.admitted]
    assert len(admitted) == 4  # 0, 300, 600, 900 are below the cap; 1200 is not
    assert {(d.reason, d.scope) for d in refused} == {("budget", "tenant:t")}
    spent = await limiter.spent_micros(BUDGET)
    assert spent == 1200 and spent - CAP < COST

    for r in admitted:
        await limiter.settle(r, tokens=10, cost_micros=100)
    assert await limiter.spent_micros(BUDGET) == 400
    decisions = await asyncio.gather(*(limiter.admit(request(100 + n)) for n in range(10)))
    assert sum(d.admitted for d in decisions) == 2  # 400 -> 700 -> 1000
    assert await limiter.spent_micros(BUDGET) == 1000


async def test_budget_refusal_reserves_no_rate_limits(limiter: Limiter) -> None:
    spent = Budget("tenant:t", cap_micros=0, period="2026-11", period_ttl_s=3600)
    decision = await limiter.admit(request(1, spent))
    assert decision.reason == "budget"
    probe = await limiter.admit(AdmissionRequest("probe", SCOPES, tokens=1))
    assert probe.remaining_requests == 999
    assert await limiter.spent_micros(spent) == 0


async def test_settle_refunds_spend_but_never_below_zero(limiter: Limiter) -> None:
    first = request(1, cost=500)
    assert (await limiter.admit(first)).admitted
    await limiter.settle(first, tokens=10, cost_micros=0)
    assert await limiter.spent_micros(BUDGET) == 0
    second = request(2, cost=500)
    assert (await limiter.admit(second)).admitted
    await limiter.settle(second, tokens=10, cost_micros=700)  # real cost above the reservation
    assert await limiter.spent_micros(BUDGET) == 700


async def test_a_new_period_starts_from_zero(limiter: Limiter) -> None:
    assert (await limiter.admit(request(1, cost=CAP))).admitted
    assert (await limiter.admit(request(2))).reason == "budget"
    december = Budget("tenant:t", cap_micros=CAP, period="2026-12", period_ttl_s=3600)
    assert await limiter.spent_micros(december) == 0
    assert (await limiter.admit(request(3, december))).admitted
    assert await limiter.spent_micros(december) == COST
    assert await limiter.spent_micros(BUDGET) == CAP


async def test_settle_after_the_period_rolled_over_touches_only_the_old_period(
    limiter: Limiter,
) -> None:
    old = request(1)
    assert (await limiter.admit(old)).admitted
    december = Budget("tenant:t", cap_micros=CAP, period="2026-12", period_ttl_s=3600)
    assert (await limiter.admit(request(2, december))).admitted
    await limiter.settle(old, tokens=10, cost_micros=50)
    assert await limiter.spent_micros(BUDGET) == 50
    assert await limiter.spent_micros(december) == COST


async def test_reconcile_raises_a_counter_to_the_ledger_and_never_lowers_it(
        limiter: Limiter) -> None:
    admitted = request(1)
    assert (await limiter.admit(admitted)).admitted
    assert await limiter.spent_micros(BUDGET) == COST  # reserved
    await limiter.reconcile_budget(BUDGET, 100)  # the ledger is behind: nothing changes
    assert await limiter.spent_micros(BUDGET) == COST
    await limiter.reconcile_budget(BUDGET, 900)  # the counter lost spend: it catches up
    assert await limiter.spent_micros(BUDGET) == 900
    await limiter.settle(admitted, tokens=10, cost_micros=COST)
    assert await limiter.spent_micros(BUDGET) == 900
    assert (await limiter.admit(request(2))).admitted  # 900 is under the cap
    assert not (await limiter.admit(request(3))).admitted  # 1200 is not
    other = Budget(scope="tenant:u", cap_micros=CAP, period="2026-11", period_ttl_s=3600)
    await limiter.reconcile_budget(other, 250)  # no counter yet: starts from the ledger
    assert await limiter.spent_micros(other) == 250
