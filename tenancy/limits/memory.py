"""The embedded in-process limiter: exact on one event loop because admit never awaits midway."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tenancy.limits.decision import ScopeUsage, make_decision
from tenancy.limits.types import AdmissionRequest, Budget, Decision, Limits
from tenancy.limits.window import WINDOW_S, BucketWindow

DEFAULT_LEASE_S = 900.0
"""How long an admitted request holds its slot and reservation if it is never settled."""

SWEEP_EVERY_S = 60.0


@dataclass
class _ScopeState:
    requests: BucketWindow = field(default_factory=BucketWindow)
    tokens: BucketWindow = field(default_factory=BucketWindow)
    in_flight: dict[str, float] = field(default_factory=dict)  # request id -> lease expiry

    def prune(self, now: float) -> None:
        self.requests.prune(now)
        self.tokens.prune(now)
        for request_id in [r for r, expiry in self.in_flight.items() if expiry <= now]:
            del self.in_flight[request_id]

    def is_idle(self) -> bool:
        return self.requests.is_empty() and self.tokens.is_empty() and not self.in_flight

    def usage(self) -> ScopeUsage:
        return ScopeUsage(
            self.requests.total(), self.requests.newest(), self.tokens.total(), self.tokens.newest()
        )


@dataclass
class _Counter:
    micros: int
    expires_at: float


@dataclass(frozen=True)
class _Reservation:
    bucket: int
    tokens: int
    cost_micros: int
    expires_at: float


def _refusal(
    limits: Limits, state: _ScopeState, tokens: int, now: float
) -> tuple[str, float] | None:
    """Why this scope refuses (and the wait), or None; mirrors the Redis admit script."""
    if limits.rpm is not None:
        count = state.requests.total()
        if count + 1 > limits.rpm:
            return "rpm", state.requests.wait_for(count + 1 - limits.rpm, now)
    refusal = _tpm_refusal(limits, state, tokens, tokens, now)
    if refusal is not None:
        return refusal
    if limits.max_concurrent is not None and len(state.in_flight) + 1 > limits.max_concurrent:
        return "concurrency", 0.0
    return None


def _tpm_refusal(
    limits: Limits, state: _ScopeState, tokens: int, growth: int, now: float
) -> tuple[str, float] | None:
    """A request of `tokens` in all, `growth` of them not reserved yet, against the TPM."""
    if limits.tpm is None:
        return None
    if tokens > limits.tpm:
        return "tpm", float(WINDOW_S)
    used = state.tokens.total()
    if growth > 0 and used + growth > limits.tpm:
        return "tpm", state.tokens.wait_for(used + growth - limits.tpm, now)
    return None


class InProcessLimiter:
    """Same algorithms as the Redis backend, in plain Python, for the embedded default."""

    def __init__(
        self, *, clock: Callable[[], float] = time.time, lease_s: float = DEFAULT_LEASE_S
    ) -> None:
        self._clock = clock
        self._lease_s = lease_s
        self._scopes: dict[str, _ScopeState] = {}
        self._budgets: dict[tuple[str, str], _Counter] = {}
        self._reservations: dict[str, _Reservation] = {}
        self._next_sweep = 0.0

    async def admit(self, request: AdmissionRequest) -> Decision:
        now = self._clock()
        self._sweep(now)
        tokens = max(request.tokens, 0)
        states = [self._scopes.setdefault(name, _ScopeState()) for name, _ in request.scopes]
        reason: str | None = None
        refused_scope: str | None = None
        retry = 0.0
        for (name, limits), state in zip(request.scopes, states, strict=True):
            state.prune(now)
            refusal = _refusal(limits, state, tokens, now)
            if refusal is not None and reason is None:
                (reason, retry), refused_scope = refusal, name
        budget = request.budget
        if reason is None and budget is not None and self._spent(budget, now) >= budget.cap_micros:
            reason, refused_scope = "budget", budget.scope
        if reason is None:
            self._reserve(request, states, tokens, now)
        return make_decision(
            scopes=request.scopes,
            usage=[state.usage() for state in states],
            now=now,
            reason=reason,
            refused_scope=refused_scope,
            retry_after_s=retry,
        )

    def _reserve(
        self, request: AdmissionRequest, states: list[_ScopeState], tokens: int, now: float
    ) -> None:
        bucket = math.floor(now)
        expires_at = now + self._lease_s
        if not request.hold:
            tokens = 0
        cost = request.cost_micros if request.hold else 0
        for state in states:
            state.requests.add(bucket, 1)
            state.tokens.add(bucket, tokens)
            state.in_flight[request.request_id] = expires_at
        if request.budget is not None:
            counter = self._live_counter(request.budget, now)
            if counter is None:
                counter = _Counter(0, now + request.budget.period_ttl_s)
                self._budgets[(request.budget.scope, request.budget.period)] = counter
            counter.micros += cost
        self._reservations[request.request_id] = _Reservation(bucket, tokens, cost, expires_at)

    async def resize(self, request: AdmissionRequest) -> Decision:
        now = self._clock()
        states = [self._scopes.setdefault(name, _ScopeState()) for name, _ in request.scopes]
        for state in states:
            state.prune(now)
        reason: str | None = None
        refused_scope: str | None = None
        retry = 0.0
        reservation = self._reservations.get(request.request_id)
        if reservation is not None and reservation.expires_at > now:
            tokens = max(request.tokens, 0)
            growth = tokens - reservation.tokens
            for (name, limits), state in zip(request.scopes, states, strict=True):
                refusal = _tpm_refusal(limits, state, tokens, growth, now)
                if refusal is not None:
                    (reason, retry), refused_scope = refusal, name
                    break
            budget = request.budget
            if (reason is None and budget is not None
                    and request.cost_micros > reservation.cost_micros
                    and self._spent(budget, now) - reservation.cost_micros >= budget.cap_micros):
                reason, refused_scope = "budget", budget.scope
            if reason is None:
                self._resize(request, states, reservation, tokens, now)
        return make_decision(
            scopes=request.scopes,
            usage=[state.usage() for state in states],
            now=now,
            reason=reason,
            refused_scope=refused_scope,
            retry_after_s=retry,
        )

    def _resize(self, request: AdmissionRequest, states: list[_ScopeState],
                reservation: _Reservation, tokens: int, now: float) -> None:
        delta = tokens - reservation.tokens
        for state in states:
            if delta > 0:
                state.tokens.add(reservation.bucket, delta)
            else:
                state.tokens.adjust(reservation.bucket, delta, now)
        if request.budget is not None:
            counter = self._live_counter(request.budget, now)
            if counter is not None:
                counter.micros = max(
                    counter.micros + request.cost_micros - reservation.cost_micros, 0)
        self._reservations[request.request_id] = _Reservation(
            reservation.bucket, tokens, request.cost_micros, reservation.expires_at)

    async def settle(self, request: AdmissionRequest, *, tokens: int, cost_micros: int) -> None:
        now = self._clock()
        for name, _ in request.scopes:
            state = self._scopes.get(name)
            if state is not None:
                state.in_flight.pop(request.request_id, None)
        reservation = self._reservations.pop(request.request_id, None)
        if reservation is None or reservation.expires_at <= now:
            return  # never reserved (degraded or refused), already settled, or lease expired
        delta = max(tokens, 0) - reservation.tokens
        if delta:
            for name, _ in request.scopes:
                state = self._scopes.get(name)
                if state is not None:
                    state.tokens.adjust(reservation.bucket, delta, now)
        if request.budget is not None:
            counter = self._live_counter(request.budget, now)
            if counter is not None:
                counter.micros = max(counter.micros + cost_micros - reservation.cost_micros, 0)

    async def seed_budget(self, budget: Budget, spent_micros: int) -> None:
        now = self._clock()
        if self._live_counter(budget, now) is None:
            self._budgets[(budget.scope, budget.period)] = _Counter(
                max(spent_micros, 0), now + budget.period_ttl_s)

    async def spent_micros(self, budget: Budget) -> int:
        return self._spent(budget, self._clock())

    async def reconcile_budget(self, budget: Budget, ledger_micros: int) -> None:
        now = self._clock()
        counter = self._live_counter(budget, now)
        if counter is None:
            await self.seed_budget(budget, ledger_micros)
        elif counter.micros < ledger_micros:
            counter.micros = ledger_micros

    async def close(self) -> None:
        self._scopes.clear()
        self._budgets.clear()
        self._reservations.clear()

    def _live_counter(self, budget: Budget, now: float) -> _Counter | None:
        counter = self._budgets.get((budget.scope, budget.period))
        if counter is None or counter.expires_at <= now:
            return None
        return counter

    def _spent(self, budget: Budget, now: float) -> int:
        counter = self._live_counter(budget, now)
        return 0 if counter is None else counter.micros

    def _sweep(self, now: float) -> None:
        """Drop idle scopes and expired counters now and then, so memory tracks live traffic."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_EVERY_S
        for name, state in list(self._scopes.items()):
            state.prune(now)
            if state.is_idle():
                del self._scopes[name]
        for key in [k for k, c in self._budgets.items() if c.expires_at <= now]:
            del self._budgets[key]
        for key in [k for k, r in self._reservations.items() if r.expires_at <= now]:
            del self._reservations[key]
