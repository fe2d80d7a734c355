"""Usage records of batch lines: their batch and the share of the price they were charged.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-20 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BATCH_LINES = sa.text("batch_id IS NOT NULL")


def upgrade() -> None:
    # Nullable, no default: every record written before this was a live request's (batch
    # lines' records from 0008 on keep their `batch_req_` request ids, but not their batch).
    op.add_column("usage_records", sa.Column("batch_id", sa.String(40), nullable=True))
    op.add_column("usage_records", sa.Column("batch_price_percent", sa.Integer(),
                                             nullable=True))
    # Partial: live requests, nearly every row, add nothing to it.
    op.create_index("ix_usage_records_batch_id", "usage_records", ["batch_id"],
                    postgresql_where=_BATCH_LINES, sqlite_where=_BATCH_LINES)


def downgrade() -> None:
    op.drop_index("ix_usage_records_batch_id", table_name="usage_records")
    op.drop_column("usage_records", "batch_price_percent")
    op.drop_column("usage_records", "batch_id")
