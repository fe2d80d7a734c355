"""Responses kept for the OpenAI Responses API (store, previous_response_id), per tenant.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-10 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written by hand like 0001; names are final (tests compare with the models).


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("previous_response_id", sa.String(64), nullable=True),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("history", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_responses")),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_responses_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
    )
    op.create_index("ix_responses_tenant_id_created_at", "responses",
                    ["tenant_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_responses_tenant_id_created_at", table_name="responses")
    op.drop_table("responses")
