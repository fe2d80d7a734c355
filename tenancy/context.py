"""Immutable auth snapshots the hot path caches instead of ORM objects.

A `KeyContext` carries everything a request needs to decide whether a key may be used and
for what, so that authentication costs no database query once cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PlanLimits:
    """A plan's limits and cache settings.

    For limits None means unlimited (or, for the allow-lists, everything); for the cache
    threshold and TTL it means "the gateway's default".
    """

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    budget_micros: int | None = None
    budget_period: str = "month"
    allowed_models: frozenset[str] | None = None
    allowed_tiers: frozenset[str] | None = None
    cache_mode: str = "auto"  # off | auto | exact | semantic (see tenancy.models.CACHE_MODES)
    semantic_threshold: float | None = None  # cosine similarity in (0, 1]
    cache_ttl_s: int | None = None
    cache_hit_price_percent: int = 0  # share of the normal price charged for a cached answer
    price_markup_bp: int = 0  # on every price, in basis points: 2000 = +20%, -1000 = -10%
    # the tenant's place in the engines' fair-share scheduler (workers/engine/fair_share.py)
    engine_weight: float = 1.0  # share of engine tokens relative to other tenants' weights
    priority: int = 0  # within the tenant, lower runs first; the most urgent a request may ask
    embedding_max_request_tokens: int | None = None  # lowers a deployment's bound, never raises
    batch_price_percent: int = 50  # share of the normal price charged for a batch line


@dataclass(frozen=True, slots=True)
class KeyContext:
    """A tenant key joined with its tenant and plan, as of one auth version."""

    key_id: str
    tenant_id: str
    tenant_name: str
    secret_hash: str = field(repr=False)
    expires_at: float | None  # epoch seconds
    revoked: bool
    tenant_active: bool
    plan: PlanLimits
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    allowed_models: frozenset[str] | None = None
    allowed_adapters: frozenset[str] | None = None
    tenant_semantic_threshold: float | None = None  # overrides the plan's

    def usable(self, now: float) -> str | None:
        """None when the key may be used at `now` (epoch s), else why not."""
        if self.revoked:
            return "revoked"
        if self.expires_at is not None and now >= self.expires_at:
            return "expired"
        if not self.tenant_active:
            return "tenant suspended"
        return None

    def may_use_model(self, name: str) -> bool:
        """Both the plan and the key must admit the model (None admits everything)."""
        return _admits(self.plan.allowed_models, name) and _admits(self.allowed_models, name)

    def may_use_tier(self, tier: str) -> bool:
        """Whether the plan admits deployments of this cost tier."""
        return _admits(self.plan.allowed_tiers, tier)

    def may_use_adapter(self, name: str) -> bool:
        """Whether the key admits this LoRA adapter (None admits every adapter of the tenant)."""
        return _admits(self.allowed_adapters, name)

    def semantic_threshold(self, default: float) -> float:
        """The tenant's override, else the plan's, else the gateway's `default`."""
        if self.tenant_semantic_threshold is not None:
            return self.tenant_semantic_threshold
        if self.plan.semantic_threshold is not None:
            return self.plan.semantic_threshold
        return default


@dataclass(frozen=True, slots=True)
class AdapterContext:
    """A tenant's LoRA adapter as the hot path caches it (one lookup, then no queries)."""

    id: str
    tenant_id: str
    name: str
    base_model: str
    path: str = field(repr=False)
    alias: str | None
    pinned: bool


@dataclass(frozen=True, slots=True)
class AdminContext:
    """An admin key as the admin API's auth check needs it."""

    key_id: str
    name: str
    secret_hash: str = field(repr=False)
    revoked: bool


def _admits(allowed: frozenset[str] | None, name: str) -> bool:
    return allowed is None or name in allowed
