"""Choosing the limiter backend from settings."""

from __future__ import annotations

from tenancy.limits.memory import DEFAULT_LEASE_S, InProcessLimiter
from tenancy.limits.redis_limiter import RedisLimiter
from tenancy.limits.types import Limiter


def make_limiter(
    *,
    redis_url: str,
    fail_open: bool,
    timeout_s: float = 0.25,
    namespace: str = "",
    lease_s: float = DEFAULT_LEASE_S,
) -> Limiter:
    """Redis when a URL is given, else in-process; no I/O (Redis connects on first use).

    ``fail_open`` only matters for Redis: the in-process backend cannot be unreachable.
    """
    if redis_url:
        return RedisLimiter(
            redis_url,
            fail_open=fail_open,
            timeout_s=timeout_s,
            namespace=namespace,
            lease_s=lease_s,
        )
    return InProcessLimiter(lease_s=lease_s)
