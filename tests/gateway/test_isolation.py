"""Two tenants on different plans, through every endpoint a tenant key can reach.

Neither can list, use or learn anything about the other's keys, models, adapters or usage:
every response a tenant gets is searched for the other tenant's identifiers (ids, names, key
ids, secrets, adapter names), beyond what the caller itself sent. Both database backends.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from gateway.app import create_app
from gateway.request_path import SurfaceRoute
from tenancy import adapters as adapter_rows
from tenancy import stored_responses
from tenancy.db import make_engine, make_sessionmaker
from tests.gateway.support import (
    admin_key,
    assert_error,
    bearer,
    gateway_client,
    in_process,
    mock_deployment,
    mock_settings,
    ok,
    seed_tenant,
    settings,
    write_deployments,
)

MOCK, PREMIUM = "mock-model", "premium-model"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
PROMPT = {"prompt": "Once upon", "max_tokens": 3}
KEY_FIELDS = {"id", "tenant_id", "name", "created_at", "expires_at", "revoked_at", "rpm", "tpm",
              "max_concurrent", "allowed_models", "allowed_adapters"}
# Every route a tenant key can reach; test_every_tenant_route_is_covered keeps this honest.
TENANT_ROUTES = {
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"), ("GET", "/v1/keys"), ("DELETE", "/v1/keys/{key_id}"),
    ("GET", "/v1/usage"), ("GET", "/v1/usage/records"), ("POST", "/v1/adapters/upload"),
    ("GET", "/v1/adapters"),
    ("POST", "/v1/adapters/{name}/load"), ("POST", "/v1/adapters/{name}/unload"),
    ("DELETE", "/v1/adapters/{name}"), ("POST", "/v1/embeddings"),
    # Anthropic's surface of the chat path (tests/gateway/surfaces/test_anthropic.py)
    ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
    # OpenAI's Responses surface and the tenant's stored responses
    # (tests/gateway/surfaces/test_responses.py)
    ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"), ("GET", "/v1/responses/{response_id}/input_items"),
    # The Batch API: files and batches (tests/gateway/test_batches.py)
    ("POST", "/v1/files"), ("GET", "/v1/files"), ("GET", "/v1/files/{file_id}"),
    ("GET", "/v1/files/{file_id}/content"), ("DELETE", "/v1/files/{file_id}"),
    ("POST", "/v1/batches"), ("GET", "/v1/batches"), ("GET", "/v1/batches/{batch_id}"),
    ("POST", "/v1/batches/{batch_id}/cancel"),
}
PUBLIC_ROUTES = {("GET", "/health"), ("GET", "/health/live"), ("GET", "/health/ready")}


@dataclass
class Caller:
    """One key of one tenant; every response it gets is checked for the other's identifiers."""

    client: httpx.AsyncClient
    key: str
    hidden: set[str] = field(default_factory=set)

    async def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        response = await self.client.request(method, url, headers=bearer(self.key), **kwargs)
        sent = url + json.dumps(kwargs.get("json")) + json.dumps(kwargs.get("params"))
        seen = response.text + json.dumps(list(response.headers.items()))
        leaked = sorted(s for s in self.hidden if s in seen and s not in sent)
        assert not leaked, f"{method} {url} revealed {leaked}: {response.text[:300]}"
        return response

    async def chat(self, model: str, **extra: Any) -> httpx.Response:
        return await self.request("POST", "/v1/chat/completions",
                                  json={"model": model, **CHAT, **extra})

    async def complete(self, model: str) -> httpx.Response:
        return await self.request("POST", "/v1/completions", json={"model": model, **PROMPT})

    async def models(self) -> list[str]:
        return [m["id"] for m in ok(await self.request("GET", "/v1/models"))["data"]]

    async def keys(self) -> list[dict[str, Any]]:
        return ok(await self.request("GET", "/v1/keys"))

    async def usage(self, **params: str) -> dict[str, Any]:
        return ok(await self.request("GET", "/v1/usage", params=params))


@dataclass
class Tenant:
    tenant_id: str
    plan_id: str
    callers: dict[str, Caller]  # by key name
    key_ids: dict[str, str]  # by key name
    identifiers: set[str]  # everything that names this tenant or its keys


@dataclass
class World:
    app: FastAPI
    client: httpx.AsyncClient
    admin: dict[str, str]
    a: Tenant  # plan allows only mock-model
    b: Tenant  # plan allows every model; one key scoped to premium-model


async def add_tenant(db_url, tmp_path, client, admin, *, name: str, plan: dict[str, Any],
                     keys: dict[str, dict[str, Any]]) -> Tenant:
    """A tenant with a seeded first key, then the other keys made through the admin API."""
    first, *rest = keys
    seeded = await seed_tenant(db_url, tmp_path, name=name, plan=plan,
                               key={"name": first, **keys[first]})
    full = {first: seeded.key}
    ids = {first: seeded.key_id}
    for key_name in rest:
        r = await client.post(f"/admin/tenants/{seeded.tenant_id}/keys", headers=admin,
                              json={"name": key_name, **keys[key_name]})
        created = ok(r, 201)
        full[key_name], ids[key_name] = created["key"], created["id"]
    identifiers = {seeded.tenant_id, seeded.plan_id, name, f"{name}-plan", *ids.values(),
                   *full.values(), *(k.rsplit("-", 1)[1] for k in full.values()),
                   *(a for spec in keys.values() for a in spec.get("allowed_adapters", ())),
                   *(k for k in keys if k)}
    callers = {key_name: Caller(client, key) for key_name, key in full.items()}
    return Tenant(seeded.tenant_id, seeded.plan_id, callers, ids, identifiers)


@pytest.fixture
async def world(db_url, tmp_path, mock_upstream) -> AsyncIterator[World]:
    deployments = [mock_deployment(mock_upstream.base_url),
                   mock_deployment(mock_upstream.base_url, name="premium", model_name=PREMIUM,
                                   tier="premium")]
    cfg = settings(db_url, tmp_path, deployments_file=write_deployments(tmp_path, deployments))
    admin = bearer(await admin_key(db_url, tmp_path))
    app = create_app(cfg)
    async with in_process(app) as client:
        a = await add_tenant(db_url, tmp_path, client, admin, name="initech",
                             plan={"allowed_models": [MOCK], "rpm": 1000},
                             keys={"initech-main": {}, "initech-spare": {
                                 "allowed_adapters": ["initech-adapter"]}})
        b = await add_tenant(db_url, tmp_path, client, admin, name="umbrella",
                             plan={"rpm": 2000, "tpm": 1_000_000},
                             keys={"umbrella-main": {"allowed_adapters": ["umbrella-adapter"]},
                                   "umbrella-premium": {"allowed_models": [PREMIUM]}})
        for caller in a.callers.values():
            caller.hidden = b.identifiers
        for caller in b.callers.values():
            caller.hidden = a.identifiers
        yield World(app, client, admin, a, b)






# --- models -------------------------------------------------------------------------------


async def test_models_list_only_what_each_key_may_use(world):
    a, b = world.a.callers, world.b.callers
    assert await a["initech-main"].models() == [MOCK, "auto"]
    assert await a["initech-spare"].models() == [MOCK, "auto"]
    assert await b["umbrella-main"].models() == [MOCK, PREMIUM, "auto"]
    assert await b["umbrella-premium"].models() == [PREMIUM, "auto"]

    assert ok(await b["umbrella-main"].request("GET", f"/v1/models/{PREMIUM}"))["id"] == PREMIUM
    hidden = await a["initech-main"].request("GET", f"/v1/models/{PREMIUM}")
    missing = await a["initech-main"].request("GET", "/v1/models/no-such-model")
    # A model the key may not use looks exactly like one that does not exist.
    assert assert_error(hidden, 404, code="model_not_found")["message"] == assert_error(
        missing, 404)["message"].replace("no-such-model", PREMIUM)
    r = await b["umbrella-premium"].request("GET", f"/v1/models/{MOCK}")
    assert_error(r, 404, code="model_not_found")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_completions_refuse_models_outside_plan_or_key(world, endpoint):
    def send(caller: Caller, model: str):
        return caller.chat(model) if endpoint == "chat" else caller.complete(model)

    a, b = world.a.callers, world.b.callers
    assert_error(await send(a["initech-main"], PREMIUM), 403, code="model_not_allowed")
    assert_error(await send(a["initech-spare"], PREMIUM), 403, code="model_not_allowed")
    assert_error(await send(b["umbrella-premium"], MOCK), 403, code="model_not_allowed")
    ok(await send(a["initech-main"], MOCK))
    ok(await send(b["umbrella-main"], PREMIUM))
    ok(await send(b["umbrella-premium"], PREMIUM))


async def test_streaming_is_refused_the_same_way(world):
    r = await world.a.callers["initech-main"].chat(PREMIUM, stream=True)
    assert_error(r, 403, code="model_not_allowed")
    assert r.headers["content-type"].startswith("application/json")


async def test_embeddings_refuse_models_outside_plan_or_key(world):
    """Key and plan scopes come before anything about the model (here, chat models)."""
    def embed(caller: Caller, model: str):
        return caller.request("POST", "/v1/embeddings", json={"model": model, "input": "x"})

    a, b = world.a.callers, world.b.callers
    assert_error(await embed(a["initech-main"], PREMIUM), 403, code="model_not_allowed")
    assert_error(await embed(b["umbrella-premium"], MOCK), 403, code="model_not_allowed")
    assert_error(await embed(a["initech-main"], MOCK), 400, code="model_not_supported")
    assert_error(await embed(a["initech-main"], "no-such-model"), 404, code="model_not_found")


# --- keys ---------------------------------------------------------------------------------


async def test_keys_list_only_own_keys_without_secrets(world):
    for tenant in (world.a, world.b):
        for caller in tenant.callers.values():
            response = await caller.request("GET", "/v1/keys")
            listed = ok(response)
            assert {k["id"] for k in listed} == set(tenant.key_ids.values())
            assert all(set(k) == KEY_FIELDS for k in listed)  # no key, no secret_hash
            assert {k["tenant_id"] for k in listed} == {tenant.tenant_id}
            for own in tenant.callers.values():
                assert own.key.rsplit("-", 1)[1] not in response.text


async def test_cannot_revoke_another_tenants_key(world):
    a, b = world.a.callers, world.b.callers
    target = world.b.key_ids["umbrella-main"]
    foreign = await a["initech-main"].request("DELETE", f"/v1/keys/{target}")
    missing = await a["initech-main"].request("DELETE", "/v1/keys/zzzzzzzzzzzz")
    # Someone else's key is indistinguishable from no key at all.
    assert assert_error(foreign, 404)["message"] == assert_error(missing, 404)["message"].replace(
        "zzzzzzzzzzzz", target)
    ok(await b["umbrella-main"].chat(MOCK))
    assert all(k["revoked_at"] is None for k in await b["umbrella-main"].keys())

    # The endpoint does work on the caller's own keys.
    spare = world.a.key_ids["initech-spare"]
    assert ok(await a["initech-main"].request("DELETE", f"/v1/keys/{spare}"))["revoked_at"]
    assert_error(await a["initech-spare"].chat(MOCK), 401, code="invalid_api_key")
    ok(await a["initech-main"].chat(MOCK))


# --- adapters -----------------------------------------------------------------------------
# (With the real engine, outputs and uploads included: tests/gateway/test_adapters.py.)


async def test_another_tenants_adapter_does_not_exist(world, db_url):
    b_tenant = world.b.tenant_id
    engine = make_engine(db_url)
    try:
        async with make_sessionmaker(engine)() as session:
            await adapter_rows.create_adapter(
                session, tenant_id=b_tenant, name="umbrella-adapter", base_model=MOCK,
                path="/srv/umbrella-adapter", alias="umbrella-alias")
    finally:
        await engine.dispose()
    await world.app.state.gateway.watcher.catch_up()
    secret_bits = {"umbrella-alias", "/srv/umbrella-adapter"}
    for caller in world.a.callers.values():
        caller.hidden |= secret_bits
    a = world.a.callers["initech-main"]

    async def same_as_unknown(method: str, template: str, name: str, **kwargs: Any) -> None:
        found = await a.request(method, template.format(name), **kwargs)
        missing = await a.request(method, template.format("zzzz"), **kwargs)
        assert assert_error(found, 404)["message"] == assert_error(missing, 404)[
            "message"].replace("zzzz", name)

    for model in (f"{MOCK}:umbrella-adapter", "umbrella-alias"):
        r = await a.chat(model)
        assert assert_error(r, 404, code="model_not_found")["message"] == assert_error(
            await a.chat(f"{MOCK}:zzzz"), 404)["message"].replace(f"{MOCK}:zzzz", model)
        assert_error(await a.request("GET", f"/v1/models/{model}"), 404, code="model_not_found")
    await same_as_unknown("POST", "/v1/adapters/{}/load", "umbrella-adapter")
    await same_as_unknown("POST", "/v1/adapters/{}/unload", "umbrella-adapter")
    await same_as_unknown("DELETE", "/v1/adapters/{}", "umbrella-adapter")
    assert ok(await a.request("GET", "/v1/adapters")) == []
    assert await a.models() == [MOCK, "auto"]

    # B sees its own adapter, which no HTTP upstream can serve.
    b = world.b.callers["umbrella-main"]
    listed = ok(await b.request("GET", "/v1/adapters"))
    assert [(x["name"], x["residency"]) for x in listed] == [("umbrella-adapter", "unloaded")]
    assert_error(await b.chat(f"{MOCK}:umbrella-adapter"), 404, code="model_not_found")
    assert f"{MOCK}:umbrella-adapter" not in await b.models()
    r = await b.request("POST", "/v1/adapters/umbrella-adapter/load")
    assert "serves adapters" in assert_error(r, 400)["message"]


# --- usage --------------------------------------------------------------------------------


async def usage_by_model(caller: Caller, expected: dict[str, int], *, timeout_s: float = 10.0,
                         **params: str) -> dict[str, Any]:
    """The caller's usage report once its request counts reach `expected` (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = await caller.usage(**params)
        counts = {m["model"]: m["requests"] for m in report["models"]}
        if counts == expected or time.monotonic() > deadline:
            return report
        await asyncio.sleep(0.05)


async def test_usage_shows_only_own_numbers(world):
    a, b = world.a.callers, world.b.callers
    sent: dict[str, list[dict[str, int]]] = {"a": [], "b": []}
    for who, response in [
        ("a", await a["initech-main"].chat(MOCK)), ("a", await a["initech-spare"].chat(MOCK)),
        ("a", await a["initech-main"].complete(MOCK)),
        ("b", await b["umbrella-main"].chat(MOCK)), ("b", await b["umbrella-main"].chat(PREMIUM)),
        ("b", await b["umbrella-main"].chat(PREMIUM)),
        ("b", await b["umbrella-premium"].complete(PREMIUM)),
    ]:
        sent[who].append(ok(response)["usage"])
    assert_error(await a["initech-main"].chat(PREMIUM), 403)  # refused: never metered

    report_a = await usage_by_model(a["initech-main"], {MOCK: 3})
    report_b = await usage_by_model(b["umbrella-premium"], {MOCK: 1, PREMIUM: 3})
    assert report_a["tenant_id"] == world.a.tenant_id
    assert report_b["tenant_id"] == world.b.tenant_id
    assert {m["model"]: m["requests"] for m in report_a["models"]} == {MOCK: 3}
    assert {m["model"]: m["requests"] for m in report_b["models"]} == {MOCK: 1, PREMIUM: 3}
    for report, usages in ((report_a, sent["a"]), (report_b, sent["b"])):
        assert sum(m["prompt_tokens"] for m in report["models"]) == sum(
            u["prompt_tokens"] for u in usages)
        assert sum(m["completion_tokens"] for m in report["models"]) == sum(
            u["completion_tokens"] for u in usages)

    # Query parameters cannot point the report at someone else.
    again = await a["initech-main"].usage(tenant_id=world.b.tenant_id,
                                          key_id=world.b.key_ids["umbrella-main"])
    assert again == report_a


@pytest.mark.parametrize(("method", "url"), [
    ("DELETE", "/v1/keys/a%00b"),  # NUL: PostgreSQL refuses it in a query
    ("DELETE", "/v1/keys/" + "x" * 300),
    ("GET", "/v1/usage?since=yesterday"),
    ("GET", "/v1/usage?until=9999-12-31T23:59:59-23:59"),  # past year 9999 in UTC
    ("GET", "/v1/usage?since=0001-01-01T00:00:00%2B05:00"),  # before year 1 in UTC
])
async def test_tenant_endpoints_refuse_malformed_input(world, method, url):
    assert_error(await world.a.callers["initech-main"].request(method, url), 400)


# --- stored responses ---------------------------------------------------------------------


async def test_another_tenants_stored_response_does_not_exist(world, monkeypatch):
    """B can neither read, list, delete nor continue A's response: each is the 404 of an id
    that does not exist. A's own works throughout."""
    monkeypatch.setattr(stored_responses, "FRESH_S", 0.2)  # a fresh id's second look
    a, b = world.a.callers["initech-main"], world.b.callers["umbrella-main"]
    ask = {"model": MOCK, "max_output_tokens": 4}
    created = ok(await a.request("POST", "/v1/responses", json={**ask, "input": "hi"}))
    rid = created["id"]
    assert created["object"] == "response" and created["output"][0]["type"] == "message"
    assert ok(await a.request("GET", f"/v1/responses/{rid}")) == created

    def attempts(response_id: str) -> list[tuple[str, str, dict[str, Any]]]:
        return [("GET", f"/v1/responses/{response_id}", {}),
                ("GET", f"/v1/responses/{response_id}/input_items", {}),
                ("DELETE", f"/v1/responses/{response_id}", {}),
                ("POST", "/v1/responses", {"json": {
                    **ask, "input": "more", "previous_response_id": response_id}})]

    nope = "resp_" + "0" * 32
    for (method, url, kwargs), (_, unknown, unknown_kwargs) in zip(
            attempts(rid), attempts(nope), strict=True):
        foreign = assert_error(await b.request(method, url, **kwargs), 404)
        missing = assert_error(await b.request(method, unknown, **unknown_kwargs), 404)
        assert foreign["message"] == missing["message"].replace(nope, rid)
    for odd in ("a%00b", "x" * 300):  # never a query PostgreSQL refuses
        assert_error(await b.request("GET", f"/v1/responses/{odd}"), 404)

    follow = ok(await a.request("POST", "/v1/responses", json={
        **ask, "input": "more", "previous_response_id": rid}))
    assert follow["previous_response_id"] == rid
    items = ok(await a.request("GET", f"/v1/responses/{follow['id']}/input_items"))
    assert [i["content"][0]["text"] for i in items["data"]] == ["more"]
    assert ok(await a.request("DELETE", f"/v1/responses/{rid}"))["deleted"] is True
    assert_error(await a.request("GET", f"/v1/responses/{rid}"), 404)


# --- files and batches ---------------------------------------------------------------------


async def test_another_tenants_files_and_batches_do_not_exist(world):
    """B can neither read, download, delete, list after nor run A's files and batches: each
    is the 404 of an id never issued. A's batch runs under A's key's scopes (a line for a
    model A's plan does not allow is its 403, in the error file); A's own ids work."""
    a, b = world.a.callers["initech-main"], world.b.callers["umbrella-main"]
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": model, **CHAT}} for i, model in enumerate((MOCK, PREMIUM))]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = ok(await a.request("POST", "/v1/files", data={"purpose": "batch"},
                              files={"file": ("initech-jobs.jsonl", data)}))
    created = ok(await a.request("POST", "/v1/batches", json={
        "input_file_id": file["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"}))
    deadline = time.monotonic() + 20
    while (batch := ok(await a.request("GET", f"/v1/batches/{created['id']}")))[
            "status"] != "completed":
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.05)
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    error = json.loads((await a.request("GET", f"/v1/files/{batch['error_file_id']}/content"))
                       .text)
    assert error["custom_id"] == "line-1" and error["response"]["status_code"] == 403
    for caller in world.b.callers.values():
        caller.hidden |= {file["id"], batch["id"], batch["output_file_id"],
                          batch["error_file_id"], "initech-jobs.jsonl"}

    unknown_file, unknown_batch = "file-" + "0" * 32, "batch_" + "0" * 32

    async def same_as_unknown(method: str, template: str, real: str, unknown: str,
                              **kwargs: Any) -> None:
        found = await b.request(method, template.format(real), **kwargs)
        missing = await b.request(method, template.format(unknown), **kwargs)
        assert assert_error(found, 404)["message"] == assert_error(missing, 404)[
            "message"].replace(unknown, real)

    for file_id in (file["id"], batch["output_file_id"]):
        for method, template in (("GET", "/v1/files/{}"), ("GET", "/v1/files/{}/content"),
                                 ("DELETE", "/v1/files/{}")):
            await same_as_unknown(method, template, file_id, unknown_file)
    for method, template in (("GET", "/v1/batches/{}"), ("POST", "/v1/batches/{}/cancel")):
        await same_as_unknown(method, template, batch["id"], unknown_batch)
    found = await b.request("POST", "/v1/batches", json={
        "input_file_id": file["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    assert_error(found, 404)
    assert_error(await b.request("GET", "/v1/batches", params={"after": batch["id"]}), 404)
    assert_error(await b.request("GET", "/v1/files", params={"after": file["id"]}), 404)
    assert ok(await b.request("GET", "/v1/files"))["data"] == []
    assert ok(await b.request("GET", "/v1/batches"))["data"] == []

    # A's own still work, untouched by all that.
    assert [x["id"] for x in ok(await a.request("GET", "/v1/batches"))["data"]] == [batch["id"]]
    output = json.loads((await a.request("GET", f"/v1/files/{batch['output_file_id']}/content"))
                        .text)
    assert output["custom_id"] == "line-0" and output["response"]["status_code"] == 200
    ok(await a.request("DELETE", f"/v1/files/{file['id']}"))


# --- admin API ----------------------------------------------------------------------------


def api_routes(app: FastAPI) -> set[tuple[str, str]]:
    """(METHOD, path template) of every route the app documents, and of the surfaces' plain
    routes (`request_path.SurfaceRoute`), which FastAPI's schema does not list."""
    documented = {(method.upper(), path) for path, operations in app.openapi()["paths"].items()
                  for method in operations}
    surfaces = {(method, route.path) for route in app.router.routes
                if isinstance(route, SurfaceRoute) for method in route.methods or ()}
    return documented | surfaces


def fill(path: str, tenant: Tenant) -> str:
    return path.format(tenant_id=tenant.tenant_id, plan_id=tenant.plan_id,
                       key_id=next(iter(tenant.key_ids.values())), name="premium",
                       period="2025-01")


async def test_admin_api_refuses_tenant_keys(world):
    routes = sorted(r for r in api_routes(world.app) if r[1].startswith("/admin/"))
    assert len(routes) >= 15, routes
    a_key = world.a.callers["initech-main"]
    for method, template in routes:
        path = fill(template, world.b)
        body = {"json": {"status": "suspended"}} if method in ("POST", "PATCH") else {}
        r = await a_key.request(method, path, **body)
        assert_error(r, 403, code="permission_denied")
        r = await world.client.request(method, path, **body)
        assert_error(r, 401, code="invalid_api_key")
        r = await world.client.request(method, path, headers=bearer("sk-sb-bogus"), **body)
        assert_error(r, 401, code="invalid_api_key")
    # Nothing above changed anything: B is active, its key works, the deployments remain.
    ok(await world.b.callers["umbrella-main"].chat(PREMIUM))
    tenant = ok(await world.client.get(f"/admin/tenants/{world.b.tenant_id}",
                                       headers=world.admin))
    assert tenant["status"] == "active"
    assert len(ok(await world.client.get("/admin/deployments", headers=world.admin))) == 2


async def test_every_tenant_route_is_covered(world):
    """A new tenant-facing route must be added to TENANT_ROUTES and to the tests above."""
    routes = {r for r in api_routes(world.app) if not r[1].startswith("/admin/")}
    assert routes == TENANT_ROUTES | PUBLIC_ROUTES


# --- metering ------------------------------------------------------------------------------


async def test_one_tenants_request_id_cannot_stop_anothers_metering(
        db_url, tmp_path, mock_upstream):
    a = await seed_tenant(db_url, tmp_path, name="initech")
    b = await seed_tenant(db_url, tmp_path, name="umbrella")
    cfg = mock_settings(db_url, tmp_path, mock_upstream.base_url)
    async with gateway_client(cfg) as client:
        long_id = "r" * 100  # too long to store: replaced by one of the gateway's own
        r = await client.post("/v1/chat/completions", json={"model": MOCK, **CHAT},
                              headers={**bearer(a.key), "x-request-id": long_id})
        assert ok(r) and len(r.headers["x-request-id"]) == 32
        ok(await client.post("/v1/chat/completions", json={"model": MOCK, **CHAT},
                             headers=bearer(b.key)))
        report = await usage_by_model(Caller(client, b.key), {MOCK: 1}, timeout_s=5.0)
        assert {m["model"]: m["requests"] for m in report["models"]} == {MOCK: 1}
