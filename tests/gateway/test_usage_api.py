"""Usage and invoices over HTTP and the CLI, in-process, on SQLite and PostgreSQL.

Admin: keyset record pages, streamed CSV/JSONL exports, summaries, invoices (read, close,
freeze). Tenants: their own summary and records only, whatever they pass. Every refusal is
in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from billing import export, ledger
from gateway import cli
from tenancy.db import make_engine, make_sessionmaker
from tests.billing.test_export import MODELS, T0, make_records
from tests.gateway.support import (
    Seeded,
    admin_key,
    assert_error,
    bearer,
    gateway_client,
    ok,
    seed_tenant,
    settings,
)


@dataclass
class World:
    client: httpx.AsyncClient  # sends the admin key
    db_url: str
    a: Seeded
    b: Seeded
    records: list[dict[str, Any]]

    def of(self, tenant: Seeded) -> list[dict[str, Any]]:
        return [r for r in self.records if r["tenant_id"] == tenant.tenant_id]

    async def tenant_get(self, tenant: Seeded, url: str, **params: Any) -> httpx.Response:
        return await self.client.get(url, params=params, headers=bearer(tenant.key))


async def write(db_url: str, records: list[dict[str, Any]]) -> None:
    engine = make_engine(db_url)
    try:
        async with make_sessionmaker(engine)() as session:
            for i in range(0, len(records), 500):
                await ledger.write_batch(session, records=records[i:i + 500])
    finally:
        await engine.dispose()


def records_for(a: Seeded, b: Seeded, n: int = 90, **kwargs: Any) -> list[dict[str, Any]]:
    """Records of both tenants, half of each tenant's on its real key."""
    out = make_records(n, tenants=(a.tenant_id, b.tenant_id), **kwargs)
    for i, r in enumerate(out):
        tenant = a if r["tenant_id"] == a.tenant_id else b
        r["key_id"] = tenant.key_id if i % 4 < 2 else "0" + tenant.key_id[1:]
    return out


@pytest.fixture
async def world(db_url: str, tmp_path: Path) -> AsyncIterator[World]:
    a = await seed_tenant(db_url, tmp_path, name="initech")
    b = await seed_tenant(db_url, tmp_path, name="umbrella")
    records = records_for(a, b)
    await write(db_url, records)
    key = await admin_key(db_url, tmp_path)
    async with gateway_client(settings(db_url, tmp_path)) as client:
        client.headers.update(bearer(key))
        yield World(client, db_url, a, b, records)


async def walk(get: Any, url: str, **params: Any) -> tuple[list[dict[str, Any]], int]:
    """Every page of a keyset-paginated listing; returns the rows and the page count."""
    rows, after, pages = [], None, 0
    while True:
        page = ok(await get(url, **params, **({} if after is None else {"after": after})))
        assert page["object"] == "list"
        rows += page["data"]
        pages += 1
        after = page["next"]
        if after is None:
            return rows, pages


def sums(rows: list[dict[str, Any]]) -> dict[str, int]:
    names = ("prompt_tokens", "completion_tokens", "cached_tokens", "cost_micros")
    return {n: sum(int(r[n]) for r in rows) for n in names} | {"requests": len(rows)}


# --- admin: records and exports -----------------------------------------------------------


async def test_record_pages_visit_every_row_once(world):
    async def get(url: str, **params: Any) -> httpx.Response:
        return await world.client.get(url, params=params)

    rows, pages = await walk(get, "/admin/usage", limit=13)
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == len(world.records) and pages == -(-len(ids) // 13)
    assert ids == sorted(ids, reverse=True)  # newest first by default
    assert {r["request_id"] for r in rows} == {r["request_id"] for r in world.records}
    assert sums(rows) == sums(world.records)
    assert rows[0]["cost_usd"] == export.usd(rows[0]["cost_micros"])
    assert {"deployment", "price_id"} <= set(rows[0])

    asc, _ = await walk(get, "/admin/usage", limit=1000, order="asc")
    assert [r["id"] for r in asc] == sorted(ids)

    since, until = T0 + timedelta(days=2), T0 + timedelta(days=9)
    a_id = world.a.tenant_id
    cases = [
        ({"tenant_id": a_id}, lambda r: r["tenant_id"] == a_id),
        ({"tenant_id": a_id, "model": "beta", "status": "ok"},
         lambda r: r["tenant_id"] == a_id and r["model"] == "beta" and r["status"] == "ok"),
        ({"cache_hit": "exact"}, lambda r: r["cache_hit"] == "exact"),
        ({"key_id": world.b.key_id}, lambda r: r["key_id"] == world.b.key_id),
        ({"since": since.isoformat(), "until": until.isoformat()},
         lambda r: since <= r["created_at"] < until),
        ({"origin": "batch"}, lambda r: r["batch_id"] is not None),
        ({"tenant_id": a_id, "origin": "live"},
         lambda r: r["tenant_id"] == a_id and r["batch_id"] is None),
        ({"batch_id": f"batch_{a_id}"}, lambda r: r["batch_id"] == f"batch_{a_id}"),
    ]
    for params, keep in cases:
        got, _ = await walk(get, "/admin/usage", limit=7, **params)
        want = [r["request_id"] for r in world.records if keep(r)]
        assert sorted(r["request_id"] for r in got) == sorted(want), params
        assert want


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
async def test_exports_stream_every_matching_row(world, fmt):
    a_rows = world.of(world.a)
    async with world.client.stream("GET", "/admin/usage/export", params={
            "format": fmt, "tenant_id": world.a.tenant_id}) as response:
        assert response.status_code == 200
        body = b"".join([chunk async for chunk in response.aiter_bytes()]).decode()
    assert response.headers["content-type"].startswith(export.MEDIA_TYPES[fmt].split(";")[0])
    assert response.headers["content-disposition"] == (
        f'attachment; filename="usage-{world.a.tenant_id}.{fmt}"')
    if fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(body)))
        assert list(rows[0]) == export.header(export.COLUMNS)
    else:
        rows = [json.loads(line) for line in body.splitlines()]
    assert [r["request_id"] for r in rows] == [r["request_id"] for r in a_rows]
    assert sums(rows) == sums(a_rows)
    assert all(r["cost_usd"] == export.usd(int(r["cost_micros"])) for r in rows)

    everything = await world.client.get("/admin/usage/export", params={"format": fmt})
    lines = everything.text.splitlines()
    assert len(lines) == len(world.records) + (fmt == "csv")
    none = await world.client.get("/admin/usage/export",
                                  params={"format": fmt, "model": "no-such-model"})
    assert none.text.splitlines() == ([",".join(export.header(export.COLUMNS))]
                                      if fmt == "csv" else [])


# --- admin: summaries ---------------------------------------------------------------------


async def test_summary_from_the_aggregates(world):
    report = ok(await world.client.get("/admin/usage/summary", params={"group_by": "tenant"}))
    assert report["object"] == "usage.summary" and report["group_by"] == ["tenant"]
    by_tenant = {row["group"]["tenant"]: row for row in report["data"]}
    for tenant in (world.a, world.b):
        row, want = by_tenant[tenant.tenant_id], sums(world.of(tenant))
        assert {k: row[k] for k in want} == want
        errors = sum(r["status"] != "ok" for r in world.of(tenant))
        assert row["errors"] == errors
        assert row["error_rate"] == round(errors / row["requests"], 6)
        hits = sum(r["cache_hit"] != "none" for r in world.of(tenant))
        assert row["cache_hit_rate"] == round(hits / row["requests"], 6)
    assert report["totals"]["requests"] == len(world.records)
    assert report["totals"]["cost_usd"] == export.usd(sums(world.records)["cost_micros"])

    report = ok(await world.client.get("/admin/usage/summary", params={
        "group_by": "day,model", "tenant_id": world.b.tenant_id,
        "since": "2025-03-03", "until": "2025-03-10T12:00:00Z"}))
    assert (report["since"], report["until"]) == ("2025-03-03", "2025-03-11")
    window = [r for r in world.of(world.b)
              if "2025-03-03" <= r["created_at"].date().isoformat() < "2025-03-11"]
    assert report["totals"]["requests"] == len(window)
    assert {row["group"]["model"] for row in report["data"]} <= set(MODELS)
    assert [(r["group"]["day"], r["group"]["model"]) for r in report["data"]] == sorted(
        (r["group"]["day"], r["group"]["model"]) for r in report["data"])

    assert_error(await world.client.get("/admin/usage/summary", params={"group_by": "week"}),
                 400)


async def test_per_tenant_usage_route_still_answers(world):
    report = ok(await world.client.get(f"/admin/usage/{world.a.tenant_id}"))
    assert report["tenant_id"] == world.a.tenant_id
    by_model = {m["model"]: m for m in report["models"]}
    for model in MODELS:
        rows = [r for r in world.of(world.a) if r["model"] == model]
        assert by_model[model]["requests"] == len(rows)
        assert by_model[model]["cost_micros"] == sum(r["cost_micros"] for r in rows)
    future = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    assert ok(await world.client.get(f"/admin/usage/{world.a.tenant_id}",
                                     params={"since": future}))["models"] == []


# --- admin: invoices ----------------------------------------------------------------------


async def test_invoices_read_close_and_freeze(world):
    url = f"/admin/tenants/{world.a.tenant_id}/invoices/2025-03"
    first = await world.client.get(url)
    assert first.status_code == 200, first.text
    again = await world.client.get(url)
    assert first.content == again.content  # byte-identical
    invoice = first.json()
    march = [r for r in world.of(world.a) if r["created_at"].month == 3]
    assert invoice["status"] == "open" and invoice["closed_at"] is None
    assert invoice["total_micros"] == sum(r["cost_micros"] for r in march)
    assert invoice["total_micros"] == sum(line["cost_micros"] for line in invoice["lines"])
    assert invoice["totals"]["requests"] == len(march)
    assert invoice["total_usd"] == export.usd(invoice["total_micros"])

    as_csv = await world.client.get(url, params={"format": "csv"})
    assert as_csv.headers["content-type"].startswith("text/csv")
    assert as_csv.headers["content-disposition"] == (
        f'attachment; filename="invoice-{world.a.tenant_id}-2025-03.csv"')
    rows = list(csv.DictReader(io.StringIO(as_csv.text)))
    assert int(rows[-1]["cost_micros"]) == invoice["total_micros"]
    assert as_csv.content == (await world.client.get(url, params={"format": "csv"})).content

    closed = ok(await world.client.post(url + "/close"))
    assert closed["status"] == "closed" and closed["closed_at"]
    assert closed["lines"] == invoice["lines"]
    stored = await world.client.get(url)
    assert stored.json() == closed

    # Late March usage: the closed invoice holds; the open April one moves.
    april_url = f"/admin/tenants/{world.a.tenant_id}/invoices/2025-04"
    april = ok(await world.client.get(april_url))
    late = records_for(world.a, world.a, 4, start=datetime(2025, 3, 31, 12, tzinfo=UTC),
                       step=timedelta(hours=6), prefix="late")
    await write(world.db_url, late)
    assert (await world.client.get(url)).content == stored.content
    april_later = ok(await world.client.get(april_url))
    assert april_later["totals"]["requests"] == april["totals"]["requests"] + 2

    assert_error(await world.client.post(url + "/close"), 409, code="invoice_closed")
    now = datetime.now(UTC)
    for period in (f"{now.year:04d}-{now.month:02d}", f"{now.year + 1:04d}-01"):
        error = assert_error(await world.client.post(
            f"/admin/tenants/{world.a.tenant_id}/invoices/{period}/close"), 400,
            code="period_not_over")
        assert error["param"] == "period"


async def test_invoice_and_usage_errors_are_openai_shaped(world):
    a_id = world.a.tenant_id
    for period in ("2025-13", "2025-1", "March", "0000-01"):
        error = assert_error(await world.client.get(f"/admin/tenants/{a_id}/invoices/{period}"),
                             400)
        assert error["param"] == "period"
        assert_error(await world.client.post(f"/admin/tenants/{a_id}/invoices/{period}/close"),
                     400)
    error = assert_error(await world.client.get(f"/admin/tenants/{a_id}/invoices/2025-03",
                                                params={"format": "pdf"}), 400)
    assert error["param"] == "format"
    assert_error(await world.client.get("/admin/tenants/nobody/invoices/2025-03"), 404)
    assert_error(await world.client.post("/admin/tenants/nobody/invoices/2025-03/close"), 404)
    for params in ({"format": "xml"}, {"since": "yesterday"}, {"tenant_id": "a b"},
                   {"origin": "sometimes"}, {"batch_id": "b" * 41}):
        assert_error(await world.client.get("/admin/usage/export", params=params), 400)
    for params in ({"limit": 0}, {"limit": 1001}, {"after": -1}, {"after": "x"},
                   {"order": "sideways"}, {"until": "9999-12-31T23:59:59-23:59"},
                   {"model": "a\x00b"}):
        assert_error(await world.client.get("/admin/usage", params=params), 400)
    assert_error(await world.client.get("/admin/usage/summary",
                                        params={"since": "2025-02-30"}), 400)
    # Tenant keys are not admin keys.
    r = await world.client.get("/admin/usage", headers=bearer(world.a.key))
    assert_error(r, 403)


# --- tenant self-service ------------------------------------------------------------------


async def test_tenants_see_only_their_own_usage(world):
    a, b = world.a, world.b
    hidden = {b.tenant_id, b.key_id}
    report = ok(await world.tenant_get(a, "/v1/usage", group_by="model"))
    assert report["tenant_id"] == a.tenant_id
    want = sums(world.of(a))
    assert {k: report["totals"][k] for k in want} == want
    assert {m["model"]: m["requests"] for m in report["models"]} == {
        m: sum(r["model"] == m for r in world.of(a)) for m in MODELS}
    # Parameters naming the other tenant change nothing.
    sneaky = await world.tenant_get(a, "/v1/usage", group_by="model", tenant_id=b.tenant_id,
                                    key_id=b.key_id)
    assert sneaky.json() == report
    by_day = ok(await world.tenant_get(a, "/v1/usage", since="2025-03-02",
                                       until="2025-03-05"))
    assert by_day["group_by"] == ["day"]
    assert [row["group"]["day"] for row in by_day["data"]] == [
        "2025-03-02", "2025-03-03", "2025-03-04"]

    async def get(url: str, **params: Any) -> httpx.Response:
        response = await world.tenant_get(a, url, **params)
        assert not any(h in response.text for h in hidden), response.text[:300]
        return response

    rows, _ = await walk(get, "/v1/usage/records", limit=11, tenant_id=b.tenant_id)
    assert sorted(r["request_id"] for r in rows) == sorted(r["request_id"] for r in world.of(a))
    assert all(r["tenant_id"] == a.tenant_id for r in rows)
    assert not {"deployment", "price_id"} & set(rows[0])
    own_key, _ = await walk(get, "/v1/usage/records", key_id=a.key_id)
    assert own_key and all(r["key_id"] == a.key_id for r in own_key)
    assert (await walk(get, "/v1/usage/records", key_id=b.key_id))[0] == []
    # B's record ids as cursors only move through A's rows.
    b_ids = [r["id"] for r in ok(await world.client.get(
        "/admin/usage", params={"tenant_id": b.tenant_id}))["data"]]
    page = ok(await get("/v1/usage/records", after=b_ids[0], order="asc"))
    assert all(r["tenant_id"] == a.tenant_id for r in page["data"])
    for group in ("tenant", "deployment", "day,tenant"):
        assert_error(await world.tenant_get(a, "/v1/usage", group_by=group), 400)
    assert_error(await world.tenant_get(a, "/v1/usage/records", limit=5000), 400)
    assert_error(await world.client.get("/v1/usage", headers=bearer("sk-sb-bogus")), 401)
    # Without a tenant key there is nothing to see, admin key included.
    assert_error(await world.client.get("/v1/usage/records"), 401)


# --- CLI ----------------------------------------------------------------------------------


def run_cli(monkeypatch, capsys, db_url: str, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setenv("SWITCHBOARD_DATABASE_URL", db_url)
    with pytest.raises(SystemExit) as exited:
        cli.main(list(argv))
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


async def test_cli_exports_and_invoices(db_url, tmp_path, monkeypatch, capsys):
    a = await seed_tenant(db_url, tmp_path, name="initech")
    b = await seed_tenant(db_url, tmp_path, name="umbrella")
    records = records_for(a, b, 40)
    await write(db_url, records)
    a_rows = [r for r in records if r["tenant_id"] == a.tenant_id]

    def cli_run(*argv: str) -> tuple[int, str, str]:
        return run_cli(monkeypatch, capsys, db_url, *argv)

    out_file = tmp_path / "a.jsonl"
    code, out, err = await asyncio.to_thread(
        cli_run, "usage", "export", "--format", "jsonl", "--tenant", "initech",
        "--out", str(out_file))
    assert code == 0, err
    summary = json.loads(out)
    assert summary["rows"] == len(a_rows) and summary["format"] == "jsonl"
    assert summary["cost_micros"] == sum(r["cost_micros"] for r in a_rows)
    lines = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["request_id"] for r in lines] == [r["request_id"] for r in a_rows]
    assert not list(tmp_path.glob(".*.partial"))

    code, out, err = await asyncio.to_thread(
        cli_run, "usage", "export", "--since", "2025-03-02", "--until", "2025-03-04T06:00")
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    since, until = datetime(2025, 3, 2, tzinfo=UTC), datetime(2025, 3, 4, 6, tzinfo=UTC)
    assert [r["request_id"] for r in rows] == [
        r["request_id"] for r in records if since <= r["created_at"] < until]

    code, out, err = await asyncio.to_thread(
        cli_run, "usage", "export", "--tenant", "initech", "--origin", "batch")
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    batch_lines = [(r["request_id"], r["batch_id"], "50") for r in a_rows if r["batch_id"]]
    assert batch_lines
    assert [(r["request_id"], r["batch_id"], r["batch_price_percent"]) for r in rows] == (
        batch_lines)
    code, out, err = await asyncio.to_thread(
        cli_run, "usage", "export", "--batch", f"batch_{b.tenant_id}", "--format", "jsonl")
    assert code == 0, err
    assert {json.loads(line)["tenant_id"] for line in out.splitlines()} == {b.tenant_id}

    code, out, err = await asyncio.to_thread(
        cli_run, "usage", "summary", "--tenant", a.tenant_id, "--group-by", "model")
    assert code == 0, err
    assert json.loads(out)["totals"]["requests"] == len(a_rows)

    code, out, err = await asyncio.to_thread(
        cli_run, "invoices", "show", "--tenant", "initech", "--period", "2025-03")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["status"] == "open" and shown["totals"]["requests"] == sum(
        r["created_at"].month == 3 for r in a_rows)
    code, out, err = await asyncio.to_thread(
        cli_run, "invoices", "show", "--tenant", "initech", "--period", "2025-03",
        "--format", "csv")
    assert code == 0 and out.splitlines()[-1].startswith("total,")
    code, out, err = await asyncio.to_thread(
        cli_run, "invoices", "close", "--tenant", "initech", "--period", "2025-03")
    assert code == 0, err
    assert json.loads(out)["lines"] == shown["lines"]
    code, out, err = await asyncio.to_thread(
        cli_run, "invoices", "close", "--tenant", "initech", "--period", "2025-03")
    assert code == 1 and "already closed" in err
    code, out, err = await asyncio.to_thread(
        cli_run, "invoices", "show", "--tenant", "nobody", "--period", "2025-03")
    assert code == 1 and err.startswith("error: no tenant")
