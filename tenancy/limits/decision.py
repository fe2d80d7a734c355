"""Turning one admission's outcome into a Decision, identically for both backends."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tenancy.limits.types import Decision, Limits
from tenancy.limits.window import ages_out_at

MIN_RETRY_S = 0.001
"""A refusal for rpm/tpm always says to wait a little, even when the window frees this instant."""

CONCURRENCY_RETRY_S = 1.0
"""A hint only: nobody knows when an in-flight request will end."""

UNAVAILABLE_RETRY_S = 1.0


@dataclass(frozen=True)
class ScopeUsage:
    """What one scope's windows hold after the decision (including this request if admitted)."""

    requests: int
    newest_request_bucket: int | None
    tokens: int
    newest_token_bucket: int | None


def _tightest(
    limits: Sequence[int | None], used: Sequence[int], newest: Sequence[int | None], now: float
) -> tuple[int | None, int | None, float | None]:
    """(limit, remaining, reset) of the scope with the least remaining among those limited."""
    best: tuple[int, int, float] | None = None
    for limit, count, bucket in zip(limits, used, newest, strict=True):
        if limit is None:
            continue
        remaining = max(limit - count, 0)
        if best is None or remaining < best[1]:
            reset = 0.0 if bucket is None else max(ages_out_at(bucket) - now, 0.0)
            best = (limit, remaining, reset)
    return best if best is not None else (None, None, None)


def make_decision(
    *,
    scopes: Sequence[tuple[str, Limits]],
    usage: Sequence[ScopeUsage],
    now: float,
    reason: str | None,
    refused_scope: str | None,
    retry_after_s: float,
) -> Decision:
    """Build the Decision, with header fields taken from the tightest scope."""
    limits = [limit for _, limit in scopes]
    lim_req, rem_req, reset_req = _tightest(
        [limit.rpm for limit in limits],
        [u.requests for u in usage],
        [u.newest_request_bucket for u in usage],
        now,
    )
    lim_tok, rem_tok, reset_tok = _tightest(
        [limit.tpm for limit in limits],
        [u.tokens for u in usage],
        [u.newest_token_bucket for u in usage],
        now,
    )
    if reason in ("rpm", "tpm"):
        retry = max(retry_after_s, MIN_RETRY_S)
    elif reason == "concurrency":
        retry = CONCURRENCY_RETRY_S
    else:
        retry = 0.0
    return Decision(
        admitted=reason is None,
        reason=reason,
        scope=refused_scope if reason else None,
        retry_after_s=retry,
        limit_requests=lim_req,
        remaining_requests=rem_req,
        reset_requests_s=reset_req,
        limit_tokens=lim_tok,
        remaining_tokens=rem_tok,
        reset_tokens_s=reset_tok,
    )


def unavailable(*, fail_open: bool) -> Decision:
    """What to answer when the backend cannot be asked."""
    if fail_open:
        return Decision(admitted=True, degraded=True)
    return Decision(admitted=False, reason="unavailable", retry_after_s=UNAVAILABLE_RETRY_S)
