"""A plan's bound on the work of one embeddings request.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable, no default: the plans that exist keep the deployments' bounds.
    op.add_column("plans", sa.Column("embedding_max_request_tokens", sa.Integer(),
                                     nullable=True))


def downgrade() -> None:
    op.drop_column("plans", "embedding_max_request_tokens")
