"""Adapter rows (`tenancy.adapters`) on SQLite and PostgreSQL: per-tenant names and aliases,
validation, and the auth-version bump every change makes (what replicas' caches follow)."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncSession

from tenancy import adapters, service
from tenancy.models import Tenant
from tenancy.service import ConflictError, InvalidError, NotFoundError


async def make_tenant(session: AsyncSession, name: str) -> Tenant:
    plan = await service.create_plan(session, name=f"plan-{name}")
    return await service.create_tenant(session, name=name, plan_id=plan.id)


async def test_create_get_list_delete(session: AsyncSession) -> None:
    acme = await make_tenant(session, "acme")
    before = await service.auth_version(session)
    created = await adapters.create_adapter(
        session, tenant_id=acme.id, name=" support-v2 ", base_model="tiny", path="/srv/a",
        alias="support", pinned=True)
    assert (created.name, created.alias, created.pinned, created.uploaded) == (
        "support-v2", "support", True, False)
    assert len(created.id) == 32 and created.created_at.tzinfo is not None
    assert await service.auth_version(session) == before + 1

    await adapters.create_adapter(session, tenant_id=acme.id, name="billing", base_model="tiny",
                                  path="/srv/b", uploaded=True)
    assert [a.name for a in await adapters.list_adapters(session, tenant_id=acme.id)] == [
        "billing", "support-v2"]
    assert await adapters.count_adapters(session, tenant_id=acme.id) == 2
    by_name = await adapters.get_adapter(session, tenant_id=acme.id, name="support-v2")
    by_alias = await adapters.get_adapter_by_alias(session, tenant_id=acme.id, alias="support")
    assert by_name is not None and by_alias is not None and by_name.id == by_alias.id
    ctx = adapters.adapter_context(by_name)
    assert (ctx.tenant_id, ctx.name, ctx.base_model, ctx.path, ctx.alias, ctx.pinned) == (
        acme.id, "support-v2", "tiny", "/srv/a", "support", True)

    unpinned = await adapters.set_adapter_pinned(session, tenant_id=acme.id, name="support-v2",
                                                 pinned=False)
    assert unpinned is not None and not unpinned.pinned
    assert await service.auth_version(session) == before + 3

    deleted = await adapters.delete_adapter(session, tenant_id=acme.id, name="support-v2")
    assert deleted is not None and deleted.path == "/srv/a"
    assert await service.auth_version(session) == before + 4
    assert await adapters.get_adapter(session, tenant_id=acme.id, name="support-v2") is None
    assert await adapters.delete_adapter(session, tenant_id=acme.id, name="support-v2") is None
    assert await service.auth_version(session) == before + 4  # nothing deleted, no bump


async def test_names_and_aliases_are_per_tenant(session: AsyncSession) -> None:
    a = await make_tenant(session, "a")
    b = await make_tenant(session, "b")
    await adapters.create_adapter(session, tenant_id=a.id, name="ft", base_model="m",
                                  path="/a", alias="mine")
    # The same name and alias in another tenant are another adapter entirely.
    other = await adapters.create_adapter(session, tenant_id=b.id, name="ft", base_model="m",
                                          path="/b", alias="mine")
    assert (await adapters.get_adapter(session, tenant_id=b.id, name="ft")).id == other.id
    assert (await adapters.get_adapter_by_alias(session, tenant_id=a.id, alias="mine")
            ).path == "/a"
    assert [x.path for x in await adapters.list_adapters(session, tenant_id=b.id)] == ["/b"]

    with pytest.raises(ConflictError, match="named 'ft'"):
        await adapters.create_adapter(session, tenant_id=a.id, name="ft", base_model="m",
                                      path="/c")
    with pytest.raises(ConflictError, match="alias 'mine'"):
        await adapters.create_adapter(session, tenant_id=a.id, name="ft2", base_model="m",
                                      path="/c", alias="mine")
    # Many adapters may go without an alias (NULLs never clash).
    for name in ("x1", "x2"):
        await adapters.create_adapter(session, tenant_id=a.id, name=name, base_model="m",
                                      path="/x")
    with pytest.raises(NotFoundError):
        await adapters.create_adapter(session, tenant_id="nope", name="z", base_model="m",
                                      path="/z")


@pytest.mark.parametrize("fields", [
    {"name": ""}, {"name": "a:b"}, {"name": "a/b"}, {"name": "../up"}, {"name": "a b"},
    {"name": "x" * 201}, {"name": "a\x00"}, {"alias": "m:x"}, {"alias": ""}, {"alias": "a/b"},
    {"base_model": "tiny:x"}, {"base_model": ""}, {"path": ""}, {"path": "/a\x00"},
    {"path": "relative/folder"},
])
async def test_invalid_fields_are_refused(session: AsyncSession, fields: dict) -> None:
    tenant = await make_tenant(session, "acme")
    values = {"name": "ok", "base_model": "tiny", "path": "/srv/ok", **fields}
    with pytest.raises(InvalidError):
        await adapters.create_adapter(session, tenant_id=tenant.id, **values)
    assert await adapters.list_adapters(session, tenant_id=tenant.id) == []


def test_tokens() -> None:
    assert adapters.is_adapter_token("support-v2.1_x")
    for bad in ("", "a:b", "a/b", ".hidden", "-x", "x" * 201, "a\x00"):
        assert not adapters.is_adapter_token(bad), bad
