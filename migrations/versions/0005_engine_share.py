"""The plan's place in the engines' fair-share scheduler: engine weight and priority.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written by hand like 0001; names are final (tests compare with the models).
#
# As in 0003: SQLite cannot ALTER a constraint onto `plans` (batch mode would copy the table
# tenants reference), but both backends take a CHECK inside ADD COLUMN, and one bound to its
# own column lets SQLite DROP the column again. The defaults fill the plans that exist.
_ADD_COLUMNS = (
    "ALTER TABLE plans ADD COLUMN engine_weight FLOAT DEFAULT 1 NOT NULL"
    " CONSTRAINT ck_plans_engine_weight CHECK (engine_weight > 0 AND engine_weight <= 100)",
    "ALTER TABLE plans ADD COLUMN priority INTEGER DEFAULT 0 NOT NULL"
    " CONSTRAINT ck_plans_priority CHECK (priority BETWEEN -10 AND 10)",
)


def upgrade() -> None:
    for statement in _ADD_COLUMNS:
        op.execute(statement)


def downgrade() -> None:
    op.drop_column("plans", "priority")
    op.drop_column("plans", "engine_weight")
