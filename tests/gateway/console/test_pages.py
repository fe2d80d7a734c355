"""Console pages: CSRF on every change, inline form errors, keys shown once, usage read from
the aggregates with downloads, and a bounded number of queries per page."""

from __future__ import annotations

import asyncio
import json
import re

from sqlalchemy import event
from starlette.routing import Route

from gateway.console.routes import (
    adapters,
    batches,
    deployments,
    keys,
    login,
    static,
    tenants,
    usage,
)
from tests.gateway.console.support import Console, console
from tests.gateway.support import bearer, mock_deployment, seed_tenant, write_deployments

SAFE = {"GET", "HEAD"}


async def _tenant(c: Console, name: str = "acme") -> str:
    r = await c.post("/console/tenants", {"name": name, "plan_id": "__new__"})
    assert r.status_code == 303, r.text
    return r.headers["location"].rsplit("/", 1)[1]


def _mutating_routes() -> list[tuple[str, str]]:
    """Every console route that changes something, from the page modules themselves."""
    found = []
    for module in (login, static, tenants, keys, adapters, deployments, batches, usage):
        for route in module.router.routes:
            assert isinstance(route, Route)
            for method in sorted((route.methods or set()) - SAFE):
                found.append((method, f"/console{route.path}"))
    return found


async def test_every_change_needs_the_csrf_token(sqlite_url, tmp_path, mock_upstream):
    deployments = write_deployments(tmp_path, [mock_deployment(mock_upstream.base_url)])
    async with console(sqlite_url, tmp_path, deployments_file=deployments) as c:
        tenant_id = await _tenant(c)
        r = await c.post(f"/console/tenants/{tenant_id}/keys", {"name": "k"})
        key_id = re.search(r'data-key-id="([^"]+)"', r.text).group(1)
        values = {"tenant_id": tenant_id, "key_id": key_id, "name": "mock", "action": "delete",
                  "batch_id": f"batch_{'0' * 32}"}
        routes = [(m, p) for m, p in _mutating_routes() if p != "/console/login"]
        assert len(routes) >= 10, routes
        for method, path in routes:
            url = re.sub(r"\{(\w+)(:\w+)?\}", lambda m: values[m.group(1)], path)
            form = {"name": "csrf-probe", "plan_id": "__new__", "status": "suspended"}
            for headers, data in (({}, form), ({"x-csrf-token": "wrong"}, form),
                                  ({}, {**form, "csrf_token": c.csrf[:-1] + "x"})):
                r = await c.client.request(method, url, data=data, headers=headers)
                assert r.status_code == 403, (method, url, r.status_code)
                assert "CSRF" in r.text
        page = (await c.client.get("/console/tenants")).text
        assert "csrf-probe" not in page  # nothing was created
        r = await c.client.get(f"/console/tenants/{tenant_id}")
        assert "suspended" not in r.text.split("<h1>")[1].split("</h1>")[0]
        # The htmx header carries the token as well as the form field does.
        r = await c.client.post(f"/console/tenants/{tenant_id}/status",
                                data={"status": "suspended"}, headers={"x-csrf-token": c.csrf})
        assert r.status_code == 303


async def test_forms_show_the_servers_errors(sqlite_url, tmp_path):
    async with console(sqlite_url, tmp_path) as c:
        r = await c.post("/console/tenants", {"name": "  ", "plan_id": "__new__"})
        assert r.status_code == 400 and "Enter a tenant name." in r.text
        tenant_id = await _tenant(c)
        r = await c.post("/console/tenants", {"name": "acme", "plan_id": "__new__"})
        assert r.status_code == 400 and "already exists" in r.text
        r = await c.post("/console/tenants", {"name": "beta", "plan_id": "no-such-plan"})
        assert r.status_code == 400 and "No plan with id" in r.text
        r = await c.post(f"/console/tenants/{tenant_id}/limits",
                         {"rpm": "abc", "budget_usd": "-1", "budget_period": "week"})
        assert r.status_code == 400
        assert "Enter a whole number" in r.text and "Enter an amount from 0" in r.text
        assert "Pick one of: month, day" in r.text and 'value="abc"' in r.text
        weight_range, weight_text = "above 0 and at most 100", "Enter a number, like 1 or 2.5"
        for weight, priority, messages in (
            ("0", "11", (weight_range, "Enter a number from -10 to 10")),
            ("-1", "-11", (weight_range, "Enter a number from -10 to 10")),
            ("101", "1.5", (weight_range, "Enter a whole number")),
            ("nan", "0", (weight_range,)),
            ("inf", "0", (weight_range,)),
            ("heavy", "0", (weight_text,)),
        ):
            r = await c.post(f"/console/tenants/{tenant_id}/limits",
                             {"engine_weight": weight, "priority": priority})
            assert r.status_code == 400 and f'value="{weight}"' in r.text
            assert all(message in r.text for message in messages), (weight, priority)
        r = await c.post(f"/console/tenants/{tenant_id}/keys",
                         {"rpm": "0", "expires_at": "2001-01-01T00:00"}, htmx=True)
        assert r.status_code == 400 and 'id="keys-panel"' in r.text and "<html" not in r.text
        assert "Enter a number from 1" in r.text and "must be in the future" in r.text
        r = await c.post(f"/console/tenants/{tenant_id}/adapters",
                         {"name": "a", "base_model": "nope", "path": "/tmp"})
        assert r.status_code == 400 and "serves adapters" in r.text
        r = await c.post(f"/console/tenants/{tenant_id}/adapters/upload",
                         {"name": "", "base_model": "nope"})
        assert r.status_code == 400 and "Choose a file." in r.text
        r = await c.client.get("/console/usage?since=yesterday")
        assert r.status_code == 400 and "YYYY-MM-DD" in r.text


async def test_tenant_plan_edits_go_through_the_service(sqlite_url, tmp_path):
    async with console(sqlite_url, tmp_path) as c:
        tenant_id = await _tenant(c)
        r = await c.post(f"/console/tenants/{tenant_id}/limits", {
            "rpm": "60", "tpm": "", "max_concurrent": "4", "budget_usd": "12.5",
            "budget_period": "day", "allowed_models": "mock-model, chat",
            "allowed_tiers": "economy"})
        assert r.status_code == 303
        page = (await c.client.get(f"/console/tenants/{tenant_id}")).text
        assert 'value="60"' in page and 'value="12.5"' in page
        assert 'value="mock-model, chat"' in page
        # Left blank, the engine share is the default, never "unlimited".
        assert 'name="engine_weight" value="1"' in page and 'name="priority" value="0"' in page
        r = await c.post(f"/console/tenants/{tenant_id}/limits", {
            "rpm": "60", "engine_weight": "2.5", "priority": "-3"})
        assert r.status_code == 303
        page = (await c.client.get(f"/console/tenants/{tenant_id}")).text
        assert 'name="engine_weight" value="2.5"' in page and 'name="priority" value="-3"' in page
        r = await c.post(f"/console/tenants/{tenant_id}/status", {"status": "suspended"})
        assert r.status_code == 303
        assert "Reactivate tenant" in (await c.client.get(f"/console/tenants/{tenant_id}")).text
        await _tenant(c, "zeta")
        r = await c.client.get("/console/tenants?q=ZET", headers={"hx-request": "true"})
        assert r.text.startswith('<div id="tenants-table">') and "zeta" in r.text
        assert "acme" not in r.text


async def test_key_is_shown_once_and_revocation_bites(sqlite_url, tmp_path, mock_upstream):
    deployments = write_deployments(tmp_path, [mock_deployment(mock_upstream.base_url)])
    async with console(sqlite_url, tmp_path, deployments_file=deployments) as c:
        tenant_id = await _tenant(c)
        r = await c.post(f"/console/tenants/{tenant_id}/keys",
                         {"name": "prod", "rpm": "100", "allowed_models": "mock-model"},
                         htmx=True)
        assert r.status_code == 201
        key = re.search(r'<code id="new-key-value">([^<]+)</code>', r.text).group(1)
        assert key.startswith("sk-sb-") and "data-copy" in r.text
        page = (await c.client.get(f"/console/tenants/{tenant_id}/keys")).text
        assert key not in page and key.split("-")[2] in page
        assert (await c.client.get("/v1/models", headers=bearer(key))).status_code == 200
        key_id = key.split("-")[2]
        r = await c.post(f"/console/tenants/{tenant_id}/keys/{key_id}/revoke", htmx=True)
        assert r.status_code == 200 and "revoked" in r.text
        assert (await c.client.get("/v1/models", headers=bearer(key))).status_code == 401


async def test_usage_charts_exports_and_invoices(sqlite_url, tmp_path, mock_upstream):
    deployments = write_deployments(tmp_path, [mock_deployment(mock_upstream.base_url)])
    seeded = await seed_tenant(sqlite_url, tmp_path, name="acme")
    async with console(sqlite_url, tmp_path, deployments_file=deployments) as c:
        body = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}
        r = await c.client.post("/v1/chat/completions", json=body, headers=bearer(seeded.key))
        assert r.status_code == 200, r.text
        # Flushed every 0.1 s. The page's queries are separate reads, so a flush landing between
        # them can show the tables before the chart: wait until both show the request.
        for _ in range(100):
            page = await c.client.get("/console/usage")
            chart = json.loads(
                re.search(r'class="chart-data">([^<]+)</script>', page.text).group(1))
            if "No usage in this period" not in page.text and chart["requests"][-1]:
                break
            await asyncio.sleep(0.1)
        assert page.status_code == 200 and 'id="top-tenants"' in page.text and "acme" in page.text
        assert len(chart["days"]) == 30 and chart["requests"][-1] == 1
        assert chart["prompt_tokens"][-1] > 0
        r = await c.client.get(f"/console/usage?tenant_id={seeded.tenant_id}&tier=nope",
                               headers={"hx-request": "true"})
        assert r.text.startswith('<div id="usage-panel">') and "No usage in this period" in r.text
        csv = await c.client.get(f"/console/usage/export?format=csv&tenant_id={seeded.tenant_id}")
        assert csv.status_code == 200 and csv.text.startswith("id,request_id,")
        assert len(csv.text.strip().splitlines()) == 2
        assert "attachment" in csv.headers["content-disposition"]
        jsonl = await c.client.get("/console/usage/export?format=jsonl")
        assert json.loads(jsonl.text.splitlines()[0])["tenant_id"] == seeded.tenant_id
        period = re.search(r'name="period" value="([^"]+)"', page.text).group(1)
        invoice = await c.client.get(
            f"/console/usage/invoice?tenant_id={seeded.tenant_id}&period={period}")
        assert invoice.status_code == 200 and invoice.json()["lines"][0]["requests"] == 1
        r = await c.client.get(f"/console/usage/invoice?tenant_id={seeded.tenant_id}"
                               f"&period={period}&format=csv")
        assert r.text.startswith("line,") and "total" in r.text
        assert (await c.client.get("/console/usage/invoice?tenant_id=x&period=13")
                ).status_code == 400
        deployments_page = (await c.client.get("/console/deployments")).text
        assert "mock-model" in deployments_page and "closed" in deployments_page
        r = await c.post("/console/deployments/mock/breaker/reset", htmx=True)
        assert r.status_code == 200 and "Breaker of &#39;mock&#39; reset." in r.text


async def test_queries_per_page_do_not_grow_with_rows(sqlite_url, tmp_path):
    async with console(sqlite_url, tmp_path) as c:
        statements: list[str] = []
        event.listen(c.app.state.gateway.db.sync_engine, "before_cursor_execute",
                     lambda conn, cursor, sql, *args: statements.append(sql))

        async def count(path: str) -> int:
            statements.clear()
            assert (await c.client.get(path)).status_code == 200
            # Not the auth watcher's background poll, which may land mid-request.
            return len([s for s in statements if "auth_state" not in s])

        tenant_id = await _tenant(c, "t0")
        for i in range(2):
            await c.post(f"/console/tenants/{tenant_id}/keys", {"name": f"k{i}"})
        pages = ["/console/tenants", f"/console/tenants/{tenant_id}",
                 f"/console/tenants/{tenant_id}/keys", f"/console/tenants/{tenant_id}/adapters",
                 "/console/usage", "/console/workers", "/console/deployments",
                 "/console/batches", f"/console/batches?tenant_id={tenant_id}"]
        before = {p: await count(p) for p in pages}
        for i in range(1, 8):
            await _tenant(c, f"t{i}")
            await c.post(f"/console/tenants/{tenant_id}/keys", {"name": f"more{i}"})
        after = {p: await count(p) for p in pages}
        assert after == before
        assert max(after.values()) <= 8, after
