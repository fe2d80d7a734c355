"""Persisted tenancy models: plans, tenants, API keys, admin keys, adapters, auth version, usage.

These are storage shapes only. The hot path caches `tenancy.context` snapshots built from
them, and the HTTP layer has its own pydantic schemas.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from tenancy.db import Base
from tenancy.fields import (
    BUDGET_PERIOD,
    CACHE_MODE,
    ENGINE_WEIGHT,
    NAME_MAX,
    PRIORITY,
    TENANT_STATUS,
)

KEY_ID_LENGTH = 12
# How a usage record's answer was served: generated, or from the exact or semantic cache.
CACHE_HITS = ("none", "exact", "semantic")
AUTH_STATE_ID = 1


def utcnow() -> datetime:
    """The current time as an aware UTC datetime (what every timestamp column holds)."""
    return datetime.now(UTC)


def new_id() -> str:
    """A random 32-char hex id for plans and tenants."""
    return uuid.uuid4().hex


class UTCDateTime(TypeDecorator[datetime]):
    """Stores UTC and always returns aware UTC datetimes, on SQLite and PostgreSQL alike.

    SQLite keeps no offset, so naive values coming back are UTC by construction; naive
    values going in are taken to be UTC already.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


# Python None is stored as SQL NULL ("no restriction"), not as the JSON literal null.
_JSONOrNull = JSON(none_as_null=True)

# SQLite only autoincrements an INTEGER PRIMARY KEY; elsewhere we want 64 bits.
_AutoId = BigInteger().with_variant(Integer(), "sqlite")


class Plan(Base):
    """Limits, allowed models/tiers and a spend cap shared by the tenants on it.

    Every limit is optional: None means unlimited (or "all" for the allow-lists). The cache
    settings' None means "the gateway's default". What each setting means and its bounds:
    tenancy/fields.py, which the CHECK constraints below are built from.
    """

    __tablename__ = "plans"
    __table_args__ = (
        *(CheckConstraint(field.sql_check(), name=field.name)
          for field in (BUDGET_PERIOD, CACHE_MODE, ENGINE_WEIGHT, PRIORITY)),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(NAME_MAX), unique=True)
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(Integer)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    budget_micros: Mapped[int | None] = mapped_column(BigInteger)  # integer micro-USD
    budget_period: Mapped[str] = mapped_column(String(8), default="month")
    allowed_models: Mapped[list[str] | None] = mapped_column(_JSONOrNull)
    allowed_tiers: Mapped[list[str] | None] = mapped_column(_JSONOrNull)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    # Response caching (server defaults too: rows that predate migration 0003 get them).
    cache_mode: Mapped[str] = mapped_column(String(8), default="auto", server_default="auto")
    semantic_threshold: Mapped[float | None] = mapped_column(Float)  # cosine similarity
    cache_ttl_s: Mapped[int | None] = mapped_column(Integer)
    # Percent of the normal price charged for an answer served from cache.
    cache_hit_price_percent: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Markup (positive) or discount (negative) on every price, in basis points: 2000 = +20%.
    price_markup_bp: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # The tenants' place in the engines' fair-share scheduler (workers/engine/fair_share.py):
    # a share of engine tokens relative to other tenants' weights; and, within the tenant,
    # the order (lower first), also the most urgent a request may ask.
    engine_weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # The most input tokens one embeddings request may embed (None: the deployment's bound);
    # it can only lower a deployment's bound (gateway/deployments/embedding.py).
    embedding_max_request_tokens: Mapped[int | None] = mapped_column(Integer)
    # Percent of the normal price charged for a line of a batch (the Batch API); 50 as
    # OpenAI's discount. Rows that predate migration 0008 get the default.
    batch_price_percent: Mapped[int] = mapped_column(Integer, default=50, server_default="50")


class Tenant(Base):
    """A customer: owns API keys and usage, bound to one plan."""

    __tablename__ = "tenants"
    __table_args__ = (CheckConstraint(TENANT_STATUS.sql_check(), name=TENANT_STATUS.name),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(NAME_MAX), unique=True)
    plan_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("plans.id", ondelete="RESTRICT"), index=True
    )
    status: Mapped[str] = mapped_column(String(16), default="active")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    semantic_threshold: Mapped[float | None] = mapped_column(Float)  # overrides the plan's


class ApiKey(Base):
    """A tenant key. `id` is the public part of the token; only an HMAC of the secret is kept.

    Per-key limits and scopes narrow the plan's; None means "as the plan allows".
    """

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(KEY_ID_LENGTH), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    name: Mapped[str] = mapped_column(String(NAME_MAX), default="")
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(Integer)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    allowed_models: Mapped[list[str] | None] = mapped_column(_JSONOrNull)
    allowed_adapters: Mapped[list[str] | None] = mapped_column(_JSONOrNull)


class AdminKey(Base):
    """A key for the admin API and console; a separate namespace from tenant keys."""

    __tablename__ = "admin_keys"

    id: Mapped[str] = mapped_column(String(KEY_ID_LENGTH), primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_MAX), default="")
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class Adapter(Base):
    """A tenant's LoRA adapter for one base model. `path` is a folder on the server;
    `uploaded` ones live under the gateway's adapter_dir and are deleted with the row.

    Names are unique per tenant, and so are aliases (NULLs do not clash): lookups are always
    scoped to the caller's tenant, so two tenants may use the same names.
    """

    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("tenant_id", "name"), UniqueConstraint("tenant_id", "alias"))

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE")
    )
    name: Mapped[str] = mapped_column(String(NAME_MAX))
    base_model: Mapped[str] = mapped_column(String(512))
    path: Mapped[str] = mapped_column(String(4096))
    alias: Mapped[str | None] = mapped_column(String(NAME_MAX))
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    uploaded: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class AuthState(Base):
    """One row whose `version` every auth-relevant mutation bumps in its own transaction.

    Replicas poll it and drop their key caches when it moves: that is how a revocation or
    a plan change reaches every replica without a query per request.
    """

    __tablename__ = "auth_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    version: Mapped[int] = mapped_column(BigInteger, default=0)


class UsageRecord(Base):
    """One request that reached admission, however it ended, priced in integer micro-USD.

    `request_id` is unique: the outbox may deliver a record twice (replay after a crash) and
    the second insert is dropped. Costs are kept per part with the price version they were
    charged at, so an invoice never depends on today's price book.
    """

    __tablename__ = "usage_records"
    __table_args__ = (
        Index("ix_usage_records_tenant_id_created_at", "tenant_id", "created_at"),
        Index("uq_usage_records_request_id", "request_id", unique=True),
        # Only batch lines are in it: live requests (batch_id NULL) cost no index write.
        Index("ix_usage_records_batch_id", "batch_id",
              postgresql_where=text("batch_id IS NOT NULL"),
              sqlite_where=text("batch_id IS NOT NULL")),
    )

    id: Mapped[int] = mapped_column(_AutoId, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(64))
    tenant_id: Mapped[str] = mapped_column(String(32))
    key_id: Mapped[str | None] = mapped_column(String(KEY_ID_LENGTH))
    model: Mapped[str] = mapped_column(String(200))  # as asked: a model, an alias, an adapter
    deployment: Mapped[str] = mapped_column(String(200), default="")
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cost_micros: Mapped[int] = mapped_column(BigInteger, default=0)  # the total
    status: Mapped[str] = mapped_column(String(32), default="ok")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, index=True)
    # One of CACHE_HITS; no CHECK, so that a new kind can never make a usage insert fail.
    cache_hit: Mapped[str] = mapped_column(String(16), default="none", server_default="none")
    adapter: Mapped[str] = mapped_column(String(200), default="", server_default="")
    tier: Mapped[str] = mapped_column(String(64), default="", server_default="")
    input_cost_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    output_cost_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    cached_cost_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    price_id: Mapped[str | None] = mapped_column(String(32))
    queue_ms: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    total_ms: Mapped[float | None] = mapped_column(Float)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # A batch line's batch, and the share of the normal price it was charged at (the plan's
    # batch_price_percent then); both NULL for a live request.
    batch_id: Mapped[str | None] = mapped_column(String(40))
    batch_price_percent: Mapped[int | None] = mapped_column(Integer)
