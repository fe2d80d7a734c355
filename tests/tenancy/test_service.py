"""Tenancy data functions against a migrated database (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import re
import time
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from tenancy import service
from tenancy.db import make_sessionmaker
from tenancy.keys import parse_key, verify_secret
from tenancy.models import ApiKey, Plan, Tenant, UsageRecord
from tenancy.service import ConflictError, InvalidError, NotFoundError


async def make_tenant(session: AsyncSession, name: str = "acme", **plan_fields: object) -> Tenant:
    plan = await service.create_plan(session, name=f"plan-{name}", **plan_fields)  # type: ignore[arg-type]
    return await service.create_tenant(session, name=name, plan_id=plan.id)


async def test_plan_tenant_key_and_key_context(session: AsyncSession, pepper: bytes) -> None:
    plan = await service.create_plan(
        session,
        name="pro",
        rpm=60,
        tpm=100_000,
        max_concurrent=4,
        budget_micros=25_000_000,
        budget_period="day",
        allowed_models=["m1", "m2"],
        allowed_tiers=["economy"],
    )
    tenant = await service.create_tenant(session, name="acme", plan_id=plan.id)
    expires = datetime.now(UTC) + timedelta(days=1)
    key, full = await service.create_api_key(
        session,
        tenant_id=tenant.id,
        pepper=pepper,
        name="ci",
        expires_at=expires,
        rpm=10,
        allowed_models=["m1"],
        allowed_adapters=["lora-a"],
    )
    parsed = parse_key(full)
    assert parsed is not None and not parsed.admin and parsed.key_id == key.id
    assert key.secret_hash != parsed.secret and parsed.secret not in key.secret_hash
    assert len(plan.id) == 32 and len(tenant.id) == 32 and tenant.status == "active"

    ctx = await service.load_key_context(session, key_id=key.id)
    assert ctx is not None
    assert (ctx.key_id, ctx.tenant_id, ctx.tenant_name) == (key.id, tenant.id, "acme")
    assert verify_secret(pepper, parsed.secret, ctx.secret_hash)
    assert ctx.expires_at == pytest.approx(expires.timestamp(), abs=1e-3)
    assert ctx.usable(time.time()) is None
    assert (ctx.rpm, ctx.tpm, ctx.max_concurrent) == (10, None, None)
    assert ctx.allowed_models == frozenset({"m1"})
    assert ctx.allowed_adapters == frozenset({"lora-a"})
    assert ctx.plan.rpm == 60 and ctx.plan.tpm == 100_000 and ctx.plan.max_concurrent == 4
    assert ctx.plan.budget_micros == 25_000_000 and ctx.plan.budget_period == "day"
    assert ctx.plan.allowed_tiers == frozenset({"economy"})
    assert ctx.may_use_model("m1") and not ctx.may_use_model("m2")
    assert await service.load_key_context(session, key_id="nosuchkey123") is None


async def test_unrestricted_lists_are_stored_as_null(session: AsyncSession, pepper: bytes) -> None:
    tenant = await make_tenant(session)
    key, _ = await service.create_api_key(session, tenant_id=tenant.id, pepper=pepper)
    ctx = await service.load_key_context(session, key_id=key.id)
    assert ctx is not None
    assert ctx.plan.allowed_models is None and ctx.plan.allowed_tiers is None
    assert ctx.allowed_models is None and ctx.allowed_adapters is None
    assert ctx.plan.rpm is None and ctx.expires_at is None
    stored = await session.scalar(
        select(ApiKey.id).where(ApiKey.id == key.id, ApiKey.allowed_models.is_(None))
    )
    assert stored == key.id
    # An empty list is a real restriction ("nothing"), distinct from None ("everything").
    empty, _ = await service.create_api_key(
        session, tenant_id=tenant.id, pepper=pepper, allowed_models=[]
    )
    ctx = await service.load_key_context(session, key_id=empty.id)
    assert ctx is not None and ctx.allowed_models == frozenset()
    assert not ctx.may_use_model("m")


async def test_every_mutation_bumps_the_auth_version(session: AsyncSession, pepper: bytes) -> None:
    versions = [await service.auth_version(session)]

    async def bumped() -> None:
        versions.append(await service.auth_version(session))
        assert versions[-1] == versions[-2] + 1

    plan = await service.create_plan(session, name="p")
    await bumped()
    await service.update_plan(session, plan_id=plan.id, rpm=5)
    await bumped()
    tenant = await service.create_tenant(session, name="t", plan_id=plan.id)
    await bumped()
    await service.update_tenant(session, tenant_id=tenant.id, status="suspended")
    await bumped()
    # Cache settings reach cached KeyContexts the same way.
    await service.update_plan(session, plan_id=plan.id, cache_mode="semantic",
                              semantic_threshold=0.9, cache_ttl_s=60, cache_hit_price_percent=10)
    await bumped()
    await service.update_tenant(session, tenant_id=tenant.id, semantic_threshold=0.95)
    await bumped()
    # So do the engine share settings.
    await service.update_plan(session, plan_id=plan.id, engine_weight=3.0, priority=-2)
    await bumped()
    await service.update_tenant(session, tenant_id=tenant.id, semantic_threshold=None)
    await bumped()
    key, _ = await service.create_api_key(session, tenant_id=tenant.id, pepper=pepper)
    await bumped()
    await service.revoke_api_key(session, key_id=key.id)
    await bumped()
    admin, _ = await service.create_admin_key(session, pepper=pepper, name="ops")
    await bumped()
    await service.revoke_admin_key(session, key_id=admin.id)
    await bumped()

    # Reads, and no-op revocations, leave it alone.
    await service.list_plans(session)
    await service.load_key_context(session, key_id=key.id)
    await service.revoke_api_key(session, key_id=key.id)
    await service.revoke_admin_key(session, key_id=admin.id)
    assert await service.auth_version(session) == versions[-1]


async def test_revocation_is_visible_to_another_session(
    db_engine: AsyncEngine, session: AsyncSession, pepper: bytes
) -> None:
    tenant = await make_tenant(session)
    key, _ = await service.create_api_key(session, tenant_id=tenant.id, pepper=pepper)
    async with make_sessionmaker(db_engine)() as replica:
        before = await service.auth_version(replica)
        ctx = await service.load_key_context(replica, key_id=key.id)
        assert ctx is not None and ctx.usable(time.time()) is None
        await replica.rollback()  # end the read transaction, as a poller's session would

        revoked = await service.revoke_api_key(session, key_id=key.id)
        assert revoked is not None and revoked.revoked_at is not None

        assert await service.auth_version(replica) == before + 1
        ctx = await service.load_key_context(replica, key_id=key.id)
        assert ctx is not None and ctx.revoked and ctx.usable(time.time()) == "revoked"


async def test_key_scoping_between_tenants(session: AsyncSession, pepper: bytes) -> None:
    a = await make_tenant(session, "a")
    b = await make_tenant(session, "b")
    key_a, _ = await service.create_api_key(session, tenant_id=a.id, pepper=pepper)
    key_b, _ = await service.create_api_key(session, tenant_id=b.id, pepper=pepper)

    assert [k.id for k in await service.list_api_keys(session, tenant_id=a.id)] == [key_a.id]
    assert await service.get_api_key(session, key_id=key_a.id, tenant_id=b.id) is None
    assert await service.revoke_api_key(session, key_id=key_a.id, tenant_id=b.id) is None
    own = await service.get_api_key(session, key_id=key_a.id, tenant_id=a.id)
    assert own is not None and own.revoked_at is None
    ctx = await service.load_key_context(session, key_id=key_a.id)
    assert ctx is not None and not ctx.revoked

    # Unscoped (admin) access reaches any key.
    assert (await service.get_api_key(session, key_id=key_b.id)) is not None
    revoked = await service.revoke_api_key(session, key_id=key_b.id, tenant_id=b.id)
    assert revoked is not None and revoked.revoked_at is not None
    assert await service.revoke_api_key(session, key_id="nosuchkey123") is None


async def test_expired_and_suspended(session: AsyncSession, pepper: bytes) -> None:
    tenant = await make_tenant(session)
    past = datetime.now(UTC) - timedelta(seconds=1)
    expired, _ = await service.create_api_key(
        session, tenant_id=tenant.id, pepper=pepper, expires_at=past
    )
    fine, _ = await service.create_api_key(session, tenant_id=tenant.id, pepper=pepper)
    now = time.time()
    ctx = await service.load_key_context(session, key_id=expired.id)
    assert ctx is not None and ctx.usable(now) == "expired"

    await service.update_tenant(session, tenant_id=tenant.id, status="suspended")
    ctx = await service.load_key_context(session, key_id=fine.id)
    assert ctx is not None and not ctx.tenant_active and ctx.usable(now) == "tenant suspended"

    reactivated = await service.update_tenant(session, tenant_id=tenant.id, status="active")
    assert reactivated is not None and reactivated.status == "active"
    ctx = await service.load_key_context(session, key_id=fine.id)
    assert ctx is not None and ctx.usable(now) is None


async def test_plan_changes_reach_the_key_context(session: AsyncSession, pepper: bytes) -> None:
    tenant = await make_tenant(session, rpm=10)
    key, _ = await service.create_api_key(session, tenant_id=tenant.id, pepper=pepper)
    bigger = await service.create_plan(session, name="bigger", rpm=1000, allowed_models=["x"])
    moved = await service.update_tenant(session, tenant_id=tenant.id, plan_id=bigger.id)
    assert moved is not None and moved.plan_id == bigger.id
    ctx = await service.load_key_context(session, key_id=key.id)
    assert ctx is not None and ctx.plan.rpm == 1000

    updated = await service.update_plan(session, plan_id=bigger.id, rpm=None, allowed_models=None)
    assert updated is not None and updated.rpm is None
    ctx = await service.load_key_context(session, key_id=key.id)
    assert ctx is not None and ctx.plan.rpm is None and ctx.plan.allowed_models is None


async def test_validation_errors(session: AsyncSession, pepper: bytes) -> None:
    plan = await service.create_plan(session, name="basic")
    tenant = await service.create_tenant(session, name="acme", plan_id=plan.id)
    with pytest.raises(ConflictError):
        await service.create_plan(session, name="basic")
    with pytest.raises(ConflictError):
        await service.create_tenant(session, name="acme", plan_id=plan.id)
    with pytest.raises(NotFoundError):
        await service.create_tenant(session, name="other", plan_id="nope")
    with pytest.raises(NotFoundError):
        await service.create_api_key(session, tenant_id="nope", pepper=pepper)
    with pytest.raises(NotFoundError):
        await service.update_tenant(session, tenant_id=tenant.id, plan_id="nope")
    with pytest.raises(InvalidError):
        await service.update_tenant(session, tenant_id=tenant.id, status="deleted")
    with pytest.raises(InvalidError):
        await service.create_plan(session, name="weekly", budget_period="week")
    with pytest.raises(InvalidError):
        await service.create_plan(session, name="neg", rpm=-1)
    with pytest.raises(InvalidError):
        await service.create_plan(session, name="  ")
    with pytest.raises(InvalidError):
        await service.create_plan(session, name="str-list", allowed_models="m1")  # type: ignore[arg-type]
    with pytest.raises(InvalidError):
        await service.update_plan(session, plan_id=plan.id, colour="red")
    with pytest.raises(InvalidError):
        await service.create_api_key(
            session, tenant_id=tenant.id, pepper=pepper, expires_at=datetime(2030, 1, 1)
        )
    other = await service.create_plan(session, name="other")
    with pytest.raises(ConflictError):
        await service.update_plan(session, plan_id=other.id, name="basic")
    assert await service.update_plan(session, plan_id="nope", rpm=1) is None
    assert await service.update_tenant(session, tenant_id="nope", status="active") is None
    # The session is still usable after all those refusals.
    assert [p.name for p in await service.list_plans(session)] == ["basic", "other"]
    assert [t.name for t in await service.list_tenants(session)] == ["acme"]


async def test_unique_names_hold_under_a_race(db_engine: AsyncEngine) -> None:
    """Two sessions pass the pre-check together: the database constraint still decides."""
    sessionmaker = make_sessionmaker(db_engine)

    async def attempt() -> str:
        async with sessionmaker() as s:
            try:
                await service.create_plan(s, name="same")
            except ConflictError:
                return "conflict"
            return "ok"

    results = sorted(await asyncio.gather(*(attempt() for _ in range(4))))
    assert results.count("ok") == 1 and results.count("conflict") == 3


async def test_concurrent_mutations_each_bump_once(db_engine: AsyncEngine) -> None:
    sessionmaker = make_sessionmaker(db_engine)
    async with sessionmaker() as s:
        start = await service.auth_version(s)

    async def create(i: int) -> None:
        async with sessionmaker() as s:
            await service.create_plan(s, name=f"plan-{i}")

    await asyncio.gather(*(create(i) for i in range(12)))
    async with sessionmaker() as s:
        assert await service.auth_version(s) == start + 12


async def test_foreign_keys_are_enforced(session: AsyncSession) -> None:
    session.add(Tenant(name="orphan", plan_id="missing", status="active"))
    with pytest.raises(IntegrityError):
        await session.commit()
    await session.rollback()


async def test_admin_keys(session: AsyncSession, pepper: bytes) -> None:
    assert await service.count_admin_keys(session) == 0
    first, full = await service.create_admin_key(session, pepper=pepper, name="bootstrap")
    second, _ = await service.create_admin_key(session, pepper=pepper, name="ops")
    parsed = parse_key(full)
    assert parsed is not None and parsed.admin and parsed.key_id == first.id
    assert await service.count_admin_keys(session) == 2

    ctx = await service.load_admin_context(session, key_id=first.id)
    assert ctx is not None and ctx.name == "bootstrap" and not ctx.revoked
    assert verify_secret(pepper, parsed.secret, ctx.secret_hash)
    # Admin ids do not resolve as tenant keys.
    assert await service.load_key_context(session, key_id=first.id) is None

    revoked = await service.revoke_admin_key(session, key_id=first.id)
    assert revoked is not None and revoked.revoked_at is not None
    assert await service.count_admin_keys(session) == 1
    ctx = await service.load_admin_context(session, key_id=first.id)
    assert ctx is not None and ctx.revoked
    assert [k.id for k in await service.list_admin_keys(session)] == [first.id, second.id]
    assert await service.revoke_admin_key(session, key_id="nosuchkey123") is None
    assert await service.load_admin_context(session, key_id="nosuchkey123") is None


async def test_timestamps_are_aware_utc(session: AsyncSession, pepper: bytes) -> None:
    tenant = await make_tenant(session)
    plus_two = timezone(timedelta(hours=2))
    expires = datetime(2031, 6, 1, 14, 30, tzinfo=plus_two)
    key, _ = await service.create_api_key(
        session, tenant_id=tenant.id, pepper=pepper, expires_at=expires
    )
    session.expunge_all()
    stored = await service.get_api_key(session, key_id=key.id)
    assert stored is not None and stored.expires_at is not None
    assert stored.expires_at == expires
    assert stored.expires_at.utcoffset() == timedelta(0)
    assert stored.created_at.tzinfo is not None
    assert abs((datetime.now(UTC) - stored.created_at).total_seconds()) < 60


async def insert_records(session: AsyncSession, records: list[dict[str, object]]) -> None:
    await session.execute(insert(UsageRecord), records)
    await session.commit()


async def test_usage_records_hold_64_bit_costs_and_tz_aware_times(session: AsyncSession) -> None:
    a = await make_tenant(session, "a")
    b = await make_tenant(session, "b")
    t0 = datetime(2030, 1, 1, tzinfo=UTC)

    def rec(tenant: str, model: str, hours: int, cost: int) -> dict[str, object]:
        return {"request_id": f"req-{tenant}-{model}-{hours}", "tenant_id": tenant,
                "key_id": "abcdefgh1234", "model": model, "deployment": "embedded",
                "prompt_tokens": 10, "completion_tokens": 5, "cached_tokens": 2,
                "cost_micros": cost, "status": "ok", "created_at": t0 + timedelta(hours=hours)}

    big = 5_000_000_000  # > 2**31 micro-USD: needs 64-bit columns
    await insert_records(session, [rec(a.id, "m1", 0, 100), rec(a.id, "m1", 1, 200),
                                   rec(a.id, "m2", 2, big), rec(b.id, "m1", 1, 999)])
    rows = await session.execute(
        select(UsageRecord.model, func.count(), func.sum(UsageRecord.cost_micros))
        .where(UsageRecord.tenant_id == a.id).group_by(UsageRecord.model)
        .order_by(UsageRecord.model))
    assert [tuple(r) for r in rows] == [("m1", 2, 300), ("m2", 1, big)]
    latest = await session.scalar(select(func.max(UsageRecord.created_at)))
    assert latest == t0 + timedelta(hours=2) and latest.utcoffset() == timedelta(0)


async def test_usage_defaults_fill_missing_columns(session: AsyncSession) -> None:
    await insert_records(session, [{"request_id": "r1", "tenant_id": "t", "key_id": None,
                                    "model": "m"}])
    only = await session.scalar(select(UsageRecord).where(UsageRecord.request_id == "r1"))
    assert only is not None
    assert (only.prompt_tokens, only.cost_micros, only.status, only.cache_hit) == (
        0, 0, "ok", "none")
    assert abs((datetime.now(UTC) - only.created_at).total_seconds()) < 60


# --- response-cache settings --------------------------------------------------------------


async def test_cache_settings_default_and_round_trip(
    session: AsyncSession, pepper: bytes
) -> None:
    plain = await make_tenant(session, "plain")
    plain_key, _ = await service.create_api_key(session, tenant_id=plain.id, pepper=pepper)
    ctx = await service.load_key_context(session, key_id=plain_key.id)
    assert ctx is not None and ctx.tenant_semantic_threshold is None
    assert (ctx.plan.cache_mode, ctx.plan.semantic_threshold, ctx.plan.cache_ttl_s,
            ctx.plan.cache_hit_price_percent) == ("auto", None, None, 0)
    assert ctx.semantic_threshold(0.92) == 0.92

    plan = await service.create_plan(session, name="cached", cache_mode="semantic",
                                     semantic_threshold=0.85, cache_ttl_s=3600,
                                     cache_hit_price_percent=25)
    tenant = await service.create_tenant(session, name="acme", plan_id=plan.id,
                                         semantic_threshold=0.9)
    key, _ = await service.create_api_key(session, tenant_id=tenant.id, pepper=pepper)
    session.expunge_all()  # read back what the database holds, not the identity map
    stored = await service.get_plan(session, plan_id=plan.id)
    assert stored is not None
    assert (stored.cache_mode, stored.semantic_threshold, stored.cache_ttl_s,
            stored.cache_hit_price_percent) == ("semantic", 0.85, 3600, 25)
    ctx = await service.load_key_context(session, key_id=key.id)
    assert ctx is not None
    assert (ctx.plan.cache_mode, ctx.plan.semantic_threshold, ctx.plan.cache_ttl_s,
            ctx.plan.cache_hit_price_percent) == ("semantic", 0.85, 3600, 25)
    assert ctx.tenant_semantic_threshold == 0.9 and ctx.semantic_threshold(0.5) == 0.9

    # Leaving semantic_threshold out keeps it; None clears it back to the plan's.
    moved = await service.update_tenant(session, tenant_id=tenant.id, status="active")
    assert moved is not None and moved.semantic_threshold == 0.9
    cleared = await service.update_tenant(session, tenant_id=tenant.id, semantic_threshold=None)
    assert cleared is not None and cleared.semantic_threshold is None
    ctx = await service.load_key_context(session, key_id=key.id)
    assert ctx is not None and ctx.semantic_threshold(0.5) == 0.85

    updated = await service.update_plan(session, plan_id=plan.id, cache_mode="off",
                                        semantic_threshold=None, cache_ttl_s=None,
                                        cache_hit_price_percent=100)
    assert updated is not None and updated.cache_mode == "off"
    session.expunge_all()
    ctx = await service.load_key_context(session, key_id=key.id)
    assert ctx is not None
    assert (ctx.plan.cache_mode, ctx.plan.semantic_threshold, ctx.plan.cache_ttl_s,
            ctx.plan.cache_hit_price_percent) == ("off", None, None, 100)
    assert ctx.semantic_threshold(0.5) == 0.5
    # An integer threshold of 1 is stored as the float 1.0 (exact matches only).
    one = await service.update_tenant(session, tenant_id=tenant.id, semantic_threshold=1)
    assert one is not None and one.semantic_threshold == 1.0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cache_mode": "sometimes"}, "cache_mode must be one of off, auto, exact, semantic"),
        ({"cache_mode": None}, "cache_mode must be one of"),
        ({"semantic_threshold": 0}, "semantic_threshold must be a number in (0, 1]"),
        ({"semantic_threshold": -0.5}, "semantic_threshold"),
        ({"semantic_threshold": 1.01}, "semantic_threshold"),
        ({"semantic_threshold": float("nan")}, "semantic_threshold"),
        ({"semantic_threshold": True}, "semantic_threshold"),
        ({"semantic_threshold": "0.9"}, "semantic_threshold"),
        ({"cache_ttl_s": 0}, "cache_ttl_s must be an integer in [1, 2147483647] or null"),
        ({"cache_ttl_s": 2**31}, "cache_ttl_s"),
        ({"cache_ttl_s": 1.5}, "cache_ttl_s"),
        ({"cache_hit_price_percent": -1}, "cache_hit_price_percent must be an integer in [0, 100]"),
        ({"cache_hit_price_percent": 101}, "cache_hit_price_percent"),
        ({"cache_hit_price_percent": None}, "cache_hit_price_percent"),
        ({"cache_hit_price_percent": 50.0}, "cache_hit_price_percent"),
    ],
)
async def test_cache_settings_validation(
    session: AsyncSession, fields: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidError, match=re.escape(message)):
        await service.create_plan(session, name="bad", **fields)  # type: ignore[arg-type]
    plan = await service.create_plan(session, name="good")
    with pytest.raises(InvalidError, match=re.escape(message)):
        await service.update_plan(session, plan_id=plan.id, **fields)
    session.expunge_all()
    stored = await service.get_plan(session, plan_id=plan.id)
    assert stored is not None and (stored.cache_mode, stored.cache_hit_price_percent) == ("auto", 0)
    assert [p.name for p in await service.list_plans(session)] == ["good"]


@pytest.mark.parametrize("threshold", [0, -0.1, 1.5, float("inf"), True])
async def test_tenant_threshold_validation(session: AsyncSession, threshold: object) -> None:
    plan = await service.create_plan(session, name="p")
    with pytest.raises(InvalidError, match="semantic_threshold"):
        await service.create_tenant(session, name="bad", plan_id=plan.id,
                                    semantic_threshold=threshold)  # type: ignore[arg-type]
    tenant = await service.create_tenant(session, name="ok", plan_id=plan.id,
                                         semantic_threshold=0.8)
    with pytest.raises(InvalidError, match="semantic_threshold"):
        await service.update_tenant(session, tenant_id=tenant.id,
                                    semantic_threshold=threshold)  # type: ignore[arg-type]
    session.expunge_all()
    stored = await service.get_tenant(session, tenant_id=tenant.id)
    assert stored is not None and stored.semantic_threshold == 0.8


async def test_cache_mode_check_constraint(session: AsyncSession) -> None:
    """The database refuses an unknown mode even past the service's validation."""
    session.add(Plan(name="raw", cache_mode="always"))
    with pytest.raises(IntegrityError):
        await session.commit()
    await session.rollback()


# --- engine share ---------------------------------------------------------------------------


async def test_engine_share_defaults_round_trip_and_reach_the_key_context(
    session: AsyncSession, pepper: bytes
) -> None:
    plain = await make_tenant(session, "plain")
    plain_key, _ = await service.create_api_key(session, tenant_id=plain.id, pepper=pepper)
    ctx = await service.load_key_context(session, key_id=plain_key.id)
    assert ctx is not None and (ctx.plan.engine_weight, ctx.plan.priority) == (1.0, 0)

    plan = await service.create_plan(session, name="heavy", engine_weight=2.5, priority=-3)
    tenant = await service.create_tenant(session, name="acme", plan_id=plan.id)
    key, _ = await service.create_api_key(session, tenant_id=tenant.id, pepper=pepper)
    session.expunge_all()  # read back what the database holds, not the identity map
    stored = await service.get_plan(session, plan_id=plan.id)
    assert stored is not None and (stored.engine_weight, stored.priority) == (2.5, -3)
    ctx = await service.load_key_context(session, key_id=key.id)
    assert ctx is not None and (ctx.plan.engine_weight, ctx.plan.priority) == (2.5, -3)

    # The bounds are inclusive where they say so; an integer weight is stored as a float.
    updated = await service.update_plan(session, plan_id=plan.id, engine_weight=100,
                                        priority=10)
    assert updated is not None
    session.expunge_all()
    ctx = await service.load_key_context(session, key_id=key.id)
    assert ctx is not None and (ctx.plan.engine_weight, ctx.plan.priority) == (100.0, 10)
    assert isinstance(ctx.plan.engine_weight, float)
    # Leaving them out of an update keeps them.
    await service.update_plan(session, plan_id=plan.id, rpm=5)
    session.expunge_all()
    ctx = await service.load_key_context(session, key_id=key.id)
    assert ctx is not None and (ctx.plan.engine_weight, ctx.plan.priority) == (100.0, 10)
    small = await service.update_plan(session, plan_id=plan.id, engine_weight=1e-3,
                                      priority=-10)
    assert small is not None and (small.engine_weight, small.priority) == (1e-3, -10)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"engine_weight": 0}, "engine_weight must be a finite number in (0, 100]"),
        ({"engine_weight": 0.0}, "engine_weight"),
        ({"engine_weight": -1}, "engine_weight"),
        ({"engine_weight": 101}, "engine_weight"),
        ({"engine_weight": 100.0001}, "engine_weight"),
        ({"engine_weight": float("nan")}, "engine_weight"),
        ({"engine_weight": float("inf")}, "engine_weight"),
        ({"engine_weight": None}, "engine_weight"),
        ({"engine_weight": True}, "engine_weight"),
        ({"engine_weight": "2"}, "engine_weight"),
        ({"priority": 11}, "priority must be an integer in [-10, 10]"),
        ({"priority": -11}, "priority"),
        ({"priority": None}, "priority"),
        ({"priority": 1.0}, "priority"),
        ({"priority": True}, "priority"),
        ({"embedding_max_request_tokens": 0},
         "embedding_max_request_tokens must be an integer in [1, 2147483647] or null"),
        ({"embedding_max_request_tokens": 2**31}, "embedding_max_request_tokens"),
        ({"embedding_max_request_tokens": 1.5}, "embedding_max_request_tokens"),
    ],
)
async def test_engine_share_validation(
    session: AsyncSession, fields: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidError, match=re.escape(message)):
        await service.create_plan(session, name="bad", **fields)  # type: ignore[arg-type]
    plan = await service.create_plan(session, name="good", engine_weight=2.0, priority=1)
    with pytest.raises(InvalidError, match=re.escape(message)):
        await service.update_plan(session, plan_id=plan.id, **fields)
    session.expunge_all()
    stored = await service.get_plan(session, plan_id=plan.id)
    assert stored is not None and (stored.engine_weight, stored.priority) == (2.0, 1)
    assert [p.name for p in await service.list_plans(session)] == ["good"]


@pytest.mark.parametrize("fields", [{"engine_weight": 0.0}, {"engine_weight": 101.0},
                                    {"priority": 11}, {"priority": -11}])
async def test_engine_share_check_constraints(
    session: AsyncSession, fields: dict[str, object]
) -> None:
    """The database refuses an out-of-range share even past the service's validation."""
    session.add(Plan(name="raw", **fields))
    with pytest.raises(IntegrityError):
        await session.commit()
    await session.rollback()


async def test_usage_records_carry_the_cache_hit_kind(session: AsyncSession) -> None:
    base = {"tenant_id": "t", "key_id": None, "model": "m"}
    await insert_records(session, [
        {**base, "request_id": "miss"},  # no cache_hit key: the default fills it
        {**base, "request_id": "exact", "cache_hit": "exact", "cost_micros": 0},
        {**base, "request_id": "semantic", "cache_hit": "semantic"},
    ])
    rows = await session.execute(
        select(UsageRecord.request_id, UsageRecord.cache_hit).order_by(UsageRecord.request_id)
    )
    assert [tuple(row) for row in rows] == [("exact", "exact"), ("miss", "none"),
                                            ("semantic", "semantic")]


async def test_embedding_bound_round_trips_and_reaches_the_key_context(
    session: AsyncSession, pepper: bytes
) -> None:
    plan = await service.create_plan(session, name="bounded", embedding_max_request_tokens=4096)
    tenant = await service.create_tenant(session, name="acme", plan_id=plan.id)
    key, _ = await service.create_api_key(session, tenant_id=tenant.id, pepper=pepper)
    session.expunge_all()
    ctx = await service.load_key_context(session, key_id=key.id)
    assert ctx is not None and ctx.plan.embedding_max_request_tokens == 4096
    await service.update_plan(session, plan_id=plan.id, embedding_max_request_tokens=None)
    session.expunge_all()
    ctx = await service.load_key_context(session, key_id=key.id)
    assert ctx is not None and ctx.plan.embedding_max_request_tokens is None
