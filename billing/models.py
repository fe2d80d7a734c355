"""Billing's own tables: price versions, daily usage aggregates, and invoices.

Usage records themselves are `tenancy.models.UsageRecord`; these tables are derived from them
(aggregates, invoices) or referenced by them (price versions)."""

from __future__ import annotations

from datetime import date, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Date,
    Integer,
    Numeric,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from tenancy.db import Base
from tenancy.models import UTCDateTime, new_id, utcnow

# USD per 1M tokens with 9 decimals: exact for every price in litellm's map.
PriceColumn = Numeric(24, 9)
INVOICE_STATUSES = ("open", "closed")


class PriceVersion(Base):
    """A deployment's price as of `effective_from`. A new row each time the price changes;
    usage records point at the row they were charged at."""

    __tablename__ = "price_versions"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    deployment: Mapped[str] = mapped_column(String(200), index=True)
    tier: Mapped[str] = mapped_column(String(64))
    input_per_1m: Mapped[Decimal] = mapped_column(PriceColumn)
    output_per_1m: Mapped[Decimal] = mapped_column(PriceColumn)
    cached_input_per_1m: Mapped[Decimal] = mapped_column(PriceColumn)
    source: Mapped[str] = mapped_column(String(16))  # config, litellm, none
    effective_from: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


class UsageDaily(Base):
    """Sums of usage per tenant, UTC day, model, deployment, tier and adapter, kept up to date
    in the same transaction as the records they count, so dashboards and invoices never scan
    the raw table."""

    __tablename__ = "usage_daily"
    __table_args__ = (
        UniqueConstraint("tenant_id", "day", "model", "deployment", "tier", "adapter",
                         name="uq_usage_daily_key"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"),
                                    primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(32))
    day: Mapped[date] = mapped_column(Date, index=True)
    model: Mapped[str] = mapped_column(String(200))
    deployment: Mapped[str] = mapped_column(String(200))
    tier: Mapped[str] = mapped_column(String(64))
    adapter: Mapped[str] = mapped_column(String(200))
    requests: Mapped[int] = mapped_column(BigInteger, default=0)
    errors: Mapped[int] = mapped_column(BigInteger, default=0)  # status other than "ok"
    cache_hits: Mapped[int] = mapped_column(BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    input_cost_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    output_cost_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_cost_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    cost_micros: Mapped[int] = mapped_column(BigInteger, default=0)


class Invoice(Base):
    """A tenant's month. Open invoices are computed from the aggregates on request; closing
    stores the line items, and a closed invoice is only ever read back."""

    __tablename__ = "invoices"
    __table_args__ = (UniqueConstraint("tenant_id", "period", name="uq_invoices_tenant_period"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(String(32), index=True)
    period: Mapped[str] = mapped_column(String(7))  # YYYY-MM, UTC
    status: Mapped[str] = mapped_column(String(8), default="closed")
    total_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    lines: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    closed_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)
