"""Batches in the console and in the usage export, over an in-process mock upstream: the list
(every tenant's or one tenant's, newest first, in keyset pages) shows what the Batch API
says; a cancel from the console is the API's cancel, only under the batch's own tenant; the
signed-out are refused. Each batch line's usage record names its batch and the plan's batch
share, and costs that share of the same request made live."""

from __future__ import annotations

import asyncio
import csv
import io
import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import event

from tests.gateway.console.support import Console, console
from tests.gateway.support import (
    CHAT_MODEL,
    Seeded,
    bearer,
    ok,
    priced_deployment,
    seed_tenant,
    write_deployments,
)

MOCKS = ("up",)
FINAL = ("completed", "failed", "cancelled", "expired")


def line(custom_id: str, content: str = "hi") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": CHAT_MODEL, "max_tokens": 5,
                     "messages": [{"role": "user", "content": content}]}}


class Batches:
    """A tenant's Batch API calls, through the same app the console is served by."""

    def __init__(self, c: Console, tenant: Seeded) -> None:
        self.c = c
        self.tenant = tenant

    async def create(self, lines: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the input file, the batch) as the API answered them."""
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        file = ok(await self.c.client.post(
            "/v1/files", headers=bearer(self.tenant.key), data={"purpose": "batch"},
            files={"file": ("in.jsonl", data)}))
        batch = ok(await self.c.client.post(
            "/v1/batches", headers=bearer(self.tenant.key),
            json={"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                  "completion_window": "24h"}))
        return file, batch

    async def get(self, batch_id: str) -> dict[str, Any]:
        return ok(await self.c.client.get(f"/v1/batches/{batch_id}",
                                          headers=bearer(self.tenant.key)))

    async def until(self, batch_id: str, statuses: tuple[str, ...] = FINAL, *,
                    done: int = 0, timeout_s: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            batch = await self.get(batch_id)
            counts = batch["request_counts"]
            if batch["status"] in statuses and counts["completed"] + counts["failed"] >= done:
                return batch
            assert time.monotonic() < deadline, batch
            await asyncio.sleep(0.05)


@asynccontextmanager
async def world(sqlite_url: str, tmp_path: Path, mocks: dict[str, Any], *,
                batch_percent: int = 50, **overrides: Any
                ) -> AsyncIterator[tuple[Console, Batches, Seeded]]:
    """A signed-in console; tenant "acme" (its plan's batch share `batch_percent`) with a
    key, and tenant "beta"; one deployment at 1000 USD per 1M tokens (1000 micro-USD a
    token, so every share is exact)."""
    acme = await seed_tenant(sqlite_url, tmp_path, name="acme",
                             plan={"rpm": 10_000, "batch_price_percent": batch_percent})
    beta = await seed_tenant(sqlite_url, tmp_path, name="beta")
    deployments = write_deployments(tmp_path, [priced_deployment("up", mocks["up"], "1000")])
    async with console(sqlite_url, tmp_path, deployments_file=deployments,
                       batch_poll_interval_s=0.2, **overrides) as c:
        yield c, Batches(c, acme), beta


def row_of(html: str, batch_id: str) -> str:
    """The table row of one batch."""
    match = re.search(rf'<tr data-batch-id="{batch_id}".*?</tr>', html, re.S)
    assert match, f"{batch_id} is not listed"
    return match.group(0)


def stat(row: str, name: str) -> int:
    match = re.search(rf'data-stat="{name}">(\d+)<', row)
    assert match, (name, row)
    return int(match.group(1))


async def test_the_list_shows_a_batch_as_the_api_does(sqlite_url, tmp_path, mocks):
    async with world(sqlite_url, tmp_path, mocks) as (c, api, beta):
        file, created = await api.create([line("a"), line("b"), line("c", "other")])
        batch = await api.until(created["id"])
        assert batch["status"] == "completed"
        page = await c.client.get("/console/batches")
        assert page.status_code == 200 and 'id="batches-table"' in page.text
        row = row_of(page.text, batch["id"])
        assert 'data-status="completed"' in row and "/v1/chat/completions" in row
        assert CHAT_MODEL in row and ">acme</a>" in row  # the tenant, in the all-tenant list
        assert (stat(row, "total"), stat(row, "completed"), stat(row, "failed")) == (3, 3, 0)
        assert f"{file['id']}</span> <span class=\"muted\">({file['bytes']} B)" in row
        assert batch["output_file_id"] in row and batch["error_file_id"] is None
        usage = batch["usage"]
        assert f"in {usage['input_tokens']}" in row and f"out {usage['output_tokens']}" in row
        assert usage["output_tokens"] > 0
        assert "finished" in row and "data-cancel" not in row  # ended: nothing to cancel
        r = await c.post(f"/console/tenants/{api.tenant.tenant_id}/batches/{batch['id']}"
                         "/cancel", htmx=True)
        assert r.status_code == 409 and 'id="batches-panel"' in r.text
        assert "Cannot cancel a batch with status &#39;completed&#39;." in r.text

        # One tenant's batches: the tenant's page tab, and another tenant lists none.
        mine = (await c.client.get(f"/console/batches?tenant_id={api.tenant.tenant_id}")).text
        assert batch["id"] in mine and "acme: batches" in mine
        assert 'aria-current="page">Batches' in mine
        theirs = (await c.client.get(f"/console/batches?tenant_id={beta.tenant_id}")).text
        assert batch["id"] not in theirs and "beta has no batches yet." in theirs
        missing = await c.client.get("/console/batches?tenant_id=nobody")
        assert missing.status_code == 404 and "No tenant with id" in missing.text
        tenant_page = (await c.client.get(f"/console/tenants/{api.tenant.tenant_id}")).text
        assert f'href="/console/batches?tenant_id={api.tenant.tenant_id}"' in tenant_page


async def test_pages_are_newest_first_and_never_repeat(sqlite_url, tmp_path, mocks):
    async with world(sqlite_url, tmp_path, mocks, batch_worker=False) as (c, api, _):
        ids = [(await api.create([line(f"r{i}")]))[1]["id"] for i in range(5)]
        listed = ok(await c.client.get("/v1/batches", headers=bearer(api.tenant.key)))
        newest_first = [b["id"] for b in listed["data"]]
        assert sorted(newest_first) == sorted(ids)
        seen: list[str] = []
        url: str | None = "/console/batches?limit=2"
        pages = 0
        while url is not None:
            html = (await c.client.get(url)).text
            seen += re.findall(r'<tr data-batch-id="([^"]+)"', html)
            pages += 1
            assert ('id="batches-newest"' in html) == (pages > 1)
            older = re.search(r'href="([^"]+)" id="batches-older"', html)
            url = None if older is None else older.group(1).replace("&amp;", "&")
        assert seen == newest_first and pages == 3


async def test_the_list_costs_the_same_queries_however_many_batches(sqlite_url, tmp_path,
                                                                    mocks):
    async with world(sqlite_url, tmp_path, mocks, batch_worker=False) as (c, api, _):
        statements: list[str] = []
        event.listen(c.app.state.gateway.db.sync_engine, "before_cursor_execute",
                     lambda conn, cursor, sql, *args: statements.append(sql))

        async def count(path: str) -> int:
            statements.clear()
            assert (await c.client.get(path)).status_code == 200
            return len([s for s in statements if "auth_state" not in s])

        await api.create([line("first")])
        pages = ["/console/batches", f"/console/batches?tenant_id={api.tenant.tenant_id}"]
        before = [await count(p) for p in pages]
        for i in range(6):
            await api.create([line(f"more-{i}")])
        assert [await count(p) for p in pages] == before
        assert max(before) <= 5, before


async def test_a_console_cancel_is_the_apis_and_names_the_tenant(sqlite_url, tmp_path, mocks):
    mocks["up"].mock.mode.delay_ms = 150
    async with world(sqlite_url, tmp_path, mocks, batch_max_concurrency=1) as (c, api, beta):
        _, created = await api.create([line(f"r{i}") for i in range(20)])
        await api.until(created["id"], ("in_progress",), done=1)
        row = row_of((await c.client.get("/console/batches")).text, created["id"])
        assert 'data-status="in_progress"' in row and f'data-cancel="{created["id"]}"' in row
        tenant = api.tenant.tenant_id

        # Another tenant's URL, or none, is a 404, and the batch runs on.
        for other in (beta.tenant_id, "nobody"):
            r = await c.post(f"/console/tenants/{other}/batches/{created['id']}/cancel",
                             htmx=True)
            assert r.status_code == 404 and "has no batch" in r.text
        r = await c.post(f"/console/tenants/{tenant}/batches/batch_{'0' * 32}/cancel")
        assert r.status_code == 404
        assert (await api.get(created["id"]))["status"] == "in_progress"

        r = await c.post(f"/console/tenants/{tenant}/batches/{created['id']}/cancel",
                         {"view_tenant_id": tenant}, htmx=True)
        assert r.status_code == 200 and r.text.startswith('<div id="batches-panel"')
        assert f"Batch {created['id']} is cancelling" in r.text
        assert f'hx-get="/console/batches?tenant_id={tenant}"' in r.text  # the same view
        assert (await api.get(created["id"]))["status"] in ("cancelling", "cancelled")
        batch = await api.until(created["id"])
        assert batch["status"] == "cancelled" and batch["cancelled_at"]
        done = batch["request_counts"]["completed"]
        assert 1 <= done < 20  # stopped early: the worker noticed

        row = row_of((await c.client.get("/console/batches")).text, created["id"])
        assert 'data-status="cancelled"' in row and "data-cancel" not in row
        assert stat(row, "completed") == done and batch["output_file_id"] in row
        # Again: a no-op, as in the API.
        r = await c.post(f"/console/tenants/{tenant}/batches/{created['id']}/cancel",
                         htmx=True)
        assert r.status_code == 200 and f"Batch {created['id']} is cancelled." in r.text

        # A plain form post (no htmx) goes back to the list it came from.
        _, second = await api.create([line(f"s{i}") for i in range(20)])
        await api.until(second["id"], ("validating", "in_progress"))
        r = await c.post(f"/console/tenants/{tenant}/batches/{second['id']}/cancel",
                         {"view_tenant_id": tenant})
        assert r.status_code == 303
        assert r.headers["location"] == f"/console/batches?tenant_id={tenant}"
        assert (await api.until(second["id"]))["status"] == "cancelled"


async def test_the_signed_out_and_tenant_keys_are_refused(sqlite_url, tmp_path, mocks):
    async with world(sqlite_url, tmp_path, mocks, batch_worker=False) as (c, api, _):
        _, created = await api.create([line("a")])
        path = f"/console/tenants/{api.tenant.tenant_id}/batches/{created['id']}/cancel"
        c.client.cookies.clear()
        r = await c.client.get("/console/batches")
        assert r.status_code == 303 and r.headers["location"].startswith("/console/login")
        r = await c.client.get("/console/batches", headers=bearer(api.tenant.key))
        assert r.status_code == 303 and r.headers["location"].startswith("/console/login")
        r = await c.client.post(path, data={"csrf_token": c.csrf},
                                headers=bearer(api.tenant.key))
        assert r.status_code == 303 and r.headers["location"] == "/console/login"
        r = await c.client.post(path, headers={"hx-request": "true"})
        assert r.headers.get("hx-redirect") == "/console/login"
        login = await c.login(api.tenant.key)
        assert login.status_code != 303 and "Tenant API keys cannot sign in" in login.text
        assert (await api.get(created["id"]))["status"] == "validating"  # nothing cancelled


async def test_batch_lines_are_marked_and_priced_at_the_plans_share(sqlite_url, tmp_path,
                                                                    mocks):
    async with world(sqlite_url, tmp_path, mocks, batch_percent=25) as (c, api, _):
        _, created = await api.create([line("a", "same words"), line("b", "same words")])
        batch = await api.until(created["id"])
        assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
        live = await c.client.post("/v1/chat/completions", headers=bearer(api.tenant.key),
                                   json=line("x", "same words")["body"])
        live_id = ok(live) and live.headers["x-request-id"]
        lines = {o["id"] for o in await _content(c, api, batch["output_file_id"])}

        tenant = api.tenant.tenant_id
        rows = await _until_exported(c, f"tenant_id={tenant}", 3)
        by_id = {r["request_id"]: r for r in rows}
        assert set(by_id) == lines | {live_id}
        live_row = by_id[live_id]
        assert live_row["batch_id"] == "" and live_row["batch_price_percent"] == ""
        assert int(live_row["cost_micros"]) > 0
        for request_id in lines:
            r = by_id[request_id]
            assert r["batch_id"] == batch["id"] and r["batch_price_percent"] == "25"
            assert (r["prompt_tokens"], r["completion_tokens"]) == (
                live_row["prompt_tokens"], live_row["completion_tokens"])
            assert int(r["cost_micros"]) * 4 == int(live_row["cost_micros"])

        # Narrowed to batch lines, to live requests, to this batch (the row's own link).
        only = await _export(c, f"tenant_id={tenant}&origin=batch")
        assert {r["request_id"] for r in only} == lines
        assert [r["request_id"] for r in await _export(c, f"tenant_id={tenant}&origin=live")
                ] == [live_id]
        link = re.search(r'href="/console/usage/export\?([^"]+)" data-records',
                         (await c.client.get("/console/batches")).text).group(1)
        assert {r["request_id"] for r in await _export(c, link.replace("&amp;", "&"))
                } == lines
        r = await c.client.get("/console/usage/export?format=csv&origin=sometimes")
        assert r.status_code == 400
        page = (await c.client.get("/console/usage")).text
        assert 'id="export-origin"' in page and 'value="batch"' in page

        # The admin API and the tenant's own records say the same.
        admin = ok(await c.client.get("/admin/usage", headers=bearer(c.admin),
                                      params={"batch_id": batch["id"]}))["data"]
        assert {(r["request_id"], r["batch_price_percent"]) for r in admin} == {
            (i, 25) for i in lines}
        own = ok(await c.client.get("/v1/usage/records", headers=bearer(api.tenant.key),
                                    params={"origin": "live"}))["data"]
        assert [(r["request_id"], r["batch_id"]) for r in own] == [(live_id, None)]


async def _content(c: Console, api: Batches, file_id: str) -> list[dict[str, Any]]:
    r = await c.client.get(f"/v1/files/{file_id}/content", headers=bearer(api.tenant.key))
    assert r.status_code == 200, r.text
    return [json.loads(x) for x in r.text.splitlines()]


async def _export(c: Console, query: str) -> list[dict[str, str]]:
    r = await c.client.get(f"/console/usage/export?format=csv&{query}")
    assert r.status_code == 200, r.text
    return list(csv.DictReader(io.StringIO(r.text)))


async def _until_exported(c: Console, query: str, count: int) -> list[dict[str, str]]:
    """The export once `count` records are written (the meter flushes every 0.1 s)."""
    deadline = time.monotonic() + 10
    while True:
        rows = await _export(c, query)
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.05)
