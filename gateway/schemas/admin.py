"""Admin and tenant self-service API shapes. Secrets appear only in *Created responses, once."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from tenancy import fields
from tenancy.fields import (
    BATCH_PRICE_PERCENT,
    BUDGET_PERIOD,
    BUDGET_PERIODS,
    CACHE_HIT_PRICE_PERCENT,
    CACHE_MODE,
    CACHE_MODES,
    ENGINE_WEIGHT,
    PRICE_MARKUP_BP,
    PRIORITY,
    TENANT_STATUSES,
)


def _bounded(field: fields.Number) -> Any:
    """The pydantic type of a setting, with the bounds `tenancy.fields` declares for it."""
    return Annotated[field.kind, Field(**field.constraints())]


# Every bound is `tenancy.fields`'. `| None` in a class body where null is a value (unlimited,
# the gateway's default), or on PATCH where an explicit null reaches the service's own 400.
Rpm = _bounded(fields.RPM)
Tpm = _bounded(fields.TPM)
MaxConcurrent = _bounded(fields.MAX_CONCURRENT)
BudgetUsd = Annotated[Decimal, Field(ge=0, le=fields.BUDGET_USD_MAX)]
BudgetPeriod = Literal[BUDGET_PERIODS]  # type: ignore[valid-type]
CacheMode = Literal[CACHE_MODES]  # type: ignore[valid-type]
Threshold = _bounded(fields.SEMANTIC_THRESHOLD)
TtlSeconds = _bounded(fields.CACHE_TTL_S)
CacheHitPercent = _bounded(CACHE_HIT_PRICE_PERCENT)
MarkupBp = _bounded(PRICE_MARKUP_BP)
EngineWeight = _bounded(ENGINE_WEIGHT)
Priority = _bounded(PRIORITY)
EmbeddingTokens = _bounded(fields.EMBEDDING_MAX_REQUEST_TOKENS)
BatchPercent = _bounded(BATCH_PRICE_PERCENT)
TenantStatus = Literal[TENANT_STATUSES]  # type: ignore[valid-type]
# PostgreSQL text cannot hold NUL, so no stored string may contain one.
_NO_NUL = r"^[^\x00]*$"
Name = Annotated[str, Field(min_length=1, max_length=fields.NAME_MAX, pattern=_NO_NUL)]
KeyName = Annotated[str, Field(max_length=fields.NAME_MAX, pattern=_NO_NUL)]
Names = Annotated[list[Annotated[str, Field(min_length=1, max_length=fields.LIST_ITEM_MAX,
                                            pattern=_NO_NUL)]],
                  Field(max_length=fields.LIST_MAX)]
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
    rpm: Rpm | None = None
    tpm: Tpm | None = None
    max_concurrent: MaxConcurrent | None = None
    budget_usd: BudgetUsd | None = None
    budget_period: BudgetPeriod = BUDGET_PERIOD.default
    allowed_models: Names | None = None
    allowed_tiers: Names | None = None
    cache_mode: CacheMode = CACHE_MODE.default
    semantic_threshold: Threshold | None = None
    cache_ttl_s: TtlSeconds | None = None
    cache_hit_price_percent: CacheHitPercent = CACHE_HIT_PRICE_PERCENT.default
    price_markup_bp: MarkupBp = PRICE_MARKUP_BP.default
    engine_weight: EngineWeight = ENGINE_WEIGHT.default
    priority: Priority = PRIORITY.default
    embedding_max_request_tokens: EmbeddingTokens | None = None
    batch_price_percent: BatchPercent = BATCH_PRICE_PERCENT.default


# Fields left out change nothing; an explicit null clears a limit (or is refused by the
# service where the setting always has a value).
class PlanUpdate(_In):
    name: Name | None = None
    rpm: Rpm | None = None
    tpm: Tpm | None = None
    max_concurrent: MaxConcurrent | None = None
    budget_usd: BudgetUsd | None = None
    budget_period: BudgetPeriod | None = None
    allowed_models: Names | None = None
    allowed_tiers: Names | None = None
    cache_mode: CacheMode | None = None
    semantic_threshold: Threshold | None = None
    cache_ttl_s: TtlSeconds | None = None
    cache_hit_price_percent: CacheHitPercent | None = None
    price_markup_bp: MarkupBp | None = None
    engine_weight: EngineWeight | None = None
    priority: Priority | None = None
    embedding_max_request_tokens: EmbeddingTokens | None = None
    batch_price_percent: BatchPercent | None = None


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
    batch_price_percent: int = BATCH_PRICE_PERCENT.default


class TenantCreate(_In):
    name: Name
    plan_id: Id
    semantic_threshold: Threshold | None = None


class TenantUpdate(_In):
    """Fields left out change nothing; an explicit null semantic_threshold clears it."""

    plan_id: Id | None = None
    status: TenantStatus | None = None
    semantic_threshold: Threshold | None = None


class TenantOut(_Out):
    id: str
    name: str
    plan_id: str
    status: str
    created_at: datetime
    semantic_threshold: float | None


class KeyCreate(_In):
    name: KeyName = ""
    expires_at: Timestamp | None = None
    rpm: Rpm | None = None
    tpm: Tpm | None = None
    max_concurrent: MaxConcurrent | None = None
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
