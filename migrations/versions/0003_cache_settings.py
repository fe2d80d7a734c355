"""Response-cache settings on plans and tenants, and the cache-hit kind of usage records.

Revision ID: 0003
Revises: 0002
Create Date: 2025-03-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written by hand like 0001; names are final (tests compare with the models).
#
# SQLite cannot ALTER a constraint onto a table (batch mode would copy `plans`, which
# tenants reference), but both backends accept a CHECK inside ADD COLUMN. Bound to its own
# column, it also lets SQLite DROP the column again on downgrade. The server defaults fill
# the rows that already exist.
_ADD_CACHE_MODE = (
    "ALTER TABLE plans ADD COLUMN cache_mode VARCHAR(8) DEFAULT 'auto' NOT NULL"
    " CONSTRAINT ck_plans_cache_mode"
    " CHECK (cache_mode IN ('off', 'auto', 'exact', 'semantic'))"
)


def upgrade() -> None:
    op.execute(_ADD_CACHE_MODE)
    op.add_column("plans", sa.Column("semantic_threshold", sa.Float(), nullable=True))
    op.add_column("plans", sa.Column("cache_ttl_s", sa.Integer(), nullable=True))
    op.add_column(
        "plans",
        sa.Column("cache_hit_price_percent", sa.Integer(), server_default="0", nullable=False),
    )
    op.add_column("tenants", sa.Column("semantic_threshold", sa.Float(), nullable=True))
    op.add_column(
        "usage_records",
        sa.Column("cache_hit", sa.String(16), server_default="none", nullable=False),
    )


def downgrade() -> None:
    op.drop_column("usage_records", "cache_hit")
    op.drop_column("tenants", "semantic_threshold")
    op.drop_column("plans", "cache_hit_price_percent")
    op.drop_column("plans", "cache_ttl_s")
    op.drop_column("plans", "semantic_threshold")
    op.drop_column("plans", "cache_mode")
