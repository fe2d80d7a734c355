"""Run the alembic migrations in `migrations/` from code, without an alembic.ini.

These are synchronous (alembic's command API). They may be called from a thread while an
event loop runs elsewhere, or even from inside a running loop (env.py then migrates on a
private thread).
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from tenancy.db import create_private_sqlite_file

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(url: str) -> Config:
    """An alembic `Config` for this repository's migrations against `url`."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("path_separator", "os")
    # ConfigParser interpolation treats '%' specially (URL-encoded passwords contain it).
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` up to `revision` (creating the schema on a fresh one).

    A new SQLite file is created owner-only first: alembic would create it 0644, and every
    caller (`serve`, `migrate`, tests) goes through here."""
    create_private_sqlite_file(url)
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at `url` down to `revision` (`base` drops every table)."""
    command.downgrade(alembic_config(url), revision)
