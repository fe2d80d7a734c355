"""Rate limits (RPM, TPM, concurrency) and spend budgets, checked and reserved atomically."""

from tenancy.limits.factory import make_limiter
from tenancy.limits.memory import InProcessLimiter
from tenancy.limits.redis_limiter import RedisLimiter
from tenancy.limits.types import AdmissionRequest, Budget, Decision, Limiter, Limits

__all__ = [
    "AdmissionRequest",
    "Budget",
    "Decision",
    "InProcessLimiter",
    "Limiter",
    "Limits",
    "RedisLimiter",
    "make_limiter",
]
