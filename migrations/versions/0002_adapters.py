"""Tenant-owned LoRA adapters.

Revision ID: 0002
Revises: 0001
Create Date: 2025-02-01 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written by hand like 0001; names wrapped in op.f() are final (tests compare with the models).


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("tenant_id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("base_model", sa.String(512), nullable=False),
        sa.Column("path", sa.String(4096), nullable=False),
        sa.Column("alias", sa.String(200), nullable=True),
        sa.Column("pinned", sa.Boolean(), nullable=False),
        sa.Column("uploaded", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_adapters_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint("tenant_id", "name", name=op.f("uq_adapters_tenant_id_name")),
        sa.UniqueConstraint("tenant_id", "alias", name=op.f("uq_adapters_tenant_id_alias")),
    )


def downgrade() -> None:
    op.drop_table("adapters")
