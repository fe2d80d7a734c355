"""Billing: unique request ids and cost parts on usage records, price versions, daily
aggregates, invoices, and the plan's price markup.

Revision ID: 0004
Revises: 0003
Create Date: 2025-04-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written by hand like 0001; names are final (tests compare with the models).
_UsageColumns = (
    ("adapter", sa.String(200), ""),
    ("tier", sa.String(64), ""),
    ("input_cost_micros", sa.BigInteger(), "0"),
    ("output_cost_micros", sa.BigInteger(), "0"),
    ("cached_cost_micros", sa.BigInteger(), "0"),
)
_Price = sa.Numeric(24, 9)
_Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    for name, type_, default in _UsageColumns:
        op.add_column("usage_records",
                      sa.Column(name, type_, server_default=default, nullable=False))
    op.add_column("usage_records", sa.Column("price_id", sa.String(32), nullable=True))
    for name in ("queue_ms", "ttft_ms", "total_ms"):
        op.add_column("usage_records", sa.Column(name, sa.Float(), nullable=True))
    op.add_column("usage_records",
                  sa.Column("started_at", sa.DateTime(timezone=True), nullable=True))
    # A unique index rather than a constraint: SQLite cannot ALTER a constraint in.
    op.create_index("uq_usage_records_request_id", "usage_records", ["request_id"],
                    unique=True)
    op.add_column("plans", sa.Column("price_markup_bp", sa.Integer(), server_default="0",
                                     nullable=False))
    op.create_table(
        "price_versions",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("deployment", sa.String(200), nullable=False),
        sa.Column("tier", sa.String(64), nullable=False),
        sa.Column("input_per_1m", _Price, nullable=False),
        sa.Column("output_per_1m", _Price, nullable=False),
        sa.Column("cached_input_per_1m", _Price, nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_price_versions")),
    )
    op.create_index(op.f("ix_price_versions_deployment"), "price_versions", ["deployment"])
    op.create_table(
        "usage_daily",
        sa.Column("id", _Id, autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("deployment", sa.String(200), nullable=False),
        sa.Column("tier", sa.String(64), nullable=False),
        sa.Column("adapter", sa.String(200), nullable=False),
        *(sa.Column(name, sa.BigInteger(), nullable=False) for name in (
            "requests", "errors", "cache_hits", "prompt_tokens", "completion_tokens",
            "cached_tokens", "input_cost_micros", "output_cost_micros", "cached_cost_micros",
            "cost_micros")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_daily")),
        sa.UniqueConstraint("tenant_id", "day", "model", "deployment", "tier", "adapter",
                            name="uq_usage_daily_key"),
    )
    op.create_index(op.f("ix_usage_daily_day"), "usage_daily", ["day"])
    op.create_table(
        "invoices",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("period", sa.String(7), nullable=False),
        sa.Column("status", sa.String(8), nullable=False),
        sa.Column("total_micros", sa.BigInteger(), nullable=False),
        sa.Column("lines", sa.JSON(), nullable=False),
        sa.Column("closed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_invoices")),
        sa.UniqueConstraint("tenant_id", "period", name="uq_invoices_tenant_period"),
    )
    op.create_index(op.f("ix_invoices_tenant_id"), "invoices", ["tenant_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_invoices_tenant_id"), table_name="invoices")
    op.drop_table("invoices")
    op.drop_index(op.f("ix_usage_daily_day"), table_name="usage_daily")
    op.drop_table("usage_daily")
    op.drop_index(op.f("ix_price_versions_deployment"), table_name="price_versions")
    op.drop_table("price_versions")
    op.drop_column("plans", "price_markup_bp")
    op.drop_index("uq_usage_records_request_id", table_name="usage_records")
    for name in ("started_at", "total_ms", "ttft_ms", "queue_ms", "price_id"):
        op.drop_column("usage_records", name)
    for name, _, _ in reversed(_UsageColumns):
        op.drop_column("usage_records", name)
