"""Engine and session factories for the tenancy database (SQLite by default, PostgreSQL)."""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import MetaData, event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase

from workers.protocol.wire_json import dumps, loads

SQLITE_BUSY_TIMEOUT_MS = 5000


# Deterministic constraint names, so migrations can refer to them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base of every persisted model; `Base.metadata` feeds alembic."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers run beside the single writer (several gateway processes on one
    # file); foreign keys are off by default in SQLite; the busy timeout turns lock
    # contention into a short wait instead of an immediate "database is locked".
    # synchronous=NORMAL (SQLite's advice for WAL): a commit survives the death of the process
    # but not a power loss, the usage outbox's own default (`billing.outbox`); never a corrupt
    # file. FULL fsyncs every commit: about 0.9 ms of kernel CPU a commit on our VMs.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()


def _create_private_file(dialect: Any, _record: Any, cargs: Any, cparams: Any) -> None:
    """Before SQLite opens a database file, create it owner-only (0600) if it is new: it holds
    key hashes and every tenant's usage. SQLite gives its -wal and -shm files the database
    file's mode. An existing file is left as it is."""
    path = cargs[0] if cargs else cparams.get("database")
    if isinstance(path, str):
        _private_file(path)


def create_private_sqlite_file(url: str) -> None:
    """For code that opens the database with an engine of its own (alembic): create a new
    SQLite file owner-only first. Nothing for other databases or an existing file."""
    if is_sqlite(url):
        _private_file(make_url(url).database or "")


def _private_file(path: str) -> None:
    if path in ("", ":memory:") or path.startswith("file:"):
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return


def is_sqlite(url: str) -> bool:
    """Whether `url` points at SQLite (which needs batch mode in migrations, pragmas here)."""
    return make_url(url).get_backend_name() == "sqlite"


def make_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """An async engine for `url`; SQLite connections get WAL, foreign keys and a busy timeout.

    Creating the engine opens no connection; the first query does.
    """
    # JSON columns (stored responses, batches) through the request path's codec: a stored
    # Response object is written in a quarter of json.dumps's time
    kwargs.setdefault("json_serializer", _json_text)
    kwargs.setdefault("json_deserializer", loads)
    if is_sqlite(url):
        connect_args = dict(kwargs.pop("connect_args", {}))
        connect_args.setdefault("timeout", SQLITE_BUSY_TIMEOUT_MS / 1000)
        engine = create_async_engine(url, connect_args=connect_args, **kwargs)
        event.listen(engine.sync_engine, "do_connect", _create_private_file)
        event.listen(engine.sync_engine, "connect", _sqlite_on_connect)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_async_engine(url, **kwargs)


def _json_text(value: Any) -> str:
    return dumps(value).decode()


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Sessions whose objects stay readable after commit (we hand them to other layers)."""
    return async_sessionmaker(engine, expire_on_commit=False)
