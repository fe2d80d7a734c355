"""Revocation, suspension, expiry and new keys across two replicas on one database.

Two in-process gateway apps share a database (both backends) and run the shipped auth poll
interval. A change made through replica one must reach replica two within 2 seconds: each
test polls replica two in a bounded loop, records the elapsed time (`record_property`, shown
in JUnit reports) and asserts it. The replica that made the change applies it at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from gateway.settings import Settings
from tenancy import api_keys
from tenancy.keys import generate_key
from tests.gateway.support import (
    Seeded,
    admin_key,
    bearer,
    gateway_client,
    mock_settings,
    seed_tenant,
)

SHIPPED_POLL_S = Settings.model_fields["auth_poll_interval_s"].default
PROPAGATION_LIMIT_S = 2.0
GIVE_UP_S = 5.0  # bound on every polling loop
CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@dataclass
class Replicas:
    one: httpx.AsyncClient
    two: httpx.AsyncClient
    admin: dict[str, str]  # headers with the bootstrap admin key
    tenant: Seeded

    async def new_key(self, **fields: Any) -> dict[str, Any]:
        r = await self.one.post(f"/admin/tenants/{self.tenant.tenant_id}/keys",
                                headers=self.admin, json=fields)
        assert r.status_code == 201, r.text
        return r.json()


@pytest.fixture
async def replicas(db_url, tmp_path, mock_upstream) -> AsyncIterator[Replicas]:
    admin = bearer(await admin_key(db_url, tmp_path))
    tenant = await seed_tenant(db_url, tmp_path, name="acme", plan={"rpm": 100_000})
    cfg = mock_settings(db_url, tmp_path, mock_upstream.base_url,
                        auth_poll_interval_s=SHIPPED_POLL_S)
    async with gateway_client(cfg) as one, gateway_client(cfg) as two:
        yield Replicas(one, two, admin, tenant)


async def chat_status(client: httpx.AsyncClient, key: str) -> int:
    return (await client.post("/v1/chat/completions", json=CHAT, headers=bearer(key))).status_code


async def seconds_until(client: httpx.AsyncClient, key: str, status: int) -> float:
    """Seconds until `key` gets `status` from this replica; inf if not within GIVE_UP_S."""
    started = time.monotonic()
    while time.monotonic() - started < GIVE_UP_S:
        if await chat_status(client, key) == status:
            return time.monotonic() - started
        await asyncio.sleep(0.01)
    return float("inf")


async def assert_works_on_both(replicas: Replicas, key: str) -> None:
    """A 200 on both replicas, which also puts the key into both caches."""
    assert await chat_status(replicas.one, key) == 200
    assert await chat_status(replicas.two, key) == 200


def error_of(response: httpx.Response) -> dict[str, Any]:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("revoker", ["admin-api", "the-key-itself", "a-sibling-key"])
async def test_revocation_reaches_the_other_replica(replicas, revoker, record_property):
    key = await replicas.new_key(name="doomed")
    sibling = replicas.tenant.key
    await assert_works_on_both(replicas, key["key"])

    if revoker == "admin-api":
        r = await replicas.one.delete(f"/admin/keys/{key['id']}", headers=replicas.admin)
    else:
        by = key["key"] if revoker == "the-key-itself" else sibling
        r = await replicas.one.delete(f"/v1/keys/{key['id']}", headers=bearer(by))
    assert r.status_code == 200 and r.json()["revoked_at"], r.text

    elapsed = await seconds_until(replicas.two, key["key"], 401)
    record_property("propagation_s", elapsed)
    assert elapsed < PROPAGATION_LIMIT_S
    assert await chat_status(replicas.one, key["key"]) == 401
    r = await replicas.two.get("/v1/models", headers=bearer(key["key"]))
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    await assert_works_on_both(replicas, sibling)  # only that key is gone


async def test_suspension_reaches_both_replicas(replicas, record_property):
    key, tenant_id = replicas.tenant.key, replicas.tenant.tenant_id
    await assert_works_on_both(replicas, key)

    r = await replicas.one.patch(f"/admin/tenants/{tenant_id}", headers=replicas.admin,
                                 json={"status": "suspended"})
    assert r.status_code == 200 and r.json()["status"] == "suspended"
    elapsed = await seconds_until(replicas.two, key, 403)
    record_property("propagation_s", elapsed)
    assert elapsed < PROPAGATION_LIMIT_S
    for replica in (replicas.one, replicas.two):
        r = await replica.post("/v1/chat/completions", json=CHAT, headers=bearer(key))
        assert r.status_code == 403 and error_of(r)["code"] == "tenant_suspended"

    r = await replicas.one.patch(f"/admin/tenants/{tenant_id}", headers=replicas.admin,
                                 json={"status": "active"})
    assert r.status_code == 200
    assert await seconds_until(replicas.two, key, 200) < PROPAGATION_LIMIT_S
    assert await chat_status(replicas.one, key) == 200


async def test_plan_change_reaches_the_other_replica(replicas, record_property):
    key = replicas.tenant.key
    await assert_works_on_both(replicas, key)
    r = await replicas.one.patch(f"/admin/plans/{replicas.tenant.plan_id}", headers=replicas.admin,
                                 json={"allowed_models": ["some-other-model"]})
    assert r.status_code == 200, r.text
    elapsed = await seconds_until(replicas.two, key, 403)
    record_property("propagation_s", elapsed)
    assert elapsed < PROPAGATION_LIMIT_S
    assert await chat_status(replicas.one, key) == 403


async def test_admin_key_revocation_reaches_the_other_replica(replicas, record_property):
    r = await replicas.one.post("/admin/admin-keys", headers=replicas.admin, json={"name": "ops"})
    ops = r.json()
    for replica in (replicas.one, replicas.two):
        assert (await replica.get("/admin/plans", headers=bearer(ops["key"]))).status_code == 200

    r = await replicas.one.delete(f"/admin/admin-keys/{ops['id']}", headers=replicas.admin)
    assert r.status_code == 200, r.text
    started = time.monotonic()
    while time.monotonic() - started < GIVE_UP_S:
        if (await replicas.two.get("/admin/plans", headers=bearer(ops["key"]))).status_code == 401:
            break
        await asyncio.sleep(0.01)
    elapsed = time.monotonic() - started
    record_property("propagation_s", elapsed)
    assert elapsed < PROPAGATION_LIMIT_S
    assert (await replicas.one.get("/admin/plans", headers=bearer(ops["key"]))).status_code == 401


async def test_key_created_expired_is_refused_on_both(replicas):
    past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
    key = await replicas.new_key(name="stale", expires_at=past)
    assert key["expires_at"] is not None
    for replica in (replicas.one, replicas.two):
        r = await replica.post("/v1/chat/completions", json=CHAT, headers=bearer(key["key"]))
        assert r.status_code == 401 and "expired" in error_of(r)["message"]


async def test_key_stops_working_when_it_expires(replicas, record_property):
    expires = datetime.now(UTC) + timedelta(seconds=1.5)
    key = await replicas.new_key(name="short-lived", expires_at=expires.isoformat())
    await assert_works_on_both(replicas, key["key"])  # cached on both while still valid
    await asyncio.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()))
    for replica in (replicas.one, replicas.two):
        elapsed = await seconds_until(replica, key["key"], 401)
        record_property("after_expiry_s", elapsed)
        assert elapsed < PROPAGATION_LIMIT_S


async def test_new_key_works_at_once_on_the_other_replica(replicas):
    key = await replicas.new_key(name="fresh")
    assert await chat_status(replicas.two, key["key"]) == 200  # first try, no waiting


async def test_new_key_clears_the_other_replicas_negative_cache(
        replicas, monkeypatch, record_property):
    """A key id replica two has already cached as unknown works once the key exists."""
    planned = generate_key(admin=False)
    assert await chat_status(replicas.two, planned.full) == 401  # now cached as unknown
    assert await chat_status(replicas.two, planned.full) == 401
    monkeypatch.setattr(api_keys, "generate_key", lambda *, admin: planned)
    key = await replicas.new_key(name="planned")
    assert key["id"] == planned.key_id
    elapsed = await seconds_until(replicas.two, planned.full, 200)
    record_property("propagation_s", elapsed)
    assert elapsed < PROPAGATION_LIMIT_S
