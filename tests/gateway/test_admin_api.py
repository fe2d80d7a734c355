"""The admin REST API end to end, in-process, on SQLite and PostgreSQL.

Plans, tenants, tenant keys, admin keys, runtime deployments and usage: what each endpoint
returns, what it refuses, and that every refusal leaves in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.gateway.support import (
    Seeded,
    admin_key,
    bearer,
    gateway_client,
    mock_deployment,
    mock_settings,
    seed_tenant,
)

CHAT = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
KEY_FIELDS = {"id", "tenant_id", "name", "created_at", "expires_at", "revoked_at", "rpm", "tpm",
              "max_concurrent", "allowed_models", "allowed_adapters"}
ADMIN_KEY_FIELDS = {"id", "name", "created_at", "revoked_at"}
UPSTREAM_SECRET = mock_deployment("http://unused")["api_key"]


@dataclass
class Admin:
    client: httpx.AsyncClient  # sends the bootstrap admin key
    key: str
    tenant: Seeded  # a tenant on an unrestricted plan, with one key
    upstream_url: str


@pytest.fixture
async def admin(db_url, tmp_path, mock_upstream) -> AsyncIterator[Admin]:
    key = await admin_key(db_url, tmp_path)
    tenant = await seed_tenant(db_url, tmp_path, name="acme")
    cfg = mock_settings(db_url, tmp_path, mock_upstream.base_url)
    async with gateway_client(cfg) as client:
        client.headers.update(bearer(key))
        yield Admin(client, key, tenant, mock_upstream.base_url)


def ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, response.text
    assert response.headers["x-request-id"]
    return response.json()


def assert_error(response: httpx.Response, status: int, *, code: str | None = None,
                 param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    assert response.headers["x-request-id"]
    return error


def unknown_id() -> str:
    return uuid.uuid4().hex


# --- plans --------------------------------------------------------------------------------


async def test_plans_create_list_get_patch(admin):
    c = admin.client
    plan = ok(await c.post("/admin/plans", json={
        "name": "gold", "rpm": 60, "tpm": 10_000, "budget_usd": "12.5", "budget_period": "day",
        "allowed_models": ["mock-model"]}), 201)
    assert plan["budget_micros"] == 12_500_000 and "budget_usd" not in plan
    assert (plan["rpm"], plan["tpm"], plan["max_concurrent"]) == (60, 10_000, None)
    assert plan["budget_period"] == "day"
    assert plan["allowed_models"] == ["mock-model"] and plan["allowed_tiers"] is None

    listed = ok(await c.get("/admin/plans"))
    assert {p["name"] for p in listed} == {"gold", "acme-plan"}
    assert ok(await c.get(f"/admin/plans/{plan['id']}")) == plan

    patched = ok(await c.patch(f"/admin/plans/{plan['id']}", json={
        "budget_usd": 0.29, "rpm": None, "allowed_tiers": ["standard"]}))
    assert patched == {**plan, "budget_micros": 290_000, "rpm": None,
                       "allowed_tiers": ["standard"]}
    assert ok(await c.get(f"/admin/plans/{plan['id']}")) == patched
    cleared = ok(await c.patch(f"/admin/plans/{plan['id']}", json={"budget_usd": None}))
    assert cleared["budget_micros"] is None and cleared["tpm"] == 10_000


async def test_plan_errors(admin):
    c = admin.client
    plan = ok(await c.post("/admin/plans", json={"name": "gold"}), 201)
    assert_error(await c.post("/admin/plans", json={"name": "gold"}), 409)
    assert_error(await c.patch(f"/admin/plans/{plan['id']}", json={"name": "acme-plan"}), 409)
    assert_error(await c.get(f"/admin/plans/{unknown_id()}"), 404, code="not_found")
    assert_error(await c.patch(f"/admin/plans/{unknown_id()}", json={"rpm": 5}), 404)
    assert_error(await c.patch(f"/admin/plans/{plan['id']}", json={"color": "red"}), 400)
    assert_error(await c.post("/admin/plans", json={"rpm": 5}), 400, param="name")
    assert_error(await c.post("/admin/plans", json={"name": "x", "budget_usd": -1}), 400,
                 param="budget_usd")
    assert_error(await c.post("/admin/plans", json={"name": "x", "budget_period": "week"}), 400)
    assert_error(await c.patch(f"/admin/plans/{plan['id']}", json={"name": None}), 400)
    assert ok(await c.get(f"/admin/plans/{plan['id']}")) == plan  # nothing half-applied


@pytest.mark.parametrize("body", [
    {"name": "big", "rpm": 2**40},  # beyond the INTEGER column
    {"name": "big", "tpm": 2**31},
    {"name": "nul\x00name"},  # PostgreSQL text cannot hold NUL
], ids=["rpm-2^40", "tpm-2^31", "nul-in-name"])
async def test_plan_values_the_database_cannot_store_are_400(admin, body):
    assert_error(await admin.client.post("/admin/plans", json=body), 400)
    assert ok(await admin.client.get("/admin/plans"))  # still serving


# --- tenants ------------------------------------------------------------------------------


async def test_tenants_create_list_get_patch(admin):
    c = admin.client
    plan = ok(await c.post("/admin/plans", json={"name": "silver"}), 201)
    tenant = ok(await c.post("/admin/tenants", json={"name": "globex",
                                                     "plan_id": admin.tenant.plan_id}), 201)
    assert tenant["status"] == "active" and tenant["plan_id"] == admin.tenant.plan_id
    assert {t["name"] for t in ok(await c.get("/admin/tenants"))} == {"acme", "globex"}
    assert ok(await c.get(f"/admin/tenants/{tenant['id']}")) == tenant

    moved = ok(await c.patch(f"/admin/tenants/{tenant['id']}", json={"plan_id": plan["id"]}))
    assert moved == {**tenant, "plan_id": plan["id"]}
    suspended = ok(await c.patch(f"/admin/tenants/{tenant['id']}", json={"status": "suspended"}))
    assert suspended == {**moved, "status": "suspended"}
    assert ok(await c.get(f"/admin/tenants/{tenant['id']}"))["status"] == "suspended"


async def test_tenant_errors(admin):
    c = admin.client
    plan_id, tenant_id = admin.tenant.plan_id, admin.tenant.tenant_id
    assert_error(await c.post("/admin/tenants", json={"name": "acme", "plan_id": plan_id}), 409)
    assert_error(await c.post("/admin/tenants", json={"name": "new", "plan_id": unknown_id()}),
                 404)
    assert_error(await c.post("/admin/tenants", json={"name": "new"}), 400, param="plan_id")
    assert_error(await c.post("/admin/tenants", json={"name": "", "plan_id": plan_id}), 400)
    assert_error(await c.get(f"/admin/tenants/{unknown_id()}"), 404, code="not_found")
    assert_error(await c.patch(f"/admin/tenants/{unknown_id()}", json={"status": "active"}), 404)
    assert_error(await c.patch(f"/admin/tenants/{tenant_id}", json={"plan_id": unknown_id()}),
                 404)
    assert_error(await c.patch(f"/admin/tenants/{tenant_id}", json={"status": "deleted"}), 400)
    assert_error(await c.get("/admin/tenants/a%00b"), 400, param="tenant_id")  # not a 500
    assert ok(await c.get(f"/admin/tenants/{tenant_id}"))["status"] == "active"


async def test_suspended_tenant_is_refused_and_reactivated(admin):
    c, tenant = admin.client, admin.tenant
    models = bearer(tenant.key)
    assert ok(await c.get("/v1/models", headers=models))
    ok(await c.patch(f"/admin/tenants/{tenant.tenant_id}", json={"status": "suspended"}))
    assert_error(await c.get("/v1/models", headers=models), 403, code="tenant_suspended")
    ok(await c.patch(f"/admin/tenants/{tenant.tenant_id}", json={"status": "active"}))
    assert ok(await c.get("/v1/models", headers=models))


# --- response-cache settings --------------------------------------------------------------

CACHE_DEFAULTS = {"cache_mode": "auto", "semantic_threshold": None, "cache_ttl_s": None,
                  "cache_hit_price_percent": 0}


async def test_plan_cache_settings_create_patch_and_clear(admin):
    c = admin.client
    plain = ok(await c.post("/admin/plans", json={"name": "plain"}), 201)
    assert {k: plain[k] for k in CACHE_DEFAULTS} == CACHE_DEFAULTS

    plan = ok(await c.post("/admin/plans", json={
        "name": "cached", "cache_mode": "semantic", "semantic_threshold": 0.9,
        "cache_ttl_s": 600, "cache_hit_price_percent": 10}), 201)
    assert (plan["cache_mode"], plan["semantic_threshold"], plan["cache_ttl_s"],
            plan["cache_hit_price_percent"]) == ("semantic", 0.9, 600, 10)
    assert ok(await c.get(f"/admin/plans/{plan['id']}")) == plan

    # Absent fields stay as they are.
    patched = ok(await c.patch(f"/admin/plans/{plan['id']}", json={
        "cache_mode": "exact", "cache_hit_price_percent": 100}))
    assert patched == {**plan, "cache_mode": "exact", "cache_hit_price_percent": 100}
    # An explicit null clears the threshold and TTL back to the gateway's defaults.
    cleared = ok(await c.patch(f"/admin/plans/{plan['id']}", json={
        "semantic_threshold": None, "cache_ttl_s": None}))
    assert cleared == {**patched, "semantic_threshold": None, "cache_ttl_s": None}
    assert ok(await c.get(f"/admin/plans/{plan['id']}")) == cleared


@pytest.mark.parametrize(("body", "param"), [
    ({"cache_mode": "sometimes"}, "cache_mode"),
    ({"semantic_threshold": 0}, "semantic_threshold"),
    ({"semantic_threshold": -0.2}, "semantic_threshold"),
    ({"semantic_threshold": 1.5}, "semantic_threshold"),
    ({"semantic_threshold": "high"}, "semantic_threshold"),
    ({"cache_ttl_s": 0}, "cache_ttl_s"),
    ({"cache_ttl_s": 2**31}, "cache_ttl_s"),
    ({"cache_hit_price_percent": 101}, "cache_hit_price_percent"),
    ({"cache_hit_price_percent": -1}, "cache_hit_price_percent"),
    ({"cache_hit_price_percent": None}, "cache_hit_price_percent"),
    ({"engine_weight": 0}, "engine_weight"),
    ({"engine_weight": -1}, "engine_weight"),
    ({"engine_weight": 101}, "engine_weight"),
    ({"engine_weight": "heavy"}, "engine_weight"),
    ({"engine_weight": None}, "engine_weight"),
    ({"priority": 11}, "priority"),
    ({"priority": -11}, "priority"),
    ({"priority": 1.5}, "priority"),
    ({"priority": None}, "priority"),
    ({"embedding_max_request_tokens": 0}, "embedding_max_request_tokens"),
    ({"embedding_max_request_tokens": 2**31}, "embedding_max_request_tokens"),
    ({"batch_price_percent": 101}, "batch_price_percent"),
    ({"batch_price_percent": -1}, "batch_price_percent"),
    ({"batch_price_percent": None}, "batch_price_percent"),
])
async def test_bad_plan_settings_are_400(admin, body, param):
    c = admin.client
    assert_error(await c.post("/admin/plans", json={"name": "x", **body}), 400, param=param)
    plan = ok(await c.post("/admin/plans", json={"name": "y"}), 201)
    # On PATCH a null that is not allowed reaches the service (400 without a param).
    error = assert_error(await c.patch(f"/admin/plans/{plan['id']}", json=body), 400)
    assert param in error["message"] or error["param"] == param
    assert ok(await c.get(f"/admin/plans/{plan['id']}")) == plan  # nothing half-applied
    assert "x" not in {p["name"] for p in ok(await c.get("/admin/plans"))}


async def test_patching_cache_mode_to_null_is_400(admin):
    c = admin.client
    plan = ok(await c.post("/admin/plans", json={"name": "gold", "cache_mode": "off"}), 201)
    error = assert_error(await c.patch(f"/admin/plans/{plan['id']}",
                                       json={"cache_mode": None}), 400)
    assert "cache_mode" in error["message"]
    assert ok(await c.get(f"/admin/plans/{plan['id']}"))["cache_mode"] == "off"


async def test_tenant_semantic_threshold_set_keep_and_clear(admin):
    c = admin.client
    tenant = ok(await c.post("/admin/tenants", json={
        "name": "globex", "plan_id": admin.tenant.plan_id, "semantic_threshold": 0.9}), 201)
    assert tenant["semantic_threshold"] == 0.9
    assert ok(await c.get(f"/admin/tenants/{admin.tenant.tenant_id}"))["semantic_threshold"] is None

    changed = ok(await c.patch(f"/admin/tenants/{tenant['id']}",
                               json={"semantic_threshold": 0.95}))
    assert changed == {**tenant, "semantic_threshold": 0.95}
    # A PATCH without the field keeps it; an explicit null clears it.
    suspended = ok(await c.patch(f"/admin/tenants/{tenant['id']}", json={"status": "suspended"}))
    assert suspended == {**changed, "status": "suspended"}
    cleared = ok(await c.patch(f"/admin/tenants/{tenant['id']}",
                               json={"semantic_threshold": None}))
    assert cleared == {**suspended, "semantic_threshold": None}
    assert ok(await c.get(f"/admin/tenants/{tenant['id']}")) == cleared
    # plan_id and status keep their old meaning: null changes nothing.
    assert ok(await c.patch(f"/admin/tenants/{tenant['id']}",
                            json={"plan_id": None, "status": None})) == cleared

    for bad in (0, 1.01, -1, "high"):
        assert_error(await c.patch(f"/admin/tenants/{tenant['id']}",
                                   json={"semantic_threshold": bad}), 400,
                     param="semantic_threshold")
        assert_error(await c.post("/admin/tenants", json={
            "name": "bad", "plan_id": admin.tenant.plan_id, "semantic_threshold": bad}), 400,
            param="semantic_threshold")
    assert ok(await c.get(f"/admin/tenants/{tenant['id']}")) == cleared


async def test_cache_setting_edits_reach_the_cached_key_context(admin):
    """Plan and tenant edits bump the auth version, so the gateway's KeyContext follows."""
    c, tenant = admin.client, admin.tenant
    keys = c._transport.app.state.gateway.keys  # type: ignore[attr-defined]
    auth = f"Bearer {tenant.key}"
    ctx = await keys.tenant(auth)  # now cached
    assert ctx.plan.cache_mode == "auto" and ctx.semantic_threshold(0.5) == 0.5

    ok(await c.patch(f"/admin/plans/{tenant.plan_id}", json={
        "cache_mode": "semantic", "semantic_threshold": 0.8, "cache_ttl_s": 30,
        "cache_hit_price_percent": 5}))
    ctx = await keys.tenant(auth)
    assert (ctx.plan.cache_mode, ctx.plan.semantic_threshold, ctx.plan.cache_ttl_s,
            ctx.plan.cache_hit_price_percent) == ("semantic", 0.8, 30, 5)
    assert ctx.semantic_threshold(0.5) == 0.8

    ok(await c.patch(f"/admin/tenants/{tenant.tenant_id}", json={"semantic_threshold": 0.99}))
    ctx = await keys.tenant(auth)
    assert ctx.tenant_semantic_threshold == 0.99 and ctx.semantic_threshold(0.5) == 0.99
    ok(await c.patch(f"/admin/tenants/{tenant.tenant_id}", json={"semantic_threshold": None}))
    assert (await keys.tenant(auth)).semantic_threshold(0.5) == 0.8


# --- engine share -------------------------------------------------------------------------


async def test_plan_engine_share_create_patch_and_reach_the_key_context(admin):
    c, tenant = admin.client, admin.tenant
    plain = ok(await c.post("/admin/plans", json={"name": "plain"}), 201)
    assert (plain["engine_weight"], plain["priority"]) == (1.0, 0)
    plan = ok(await c.post("/admin/plans", json={
        "name": "heavy", "engine_weight": 2.5, "priority": -3}), 201)
    assert (plan["engine_weight"], plan["priority"]) == (2.5, -3)
    assert ok(await c.get(f"/admin/plans/{plan['id']}")) == plan
    patched = ok(await c.patch(f"/admin/plans/{plan['id']}", json={"engine_weight": 100}))
    assert patched == {**plan, "engine_weight": 100.0}
    # Absent fields stay as they are.
    assert ok(await c.patch(f"/admin/plans/{plan['id']}", json={"rpm": 5})) == {
        **patched, "rpm": 5}

    keys = c._transport.app.state.gateway.keys  # type: ignore[attr-defined]
    auth = f"Bearer {tenant.key}"
    ctx = await keys.tenant(auth)  # now cached
    assert (ctx.plan.engine_weight, ctx.plan.priority) == (1.0, 0)
    ok(await c.patch(f"/admin/plans/{tenant.plan_id}", json={
        "engine_weight": 0.5, "priority": 10}))
    ctx = await keys.tenant(auth)
    assert (ctx.plan.engine_weight, ctx.plan.priority) == (0.5, 10)


async def test_plan_embedding_bound_create_patch_clear_and_reach_the_key_context(admin):
    c, tenant = admin.client, admin.tenant
    assert ok(await c.post("/admin/plans", json={"name": "unbounded"}), 201)[
        "embedding_max_request_tokens"] is None
    plan = ok(await c.post("/admin/plans", json={
        "name": "bounded", "embedding_max_request_tokens": 4096}), 201)
    assert plan["embedding_max_request_tokens"] == 4096
    patched = ok(await c.patch(f"/admin/plans/{plan['id']}",
                               json={"embedding_max_request_tokens": None}))
    assert patched == {**plan, "embedding_max_request_tokens": None}

    keys = c._transport.app.state.gateway.keys  # type: ignore[attr-defined]
    auth = f"Bearer {tenant.key}"
    assert (await keys.tenant(auth)).plan.embedding_max_request_tokens is None
    ok(await c.patch(f"/admin/plans/{tenant.plan_id}",
                     json={"embedding_max_request_tokens": 1000}))
    assert (await keys.tenant(auth)).plan.embedding_max_request_tokens == 1000


async def test_plan_batch_price_defaults_to_half_and_reaches_the_key_context(admin):
    c, tenant = admin.client, admin.tenant
    plan = ok(await c.post("/admin/plans", json={"name": "batchy"}), 201)
    assert plan["batch_price_percent"] == 50  # OpenAI's batch discount
    patched = ok(await c.patch(f"/admin/plans/{plan['id']}", json={"batch_price_percent": 80}))
    assert patched == {**plan, "batch_price_percent": 80}

    keys = c._transport.app.state.gateway.keys  # type: ignore[attr-defined]
    auth = f"Bearer {tenant.key}"
    assert (await keys.tenant(auth)).plan.batch_price_percent == 50
    ok(await c.patch(f"/admin/plans/{tenant.plan_id}", json={"batch_price_percent": 0}))
    assert (await keys.tenant(auth)).plan.batch_price_percent == 0


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
async def test_non_finite_engine_weight_is_400(admin, number):
    """Python's JSON parser reads NaN and Infinity: the schema must still refuse them."""
    c = admin.client
    headers = {"content-type": "application/json"}
    body = f'{{"name": "x", "engine_weight": {number}}}'
    assert_error(await c.post("/admin/plans", content=body, headers=headers), 400,
                 param="engine_weight")
    plan = ok(await c.post("/admin/plans", json={"name": "y"}), 201)
    assert_error(await c.patch(f"/admin/plans/{plan['id']}", headers=headers,
                               content=f'{{"engine_weight": {number}}}'), 400,
                 param="engine_weight")
    assert ok(await c.get(f"/admin/plans/{plan['id']}")) == plan


# --- tenant keys --------------------------------------------------------------------------


async def test_keys_create_shows_the_key_once(admin):
    c, tenant_id = admin.client, admin.tenant.tenant_id
    created = ok(await c.post(f"/admin/tenants/{tenant_id}/keys", json={
        "name": "ci", "rpm": 30, "allowed_models": ["mock-model"],
        "allowed_adapters": ["support-bot"]}), 201)
    assert set(created) == KEY_FIELDS | {"key"}
    full, secret = created["key"], created["key"].rsplit("-", 1)[1]
    assert full.startswith(f"sk-sb-{created['id']}-") and len(secret) == 40
    assert created["tenant_id"] == tenant_id and created["revoked_at"] is None
    assert (created["rpm"], created["allowed_adapters"]) == (30, ["support-bot"])

    one = await c.get(f"/admin/keys/{created['id']}")
    assert ok(one) == {k: v for k, v in created.items() if k != "key"}
    listing = await c.get(f"/admin/tenants/{tenant_id}/keys")
    assert {k["id"] for k in ok(listing)} == {admin.tenant.key_id, created["id"]}
    for entry in ok(listing):
        assert set(entry) == KEY_FIELDS
    for response in (one, listing):
        assert secret not in response.text and "secret_hash" not in response.text

    models = ok(await c.get("/v1/models", headers=bearer(full)))
    assert [m["id"] for m in models["data"]] == ["mock-model", "auto"]


async def test_keys_revoke(admin):
    c, tenant_id = admin.client, admin.tenant.tenant_id
    created = ok(await c.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "temp"}), 201)
    assert ok(await c.post("/v1/chat/completions", json=CHAT, headers=bearer(created["key"])))
    revoked = ok(await c.delete(f"/admin/keys/{created['id']}"))
    assert revoked["revoked_at"] is not None and "key" not in revoked
    # The replica that revoked it refuses the key at once (other replicas: test_revocation).
    r = await c.post("/v1/chat/completions", json=CHAT, headers=bearer(created["key"]))
    assert_error(r, 401, code="invalid_api_key")
    again = ok(await c.delete(f"/admin/keys/{created['id']}"))
    assert again["revoked_at"] == revoked["revoked_at"]  # idempotent
    assert ok(await c.get(f"/admin/keys/{created['id']}"))["revoked_at"] == revoked["revoked_at"]
    assert ok(await c.get("/v1/models", headers=bearer(admin.tenant.key)))  # others untouched


async def test_key_errors(admin):
    c, tenant_id = admin.client, admin.tenant.tenant_id
    keys = f"/admin/tenants/{tenant_id}/keys"
    assert_error(await c.post(f"/admin/tenants/{unknown_id()}/keys", json={}), 404)
    assert_error(await c.get(f"/admin/tenants/{unknown_id()}/keys"), 404)
    assert_error(await c.get("/admin/keys/aaaaaaaaaaaa"), 404, code="not_found")
    assert_error(await c.delete("/admin/keys/aaaaaaaaaaaa"), 404, code="not_found")
    assert_error(await c.post(keys, json={"expires_at": "2030-01-01T00:00:00"}), 400)  # naive
    assert_error(await c.post(keys, json={"expires_at": "soon"}), 400, param="expires_at")
    # Far enough back that converting to UTC leaves the calendar: refused, not a 500.
    assert_error(await c.post(keys, json={"expires_at": "0001-01-01T00:00:00+05:00"}), 400)
    assert_error(await c.post(keys, json={"rpm": 0}), 400, param="rpm")
    assert_error(await c.post(keys, json={"secret_hash": "00"}), 400)
    assert_error(await c.post(keys, json={"name": "nul\x00"}), 400)
    assert {k["id"] for k in ok(await c.get(keys))} == {admin.tenant.key_id}


# --- admin keys ---------------------------------------------------------------------------


async def test_admin_keys_create_list_revoke(admin):
    c = admin.client
    ops = ok(await c.post("/admin/admin-keys", json={"name": "ops"}), 201)
    assert set(ops) == ADMIN_KEY_FIELDS | {"key"}
    assert ops["key"].startswith(f"sk-sb-admin-{ops['id']}-")
    ops_auth = bearer(ops["key"])

    listing = await c.get("/admin/admin-keys")
    assert [k["name"] for k in ok(listing)] == ["test-admin", "ops"]
    assert all(set(k) == ADMIN_KEY_FIELDS for k in ok(listing))
    assert ops["key"].rsplit("-", 1)[1] not in listing.text
    assert ok(await c.get("/admin/plans", headers=ops_auth))
    # Admin keys are not tenant keys.
    assert_error(await c.get("/v1/models", headers=ops_auth), 401)

    error = assert_error(await c.delete(f"/admin/admin-keys/{ops['id']}", headers=ops_auth), 400)
    assert "itself" in error["message"]
    revoked = ok(await c.delete(f"/admin/admin-keys/{ops['id']}"))
    assert revoked["revoked_at"] is not None
    assert_error(await c.get("/admin/plans", headers=ops_auth), 401, code="invalid_api_key")
    assert_error(await c.delete("/admin/admin-keys/aaaaaaaaaaaa"), 404)
    assert_error(await c.post("/admin/admin-keys", json={}), 400, param="name")
    assert ok(await c.get("/admin/plans"))  # the bootstrap key still works


# --- deployments --------------------------------------------------------------------------


async def test_deployments_list_hides_secrets(admin):
    response = await admin.client.get("/admin/deployments")
    [mock] = ok(response)
    assert mock["name"] == "mock" and mock["model_name"] == "mock-model"
    assert mock["has_api_key"] is True and "api_key" not in mock
    assert UPSTREAM_SECRET not in response.text


async def test_deployment_added_at_runtime_serves_then_goes(admin, mock_upstream):
    c, tenant_auth = admin.client, bearer(admin.tenant.key)
    config = {"name": "extra", "model_name": "extra-model", "provider": "openai",
              "base_url": admin.upstream_url, "upstream_model": "extra-upstream",
              "api_key": "sk-extra-secret", "tier": "standard"}
    added = await c.post("/admin/deployments", json=config)
    assert ok(added, 201)["has_api_key"] is True and "sk-extra-secret" not in added.text
    listed = await c.get("/admin/deployments")
    assert {d["name"] for d in ok(listed)} == {"mock", "extra"}
    assert "sk-extra-secret" not in listed.text

    body = {**CHAT, "model": "extra-model"}
    assert ok(await c.post("/v1/chat/completions", json=body, headers=tenant_auth))
    seen = mock_upstream.last_request()
    assert seen["headers"]["authorization"] == "Bearer sk-extra-secret"
    assert seen["body"]["model"] == "extra-upstream"
    models = ok(await c.get("/v1/models", headers=tenant_auth))
    assert [m["id"] for m in models["data"]] == ["extra-model", "mock-model", "auto"]

    assert ok(await c.delete("/admin/deployments/extra"))["name"] == "extra"
    r = await c.post("/v1/chat/completions", json=body, headers=tenant_auth)
    assert_error(r, 404, code="model_not_found", param="model")
    assert_error(await c.delete("/admin/deployments/extra"), 404)
    models = ok(await c.get("/v1/models", headers=tenant_auth))
    assert [m["id"] for m in models["data"]] == ["mock-model", "auto"]


@pytest.mark.parametrize(("change", "status"), [
    ({"name": "mock"}, 409),  # the name is taken
    ({"provider": "embedded"}, 400),
    ({"base_url": None}, 400),
    ({"base_url": "not a url"}, 400),
    ({"base_url": "file:///etc/passwd"}, 400),
    ({"secret": "x"}, 400),  # unknown field
    ({"context_window": 0}, 400),
], ids=["duplicate", "embedded", "no-url", "bad-url", "file-url", "unknown-field", "window-0"])
async def test_deployment_errors(admin, change, status):
    config = {"name": "extra", "model_name": "extra-model", "provider": "openai",
              "base_url": admin.upstream_url, **change}
    assert_error(await admin.client.post("/admin/deployments", json=config), status)
    assert [d["name"] for d in ok(await admin.client.get("/admin/deployments"))] == ["mock"]


# --- usage --------------------------------------------------------------------------------


async def usage_when(client: httpx.AsyncClient, url: str, requests: int, *,
                     timeout_s: float = 10.0, **params: str) -> dict[str, Any]:
    """The usage report once it counts `requests` requests (the meter flushes in batches)."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = ok(await client.get(url, params=params))
        if sum(m["requests"] for m in report["models"]) >= requests:
            return report
        if time.monotonic() > deadline:
            return report
        await asyncio.sleep(0.05)


async def test_usage_for_a_tenant(admin):
    c, tenant = admin.client, admin.tenant
    usages = []
    for body in (CHAT, CHAT, {"model": "mock-model", "prompt": "Once upon", "max_tokens": 3}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        usages.append(ok(await c.post(path, json=body, headers=bearer(tenant.key)))["usage"])

    report = await usage_when(c, f"/admin/usage/{tenant.tenant_id}", 3)
    assert report["tenant_id"] == tenant.tenant_id
    [row] = report["models"]
    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    assert (row["model"], row["requests"]) == ("mock-model", 3)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (prompt, completion)
    # mock prices: $1 per 1M input tokens, $2 per 1M output tokens = 1 and 2 micro-USD each.
    assert row["cost_micros"] == prompt + 2 * completion

    future = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    assert ok(await c.get(f"/admin/usage/{tenant.tenant_id}", params={"since": future}))[
        "models"] == []
    assert_error(await c.get(f"/admin/usage/{unknown_id()}"), 404)
    assert_error(await c.get(f"/admin/usage/{tenant.tenant_id}", params={"since": "x"}), 400,
                 param="since")
    extreme = {"until": "9999-12-31T23:59:59-23:59"}  # past year 9999 once in UTC
    assert_error(await c.get(f"/admin/usage/{tenant.tenant_id}", params=extreme), 400)


# --- auth and generic errors --------------------------------------------------------------


async def test_admin_api_needs_an_admin_key(admin):
    c = admin.client
    assert_error(await c.get("/admin/plans", headers={"authorization": ""}), 401)
    assert_error(await c.get("/admin/plans", headers=bearer("sk-sb-admin-nope")), 401)
    forged = f"sk-sb-admin-{'a' * 12}-{'0' * 40}"
    assert_error(await c.get("/admin/plans", headers=bearer(forged)), 401, code="invalid_api_key")
    assert_error(await c.get("/admin/plans", headers=bearer(admin.tenant.key)), 403)


async def test_generic_errors_are_in_openai_shape(admin):
    c = admin.client
    assert_error(await c.put("/admin/plans", json={}), 405)
    assert_error(await c.get("/admin/nothing-here"), 404)
    r = await c.post("/admin/plans", content=b"{", headers={"content-type": "application/json"})
    assert_error(r, 400)
    r = await c.post("/admin/plans", content=b"\xff\xfe", headers={
        "content-type": "application/json"})
    assert_error(r, 400)


async def test_malformed_json_names_no_bogus_param(admin):
    r = await admin.client.post("/admin/plans", content=b"{", headers={
        "content-type": "application/json"})
    assert assert_error(r, 400)["param"] is None


async def test_admin_auth_comes_before_body_parsing(admin):
    r = await admin.client.post("/admin/plans", content=b"{", headers={
        "content-type": "application/json", "authorization": ""})
    assert_error(r, 401)
