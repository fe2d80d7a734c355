"""The rate-limit and budget contract shared by the gateway and both limiter backends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Limits:
    """Per-scope limits; None means unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True)
class Budget:
    """A spend cap for one scope in one period; a new period key starts from zero."""

    scope: str  # e.g. "tenant:<id>"
    cap_micros: int  # spend cap in integer micro-USD
    period: str  # period key, e.g. "2026-11" or "2026-11-21"
    period_ttl_s: int  # how long the counter lives, so stale periods expire


@dataclass(frozen=True)
class AdmissionRequest:
    """Everything a limiter needs to admit one request, and later to settle it."""

    request_id: str
    scopes: tuple[tuple[str, Limits], ...]  # e.g. (("key:abc", ...), ("tenant:t1", ...))
    tokens: int  # reserved TPM tokens: prompt + max output
    cost_micros: int = 0  # reserved spend: the most this request can cost
    budget: Budget | None = None
    # False: admission checks `tokens` and `cost_micros` (an estimate) but reserves only the
    # request (RPM, concurrency); `resize` then reserves the exact figures. An estimate held
    # by every request of a burst would keep the exact ones out (all refused, none served).
    hold: bool = True


@dataclass(frozen=True)
class Decision:
    """The verdict, plus what the gateway needs for retry-after and x-ratelimit-* headers."""

    admitted: bool
    reason: str | None = None  # "rpm" | "tpm" | "concurrency" | "budget" | "unavailable"
    scope: str | None = None  # which scope refused
    retry_after_s: float = 0.0  # > 0 when refused for rpm, tpm or concurrency
    # From the tightest scope that has the limit (least remaining):
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests_s: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens_s: float | None = None
    degraded: bool = False  # admitted unchecked because the backend is down (fail-open)


class Limiter(Protocol):
    """Admit-then-settle: admission reserves, settle releases and reconciles."""

    async def admit(self, request: AdmissionRequest) -> Decision:
        """Check every scope and the budget together; reserve everywhere or nowhere."""
        ...

    async def resize(self, request: AdmissionRequest) -> Decision:
        """Replace an admitted request's reservation with `request.tokens` and
        `request.cost_micros` (its exact figures, once its prompt is tokenized), atomically.

        Growth must fit as a new admission would: every scope's TPM, and a budget not used up
        by everything else reserved and spent. Refused, nothing changes (settle it with 0 to
        give the first reservation back); shrinking always fits. A request with no live
        reservation (admitted unchecked while the backend was down) is admitted as it is."""
        ...

    async def settle(self, request: AdmissionRequest, *, tokens: int, cost_micros: int) -> None:
        """Call once per admitted request when it ends: free its slot, refund unused reservation."""
        ...

    async def spent_micros(self, budget: Budget) -> int:
        """Reserved plus spent micro-USD in the budget's current period."""
        ...

    async def seed_budget(self, budget: Budget, spent_micros: int) -> None:
        """Start a period's counter from recorded spend, unless a live counter exists.

        Called at startup, so a restarted gateway (or a flushed Redis) does not hand tenants
        a fresh budget."""
        ...

    async def reconcile_budget(self, budget: Budget, ledger_micros: int) -> None:
        """Raise the period's counter to at least the ledger's spend (never lower it: the
        counter also holds reservations and spend the ledger has not received yet)."""
        ...

    async def close(self) -> None:
        """Release connections; the limiter is not used afterwards."""
        ...
