"""Alembic environment: async engines (aiosqlite, asyncpg) driven through `run_sync`.

The URL comes from the config's `sqlalchemy.url` (set in code by `tenancy.migrate`). A
caller may instead pass an open sync connection as `config.attributes["connection"]`.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from alembic import context
from sqlalchemy import pool
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import create_async_engine

from billing import models as _billing_models  # noqa: F401 - registers its tables
from tenancy import batches as _batches  # noqa: F401 - registers its tables
from tenancy import stored_responses as _stored_responses  # noqa: F401 - registers its table
from tenancy.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(*, dialect: str, **kwargs: object) -> None:
    context.configure(
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things: batch mode copies the table instead.
        render_as_batch=dialect == "sqlite",
        compare_type=True,
        **kwargs,
    )


def run_migrations_offline() -> None:
    """Emit SQL to stdout instead of running it (`alembic upgrade --sql`)."""
    url = make_url(config.get_main_option("sqlalchemy.url") or "")
    _configure(dialect=url.get_backend_name(), url=url, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def _run_on_connection(connection: Connection) -> None:
    _configure(dialect=connection.dialect.name, connection=connection)
    with context.begin_transaction():
        context.run_migrations()


async def _run_async() -> None:
    engine = create_async_engine(
        config.get_main_option("sqlalchemy.url") or "", poolclass=pool.NullPool
    )
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_on_connection)
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_on_connection(connection)
        return
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # the usual case: no loop in this thread
        asyncio.run(_run_async())
        return
    # Called from inside a running loop: that loop cannot be re-entered, so run ours on a
    # private thread and wait for it.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="alembic") as executor:
        executor.submit(asyncio.run, _run_async()).result()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
