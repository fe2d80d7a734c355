"""Alembic migrations: upgrade, downgrade, upgrade again, and agreement with the models."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from billing import models as _billing_models  # noqa: F401 - its tables in Base
from tenancy import batches as _batches  # noqa: F401 - its tables in Base
from tenancy import stored_responses as _stored_responses  # noqa: F401 - its table in Base
from tenancy.db import make_engine
from tenancy.migrate import MIGRATIONS_DIR, alembic_config, downgrade, upgrade
from tenancy.models import Base

TABLES = {"plans", "tenants", "api_keys", "admin_keys", "auth_state", "usage_records",
          "adapters", "price_versions", "usage_daily", "invoices", "responses", "files",
          "batches"}
HEAD = "0009"


async def _inspect(url: str, fn: Any) -> Any:
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(fn)
    finally:
        await engine.dispose()


def _tables(conn: Connection) -> set[str]:
    return set(inspect(conn).get_table_names())


def _indexes(conn: Connection) -> set[str]:
    inspector = inspect(conn)
    return {ix["name"] for table in TABLES for ix in inspector.get_indexes(table)}


def _state(conn: Connection) -> tuple[list[tuple[int, int]], str | None]:
    rows = [tuple(r) for r in conn.execute(text("SELECT id, version FROM auth_state"))]
    return rows, MigrationContext.configure(conn).get_current_revision()


def _diff(conn: Connection) -> list[Any]:
    return compare_metadata(
        MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata
    )


def test_there_is_a_single_head() -> None:
    script = ScriptDirectory.from_config(alembic_config("sqlite+aiosqlite://"))
    assert script.get_heads() == [HEAD]
    assert (MIGRATIONS_DIR / "env.py").is_file()


async def test_upgrade_downgrade_upgrade(blank_db_url: str) -> None:
    assert await _inspect(blank_db_url, _tables) == set()

    await asyncio.to_thread(upgrade, blank_db_url)
    assert await _inspect(blank_db_url, _tables) == TABLES | {"alembic_version"}
    assert {
        "ix_api_keys_tenant_id",
        "ix_tenants_plan_id",
        "ix_usage_records_created_at",
        "ix_usage_records_tenant_id_created_at",
    } <= await _inspect(blank_db_url, _indexes)
    rows, revision = await _inspect(blank_db_url, _state)
    assert rows == [(1, 0)] and revision == HEAD

    await asyncio.to_thread(downgrade, blank_db_url)
    assert await _inspect(blank_db_url, _tables) <= {"alembic_version"}

    await asyncio.to_thread(upgrade, blank_db_url)
    assert await _inspect(blank_db_url, _tables) == TABLES | {"alembic_version"}
    rows, revision = await _inspect(blank_db_url, _state)
    assert rows == [(1, 0)] and revision == HEAD

    # Upgrading an up-to-date database is a no-op.
    await asyncio.to_thread(upgrade, blank_db_url)
    assert (await _inspect(blank_db_url, _state))[1] == HEAD


async def test_adapters_migration_steps_alone(blank_db_url: str) -> None:
    """0002 alone: up from 0001, down to 0001 (dropping only adapters), up again."""
    await asyncio.to_thread(upgrade, blank_db_url, "0001")
    billing = {"price_versions", "usage_daily", "invoices"}
    later = {"adapters", "responses", "files", "batches"}  # made by migrations after 0001
    assert await _inspect(blank_db_url, _tables) == (TABLES - later - billing) | {
        "alembic_version"}
    await asyncio.to_thread(upgrade, blank_db_url)
    assert "adapters" in await _inspect(blank_db_url, _tables)
    await asyncio.to_thread(downgrade, blank_db_url, "0001")
    tables = await _inspect(blank_db_url, _tables)
    assert "adapters" not in tables and "tenants" in tables
    assert (await _inspect(blank_db_url, _state))[1] == "0001"
    await asyncio.to_thread(upgrade, blank_db_url)
    assert (await _inspect(blank_db_url, _state))[1] == HEAD


async def test_migration_matches_the_models(blank_db_url: str) -> None:
    await asyncio.to_thread(upgrade, blank_db_url)
    assert await _inspect(blank_db_url, _diff) == []


async def test_upgrade_called_inside_a_running_loop(blank_db_url: str) -> None:
    """A sync call from async code must not trip over the caller's running loop."""
    upgrade(blank_db_url)
    assert "plans" in await _inspect(blank_db_url, _tables)
    downgrade(blank_db_url)
    assert "plans" not in await _inspect(blank_db_url, _tables)


def test_upgrade_from_plain_sync_code(tmp_path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'sync.db'}"
    upgrade(url)
    tables = asyncio.run(_inspect(url, _tables))
    assert tables >= TABLES


def test_offline_sql_renders_for_postgres(capsys) -> None:
    from alembic import command

    command.upgrade(alembic_config("postgresql+asyncpg://u@h/db"), "head", sql=True)
    sql = capsys.readouterr().out
    assert "CREATE TABLE plans" in sql and "TIMESTAMP WITH TIME ZONE" in sql
    assert "INSERT INTO auth_state" in sql
    assert "CREATE TABLE adapters" in sql and "uq_adapters_tenant_id_alias" in sql
    assert "ADD COLUMN cache_mode" in sql and "ck_plans_cache_mode" in sql
    assert "ADD COLUMN cache_hit" in sql
    assert "ADD COLUMN engine_weight" in sql and "ck_plans_engine_weight" in sql
    assert "ADD COLUMN priority" in sql and "ck_plans_priority" in sql


async def test_upgrade_on_a_caller_provided_connection(blank_db_url: str) -> None:
    """The app may migrate on a connection it already holds (config.attributes)."""
    from alembic import command

    def migrate(conn: Connection) -> None:
        config = alembic_config(blank_db_url)
        config.attributes["connection"] = conn
        command.upgrade(config, "head")

    engine = make_engine(blank_db_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(migrate)
    finally:
        await engine.dispose()
    assert await _inspect(blank_db_url, _tables) == TABLES | {"alembic_version"}


# --- 0003: cache settings -----------------------------------------------------------------

_CACHE_COLUMNS = {
    "plans": {"cache_mode", "semantic_threshold", "cache_ttl_s", "cache_hit_price_percent"},
    "tenants": {"semantic_threshold"},
    "usage_records": {"cache_hit"},
}
_T0 = datetime(2030, 1, 1, tzinfo=UTC)


def _columns(conn: Connection) -> dict[str, set[str]]:
    inspector = inspect(conn)
    return {table: {c["name"] for c in inspector.get_columns(table)} for table in _CACHE_COLUMNS}


def _seed_0002(conn: Connection) -> None:
    """Rows as they were before 0003: the new NOT NULL columns must get server defaults."""
    conn.execute(text("INSERT INTO plans (id, name, budget_period, created_at) "
                      "VALUES ('p1', 'pro', 'month', :t)"), {"t": _T0})
    conn.execute(text("INSERT INTO tenants (id, name, plan_id, status, created_at) "
                      "VALUES ('t1', 'acme', 'p1', 'active', :t)"), {"t": _T0})
    conn.execute(text(
        "INSERT INTO usage_records (request_id, tenant_id, model, deployment, prompt_tokens, "
        "completion_tokens, cached_tokens, cost_micros, status, created_at) "
        "VALUES ('r1', 't1', 'm', 'd', 1, 2, 0, 3, 'ok', :t)"), {"t": _T0})
    conn.commit()


def _cache_rows(conn: Connection) -> tuple[Any, ...]:
    plan = conn.execute(text("SELECT cache_mode, semantic_threshold, cache_ttl_s, "
                             "cache_hit_price_percent FROM plans")).one()
    tenant = conn.execute(text("SELECT semantic_threshold FROM tenants")).one()
    usage = conn.execute(text("SELECT cache_hit FROM usage_records")).one()
    return tuple(plan), tuple(tenant), tuple(usage)


def _bad_cache_mode(conn: Connection) -> None:
    with pytest.raises(IntegrityError):
        conn.execute(text("UPDATE plans SET cache_mode = 'always'"))
    conn.rollback()
    conn.execute(text("UPDATE plans SET cache_mode = 'semantic'"))
    conn.rollback()


def _names(conn: Connection) -> tuple[list[str], ...]:
    queries = ("SELECT name FROM plans", "SELECT name FROM tenants",
               "SELECT request_id FROM usage_records")
    return tuple([row[0] for row in conn.execute(text(sql))] for sql in queries)


async def test_cache_settings_migration_fills_existing_rows(blank_db_url: str) -> None:
    """0003 alone, on data: defaults for old rows, the CHECK holds, downgrade keeps the rows."""
    await asyncio.to_thread(upgrade, blank_db_url, "0002")
    await _inspect(blank_db_url, _seed_0002)
    await asyncio.to_thread(upgrade, blank_db_url)
    columns = await _inspect(blank_db_url, _columns)
    assert all(_CACHE_COLUMNS[table] <= columns[table] for table in _CACHE_COLUMNS)
    assert await _inspect(blank_db_url, _cache_rows) == (("auto", None, None, 0), (None,),
                                                         ("none",))
    await _inspect(blank_db_url, _bad_cache_mode)

    await asyncio.to_thread(downgrade, blank_db_url, "0002")
    columns = await _inspect(blank_db_url, _columns)
    assert all(not _CACHE_COLUMNS[table] & columns[table] for table in _CACHE_COLUMNS)
    assert await _inspect(blank_db_url, _names) == (["pro"], ["acme"], ["r1"])
    assert (await _inspect(blank_db_url, _state))[1] == "0002"

    await asyncio.to_thread(upgrade, blank_db_url)
    assert await _inspect(blank_db_url, _cache_rows) == (("auto", None, None, 0), (None,),
                                                         ("none",))
    assert await _inspect(blank_db_url, _diff) == []


# --- 0005: the plan's engine share --------------------------------------------------------


def _plan_columns(conn: Connection) -> set[str]:
    return {c["name"] for c in inspect(conn).get_columns("plans")}


def _seed_plan(conn: Connection) -> None:
    """A plan as it was before 0005: the new NOT NULL columns must get server defaults."""
    conn.execute(text("INSERT INTO plans (id, name, budget_period, created_at) "
                      "VALUES ('p1', 'pro', 'month', :t)"), {"t": _T0})
    conn.commit()


def _share_rows(conn: Connection) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in conn.execute(text("SELECT name, engine_weight, priority "
                                                "FROM plans ORDER BY name"))]


def _bad_engine_share(conn: Connection) -> None:
    """The CHECKs hold on both backends, whatever path a value takes around the service."""
    for sql in ("UPDATE plans SET engine_weight = 0", "UPDATE plans SET engine_weight = -1",
                "UPDATE plans SET engine_weight = 101", "UPDATE plans SET priority = 11",
                "UPDATE plans SET priority = -11"):
        with pytest.raises(IntegrityError):
            conn.execute(text(sql))
        conn.rollback()
    conn.execute(text("UPDATE plans SET engine_weight = 100, priority = -10"))
    conn.rollback()


async def test_engine_share_migration_fills_existing_rows(blank_db_url: str) -> None:
    """0005 alone, on data: defaults for old plans, the CHECKs hold, downgrade keeps them."""
    await asyncio.to_thread(upgrade, blank_db_url, "0004")
    await _inspect(blank_db_url, _seed_plan)
    await asyncio.to_thread(upgrade, blank_db_url)
    assert {"engine_weight", "priority"} <= await _inspect(blank_db_url, _plan_columns)
    assert await _inspect(blank_db_url, _share_rows) == [("pro", 1.0, 0)]
    await _inspect(blank_db_url, _bad_engine_share)

    await asyncio.to_thread(downgrade, blank_db_url, "0004")
    assert not {"engine_weight", "priority"} & await _inspect(blank_db_url, _plan_columns)
    assert await _inspect(blank_db_url, _names) == (["pro"], [], [])
    assert (await _inspect(blank_db_url, _state))[1] == "0004"

    await asyncio.to_thread(upgrade, blank_db_url)
    assert await _inspect(blank_db_url, _share_rows) == [("pro", 1.0, 0)]
    assert await _inspect(blank_db_url, _diff) == []


# --- 0006: the plan's bound on an embeddings request's work -------------------------------


def _bound_rows(conn: Connection) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in conn.execute(text(
        "SELECT name, embedding_max_request_tokens FROM plans ORDER BY name"))]


async def test_embedding_bound_migration_keeps_existing_plans(blank_db_url: str) -> None:
    """0006 alone, on data: old plans get no bound of their own; downgrade keeps them."""
    await asyncio.to_thread(upgrade, blank_db_url, "0005")
    await _inspect(blank_db_url, _seed_plan)
    await asyncio.to_thread(upgrade, blank_db_url)
    assert await _inspect(blank_db_url, _bound_rows) == [("pro", None)]

    await asyncio.to_thread(downgrade, blank_db_url, "0005")
    assert "embedding_max_request_tokens" not in await _inspect(blank_db_url, _plan_columns)
    assert await _inspect(blank_db_url, _names) == (["pro"], [], [])

    await asyncio.to_thread(upgrade, blank_db_url)
    assert await _inspect(blank_db_url, _diff) == []


# --- 0007: responses kept for the Responses API -------------------------------------------


def _seed_tenant(conn: Connection) -> None:
    conn.execute(text("INSERT INTO plans (id, name, budget_period, created_at) "
                      "VALUES ('p1', 'pro', 'month', :t)"), {"t": _T0})
    conn.execute(text("INSERT INTO tenants (id, name, plan_id, status, created_at) "
                      "VALUES ('t1', 'acme', 'p1', 'active', :t)"), {"t": _T0})
    conn.commit()


def _keep_response(conn: Connection) -> None:
    conn.execute(text(
        "INSERT INTO responses (id, tenant_id, status, body, input_items, history, created_at) "
        "VALUES ('resp_1', 't1', 'completed', '{}', '[]', '[]', :t)"), {"t": _T0})
    conn.commit()


def _response_ids(conn: Connection) -> list[str]:
    return [row[0] for row in conn.execute(text("SELECT id FROM responses"))]


def _drop_tenant(conn: Connection) -> None:
    conn.execute(text("DELETE FROM tenants"))
    conn.commit()


async def test_responses_migration_steps_alone(blank_db_url: str) -> None:
    """0007 alone, on data: the table comes and goes, tenants stay; a tenant's responses go
    with it."""
    await asyncio.to_thread(upgrade, blank_db_url, "0006")
    await _inspect(blank_db_url, _seed_tenant)
    await asyncio.to_thread(upgrade, blank_db_url, "0007")
    await _inspect(blank_db_url, _keep_response)
    assert await _inspect(blank_db_url, _response_ids) == ["resp_1"]
    assert "ix_responses_tenant_id_created_at" in {
        ix["name"] for ix in await _inspect(blank_db_url, lambda c: inspect(c).get_indexes(
            "responses"))}

    await asyncio.to_thread(downgrade, blank_db_url, "0006")
    assert "responses" not in await _inspect(blank_db_url, _tables)
    assert await _inspect(blank_db_url, _names) == (["pro"], ["acme"], [])

    await asyncio.to_thread(upgrade, blank_db_url, "0007")
    await _inspect(blank_db_url, _keep_response)
    await _inspect(blank_db_url, _drop_tenant)
    assert await _inspect(blank_db_url, _response_ids) == []
    await asyncio.to_thread(upgrade, blank_db_url)
    assert await _inspect(blank_db_url, _diff) == []


# --- 0008: files and batches, and the plan's batch price ----------------------------------


def _batch_price_rows(conn: Connection) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in conn.execute(text(
        "SELECT name, batch_price_percent FROM plans ORDER BY name"))]


async def test_batches_migration_keeps_existing_plans(blank_db_url: str) -> None:
    """0008 alone, on data: old plans get the default batch price (50%); downgrade drops the
    files and batches tables and the column, and keeps the plans."""
    await asyncio.to_thread(upgrade, blank_db_url, "0007")
    await _inspect(blank_db_url, _seed_plan)
    await asyncio.to_thread(upgrade, blank_db_url)
    assert await _inspect(blank_db_url, _batch_price_rows) == [("pro", 50)]
    assert {"files", "batches"} <= await _inspect(blank_db_url, _tables)

    await asyncio.to_thread(downgrade, blank_db_url, "0007")
    assert "batch_price_percent" not in await _inspect(blank_db_url, _plan_columns)
    assert not {"files", "batches"} & await _inspect(blank_db_url, _tables)
    assert await _inspect(blank_db_url, _names) == (["pro"], [], [])

    await asyncio.to_thread(upgrade, blank_db_url)
    assert await _inspect(blank_db_url, _diff) == []


# --- 0009: usage records of batch lines ---------------------------------------------------


def _usage_batch_rows(conn: Connection) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in conn.execute(text(
        "SELECT request_id, batch_id, batch_price_percent FROM usage_records "
        "ORDER BY request_id"))]


def _usage_columns(conn: Connection) -> set[str]:
    return {c["name"] for c in inspect(conn).get_columns("usage_records")}


def _record_batch_line(conn: Connection) -> None:
    conn.execute(text(
        "INSERT INTO usage_records (request_id, tenant_id, model, deployment, prompt_tokens, "
        "completion_tokens, cached_tokens, cost_micros, status, created_at, batch_id, "
        "batch_price_percent) "
        "VALUES ('batch_req_1', 't1', 'm', 'd', 1, 2, 0, 3, 'ok', :t, 'batch_1', 50)"),
        {"t": _T0})
    conn.commit()


async def test_usage_batch_columns_migration(blank_db_url: str) -> None:
    """0009 alone, on data: old records are live requests (both columns NULL), a batch line's
    record keeps its batch and share; downgrade drops the columns and keeps the records."""
    await asyncio.to_thread(upgrade, blank_db_url, "0002")
    await _inspect(blank_db_url, _seed_0002)
    await asyncio.to_thread(upgrade, blank_db_url, "0008")
    assert "batch_id" not in await _inspect(blank_db_url, _usage_columns)
    await asyncio.to_thread(upgrade, blank_db_url)
    assert await _inspect(blank_db_url, _usage_batch_rows) == [("r1", None, None)]
    await _inspect(blank_db_url, _record_batch_line)
    assert await _inspect(blank_db_url, _usage_batch_rows) == [
        ("batch_req_1", "batch_1", 50), ("r1", None, None)]
    assert "ix_usage_records_batch_id" in await _inspect(blank_db_url, _indexes)

    await asyncio.to_thread(downgrade, blank_db_url, "0008")
    assert not {"batch_id", "batch_price_percent"} & await _inspect(blank_db_url,
                                                                     _usage_columns)
    assert sorted((await _inspect(blank_db_url, _names))[2]) == ["batch_req_1", "r1"]

    await asyncio.to_thread(upgrade, blank_db_url)
    assert await _inspect(blank_db_url, _diff) == []
