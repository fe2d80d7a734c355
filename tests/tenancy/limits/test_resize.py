"""Resize: admission's second step, the exact count replacing the estimate, on both backends."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from tenancy.limits import AdmissionRequest, Budget, Limiter, Limits

TPM = 1000
CAP = 1000
BUDGET = Budget(scope="tenant:t", cap_micros=CAP, period="2026-11", period_ttl_s=3600)
SCOPES = (("key:a", Limits(rpm=1000)), ("tenant:t", Limits(rpm=1000, tpm=TPM)))


def request(request_id: str, tokens: int, cost: int = 0,
            budget: Budget | None = None) -> AdmissionRequest:
    return AdmissionRequest(request_id, SCOPES, tokens=tokens, cost_micros=cost, budget=budget)


async def used_tokens(limiter: Limiter) -> int:
    """What the TPM window holds now, read through a zero-token probe's headers."""
    probe = request("probe", 0)
    decision = await limiter.admit(probe)
    await limiter.settle(probe, tokens=0, cost_micros=0)
    assert decision.limit_tokens == TPM and decision.remaining_tokens is not None
    return TPM - decision.remaining_tokens


async def test_growth_that_fits_is_reserved(limiter: Limiter) -> None:
    first = request("r1", 100)
    assert (await limiter.admit(first)).admitted
    decision = await limiter.resize(replace(first, tokens=700))
    assert decision.admitted
    assert decision.remaining_tokens == TPM - 700
    assert await used_tokens(limiter) == 700


async def test_growth_past_the_tpm_is_refused_and_changes_nothing(limiter: Limiter) -> None:
    other = request("other", 600)
    first = request("r1", 100)
    assert (await limiter.admit(other)).admitted
    assert (await limiter.admit(first)).admitted
    decision = await limiter.resize(replace(first, tokens=500))  # 600 + 500 > 1000
    assert not decision.admitted
    assert (decision.reason, decision.scope) == ("tpm", "tenant:t")
    assert decision.retry_after_s > 0
    assert await used_tokens(limiter) == 700
    await limiter.settle(first, tokens=0, cost_micros=0)  # what the gateway does on refusal
    assert await used_tokens(limiter) == 600


async def test_a_request_larger_than_the_tpm_is_refused_for_the_window(limiter: Limiter) -> None:
    first = request("r1", 10)
    assert (await limiter.admit(first)).admitted
    decision = await limiter.resize(replace(first, tokens=TPM + 1))
    assert decision.reason == "tpm" and decision.retry_after_s >= 59


async def test_shrinking_always_fits_and_refunds(limiter: Limiter) -> None:
    first = request("r1", 900)
    assert (await limiter.admit(first)).admitted
    assert (await limiter.admit(request("r2", 100))).admitted
    decision = await limiter.resize(replace(first, tokens=300))
    assert decision.admitted
    assert await used_tokens(limiter) == 400


async def test_settle_reconciles_against_the_resized_reservation(limiter: Limiter) -> None:
    first = request("r1", 100)
    assert (await limiter.admit(first)).admitted
    exact = replace(first, tokens=800)
    assert (await limiter.resize(exact)).admitted
    await limiter.settle(exact, tokens=250, cost_micros=0)
    assert await used_tokens(limiter) == 250


async def test_budget_growth_is_refused_once_others_use_the_budget_up(limiter: Limiter) -> None:
    spender = request("spender", 1, cost=CAP, budget=BUDGET)
    late = request("late", 1, cost=0, budget=BUDGET)  # admitted while the budget had room
    assert (await limiter.admit(late)).admitted
    assert (await limiter.admit(spender)).admitted
    decision = await limiter.resize(replace(late, cost_micros=50))
    assert (decision.reason, decision.scope) == ("budget", "tenant:t")
    assert await limiter.spent_micros(BUDGET) == CAP
    shrink = await limiter.resize(replace(spender, cost_micros=400))
    assert shrink.admitted and await limiter.spent_micros(BUDGET) == 400
    grow = await limiter.resize(replace(late, cost_micros=500))
    assert grow.admitted and await limiter.spent_micros(BUDGET) == 900


async def test_concurrent_resizes_overshoot_the_budget_by_at_most_one_request(
        limiter: Limiter) -> None:
    """The audit's burst: estimates that fit, exact costs five times as large."""
    estimates = [request(f"r{n}", 1, cost=20, budget=BUDGET) for n in range(30)]
    admitted = [r for r, d in zip(estimates, await asyncio.gather(
        *(limiter.admit(r) for r in estimates)), strict=True) if d.admitted]
    exact_cost = 100
    decisions = await asyncio.gather(
        *(limiter.resize(replace(r, cost_micros=exact_cost)) for r in admitted))
    for r, d in zip(admitted, decisions, strict=True):
        if not d.admitted:
            await limiter.settle(r, tokens=0, cost_micros=0)
    spent = await limiter.spent_micros(BUDGET)
    served = sum(d.admitted for d in decisions)
    assert served >= 1 and spent == served * exact_cost
    assert spent < CAP + exact_cost


async def test_concurrent_resizes_keep_the_tpm(limiter: Limiter) -> None:
    estimates = [request(f"r{n}", 25) for n in range(30)]
    admitted = [r for r, d in zip(estimates, await asyncio.gather(
        *(limiter.admit(r) for r in estimates)), strict=True) if d.admitted]
    assert len(admitted) == 30  # 750 of 1000 on the estimate
    decisions = await asyncio.gather(*(limiter.resize(replace(r, tokens=160)) for r in admitted))
    for r, d in zip(admitted, decisions, strict=True):
        if not d.admitted:
            await limiter.settle(r, tokens=0, cost_micros=0)
    served = sum(d.admitted for d in decisions)
    assert served >= 1  # the estimates still held by the others count until they settle
    assert await used_tokens(limiter) == 160 * served <= TPM


async def test_an_unreserved_request_is_admitted_as_it_is(limiter: Limiter) -> None:
    decision = await limiter.resize(request("never-admitted", TPM * 5, cost=10**9,
                                            budget=BUDGET))
    assert decision.admitted
    assert await used_tokens(limiter) == 0


async def test_an_unheld_admission_checks_the_estimate_and_reserves_nothing(
        limiter: Limiter) -> None:
    first = replace(request("r1", 400, cost=300, budget=BUDGET), hold=False)
    assert (await limiter.admit(first)).admitted
    assert await used_tokens(limiter) == 0
    assert await limiter.spent_micros(BUDGET) == 0
    too_big = replace(request("r2", TPM + 1), hold=False)
    assert (await limiter.admit(too_big)).reason == "tpm"
    assert (await limiter.resize(replace(first, hold=True, tokens=450))).admitted
    assert await used_tokens(limiter) == 450


async def test_a_burst_of_unheld_estimates_serves_what_fits(limiter: Limiter) -> None:
    """Estimates four times too low, 24 at once: as many exact ones as the TPM holds."""
    burst = [replace(request(f"r{n}", 110), hold=False) for n in range(24)]
    decisions = await asyncio.gather(*(limiter.admit(r) for r in burst))
    assert all(d.admitted for d in decisions)
    exact = [replace(r, hold=True, tokens=430) for r in burst]
    resized = await asyncio.gather(*(limiter.resize(r) for r in exact))
    assert sum(d.admitted for d in resized) == TPM // 430
    assert await used_tokens(limiter) == 430 * (TPM // 430)
