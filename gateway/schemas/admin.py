"""Admin and tenant self-service API shapes. Secrets appear only in *Created responses, once."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

# Limits are stored in INTEGER columns (32-bit on PostgreSQL).
Limit = Annotated[int, Field(ge=1, le=2**31 - 1)] | None
# PostgreSQL text cannot hold NUL, so no stored string may contain one.
_NO_NUL = r"^[^\x00]*$"
Name = Annotated[str, Field(min_length=1, max_length=200, pattern=_NO_NUL)]
Names = Annotated[list[Annotated[str, Field(min_length=1, max_length=512, pattern=_NO_NUL)]],
                  Field(max_length=1000)]
# Response-cache settings (see tenancy.models.CACHE_MODES); a None threshold or TTL means
# "the gateway's default".
CacheMode = Literal["off", "auto", "exact", "semantic"]
Threshold = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]  # cosine similarity
TtlSeconds = Annotated[int, Field(ge=1, le=2**31 - 1)]
Percent = Annotated[int, Field(ge=0, le=100)]
MarkupBp = Annotated[int, Field(ge=-10_000, le=100_000)]
# The plan's place in the engines' fair-share scheduler: a share of engine tokens relative to
# other tenants' weights, and the order within the tenant (lower runs first).
EngineWeight = Annotated[float, Field(gt=0, le=100, allow_inf_nan=False)]
Priority = Annotated[int, Field(ge=-10, le=10)]
# Ids of plans, tenants and keys, in paths and bodies: anything else names nothing.
Id = Annotated[str, StringConstraints(min_length=1, max_length=64,
                                      pattern=r"^[A-Za-z0-9._:-]+$")]


def _utc_representable(value: datetime) -> datetime:
    """Aware datetimes must stay inside the calendar once converted to UTC, as stored."""
    if value.tzinfo is not None:
        try:
            value.astimezone(UTC)
        except OverflowError:
            raise ValueError("the date is out of range once converted to UTC") from None
    return value


# A timestamp the database can store and compare (naive ones are taken as UTC there).
Timestamp = Annotated[datetime, AfterValidator(_utc_representable)]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class PlanCreate(_In):
    name: Name
    rpm: Limit = None
    tpm: Limit = None
    max_concurrent: Limit = None
    budget_usd: Annotated[Decimal, Field(ge=0, le=10**9)] | None = None
    budget_period: Literal["month", "day"] = "month"
    allowed_models: Names | None = None
    allowed_tiers: Names | None = None
    cache_mode: CacheMode = "auto"
    semantic_threshold: Threshold | None = None
    cache_ttl_s: TtlSeconds | None = None
    cache_hit_price_percent: Percent = 0
    price_markup_bp: MarkupBp = 0
    engine_weight: EngineWeight = 1.0
    priority: Priority = 0
    # the most input tokens one embeddings request may embed; lowers a deployment's bound
    embedding_max_request_tokens: Limit = None
    batch_price_percent: Percent = 50  # share of the normal price charged for a batch line


class PlanUpdate(_In):
    name: Name | None = None
    rpm: Limit = None
    tpm: Limit = None
    max_concurrent: Limit = None
    budget_usd: Annotated[Decimal, Field(ge=0, le=10**9)] | None = None
    budget_period: Literal["month", "day"] | None = None
    allowed_models: Names | None = None
    allowed_tiers: Names | None = None
    cache_mode: CacheMode | None = None
    semantic_threshold: Threshold | None = None
    cache_ttl_s: TtlSeconds | None = None
    cache_hit_price_percent: Percent | None = None
    price_markup_bp: MarkupBp | None = None
    engine_weight: EngineWeight | None = None
    priority: Priority | None = None
    embedding_max_request_tokens: Limit = None  # an explicit null: the deployments' bounds
    batch_price_percent: Percent | None = None


class PlanOut(_Out):
    id: str
    name: str
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    budget_micros: int | None
    budget_period: str
    allowed_models: list[str] | None
    allowed_tiers: list[str] | None
    created_at: datetime
    cache_mode: str
    semantic_threshold: float | None
    cache_ttl_s: int | None
    cache_hit_price_percent: int
    price_markup_bp: int
    engine_weight: float
    priority: int
    embedding_max_request_tokens: int | None = None
    batch_price_percent: int = 50


class TenantCreate(_In):
    name: Name
    plan_id: Id
    semantic_threshold: Threshold | None = None


class TenantUpdate(_In):
    """Fields left out change nothing; an explicit null semantic_threshold clears it."""

    plan_id: Id | None = None
    status: Literal["active", "suspended"] | None = None
    semantic_threshold: Threshold | None = None


class TenantOut(_Out):
    id: str
    name: str
    plan_id: str
    status: str
    created_at: datetime
    semantic_threshold: float | None


class KeyCreate(_In):
    name: Annotated[str, Field(max_length=200, pattern=_NO_NUL)] = ""
    expires_at: Timestamp | None = None
    rpm: Limit = None
    tpm: Limit = None
    max_concurrent: Limit = None
    allowed_models: Names | None = None
    allowed_adapters: Names | None = None


class KeyOut(_Out):
    id: str
    tenant_id: str
    name: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    allowed_models: list[str] | None
    allowed_adapters: list[str] | None


class KeyCreated(KeyOut):
    key: str  # the full key: shown once, never stored


class AdminKeyCreate(_In):
    name: Name


class AdminKeyOut(_Out):
    id: str
    name: str
    created_at: datetime
    revoked_at: datetime | None


class AdminKeyCreated(AdminKeyOut):
    key: str


class ModelUsageOut(_Out):
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost_micros: int


class UsageOut(BaseModel):
    tenant_id: str
    since: datetime | None
    until: datetime | None
    models: list[ModelUsageOut]
