"""The Batch API in-process over mock upstreams: line validation (unit), files, the batch
lifecycle (validating -> in_progress -> finalizing -> completed; failed; cancelling ->
cancelled; expired), lines refused for limits waiting instead of failing, metering at the
plan's batch price, and a restart in the middle of a batch (a second app over the same
database and files folder finishes it). The official client against a live server over the
real engine: tests/gateway/test_batches_live.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from gateway.app import create_app
from gateway.batches import lines
from gateway.batches.endpoints import ENDPOINTS
from gateway.batches.files import FileStore
from gateway.batches.run import Pending, Run, usage_of
from gateway.batches.worker import BatchWorker
from gateway.errors import APIError
from gateway.settings import Settings
from tenancy.batches import Batch
from tenancy.db import make_engine, make_sessionmaker
from tests.gateway.support import (
    CHAT_MODEL,
    GatewayWorld,
    assert_error,
    bearer,
    in_process,
    ok,
    priced_deployment,
    seed_tenant,
    serve_world,
    settings,
    usage_rows,
    write_deployments,
)

MOCKS = ("up",)
CHAT_URL, EMBED_URL = "/v1/chat/completions", "/v1/embeddings"
EMBED_MODEL = "remote-embed"
FINAL = ("completed", "failed", "cancelled", "expired")


# --- one line, checked like a live request (unit) -------------------------------------------


def raw(**line: Any) -> bytes:
    return json.dumps(line).encode()


def chat_line(custom_id: str, content: str = "hi", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL,
            "body": {"model": CHAT_MODEL, "messages": [{"role": "user", "content": content}],
                     "max_tokens": 5, **body}}


def check(line: bytes | dict[str, Any], url: str = CHAT_URL) -> Any:
    data = line if isinstance(line, bytes) else json.dumps(line).encode()
    return lines.check_line(data, ENDPOINTS[url], max_body_bytes=1 << 20)


def test_a_good_line_is_parsed_by_the_endpoints_own_parser():
    checked = check(chat_line("a", temperature=0))
    assert isinstance(checked, lines.Valid)
    assert checked.custom_id == "a" and checked.model == CHAT_MODEL
    assert checked.body.messages[0].content == "hi" and checked.body.temperature == 0
    embedded = check({"custom_id": "e", "method": "POST", "url": EMBED_URL,
                      "body": {"model": EMBED_MODEL, "input": ["x", "y"]}}, EMBED_URL)
    assert isinstance(embedded, lines.Valid) and embedded.body.inputs() == ["x", "y"]


@pytest.mark.parametrize(("line", "param"), [
    ({**chat_line("a"), "method": "GET"}, "method"),
    ({**chat_line("a"), "url": "/v1/completions"}, "url"),
    ({**chat_line("a"), "body": "hi"}, "body"),
    ({**chat_line("a"), "extra": 1}, "extra"),
    (chat_line("a", stream=True), "stream"),
    (chat_line("a", temperature=7), "temperature"),  # the parser's own words and param
    ({"custom_id": "a", "method": "POST", "url": CHAT_URL, "body": {"model": CHAT_MODEL}},
     "messages"),
])
def test_a_line_refused_like_a_live_request_keeps_its_custom_id(line, param):
    checked = check(line)
    assert isinstance(checked, lines.Invalid), checked
    assert checked.custom_id == "a" and checked.status == 400
    assert checked.error["error"]["param"] == param
    assert checked.error["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("line", [
    b"not json", b"[1, 2]", raw(method="POST", url=CHAT_URL, body={}),
    raw(custom_id=7, method="POST"), raw(custom_id="", method="POST"),
    raw(custom_id="x" * 600),
])
def test_a_line_without_a_custom_id_to_report_it_under_is_broken(line):
    assert isinstance(check(line), lines.Broken)


def test_a_body_over_the_request_limit_is_a_413_line():
    checked = lines.check_line(json.dumps(chat_line("big", "x" * 2000)).encode(),
                               ENDPOINTS[CHAT_URL], max_body_bytes=1000)
    assert isinstance(checked, lines.Invalid) and checked.status == 413


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_scan_lists_what_fails_a_batch_with_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        chat_line("a"), "", "{oops", chat_line("b", temperature=9), chat_line("a")])
    scan = lines.scan(path, ENDPOINTS[CHAT_URL], max_lines=100, max_body_bytes=1 << 20)
    assert [(p["code"], p["line"]) for p in scan.problems] == [
        ("invalid_json_line", 3), ("duplicate_custom_id", 5)]
    assert [(e.custom_id, e.number, e.invalid is None) for e in scan.entries] == [
        ("a", 1, True), ("b", 4, False)]
    # each entry points at its own bytes
    data = path.read_bytes()
    assert json.loads(data[scan.entries[1].offset:][:scan.entries[1].length])["custom_id"] == "b"

    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    assert [p["code"] for p in lines.scan(empty, ENDPOINTS[CHAT_URL], max_lines=5,
                                          max_body_bytes=1000).problems] == ["empty_file"]
    many = write_jsonl(tmp_path / "many.jsonl", [chat_line(str(i)) for i in range(4)])
    assert [p["code"] for p in lines.scan(many, ENDPOINTS[CHAT_URL], max_lines=3,
                                          max_body_bytes=1 << 20).problems] == [
        "too_many_requests"]


def test_usage_of_reads_every_endpoints_words():
    def entry(usage: dict[str, Any]) -> dict[str, Any]:
        return {"response": {"status_code": 200, "body": {"usage": usage}}}

    assert usage_of(entry({"prompt_tokens": 5, "completion_tokens": 2,
                           "prompt_tokens_details": {"cached_tokens": 3}})) == (5, 3, 2)
    assert usage_of(entry({"input_tokens": 4, "output_tokens": 1})) == (4, 0, 1)
    assert usage_of(entry({"prompt_tokens": 6, "total_tokens": 6})) == (6, 0, 0)
    assert usage_of({"response": None, "error": {"code": "batch_expired"}}) == (0, 0, 0)


# --- the worker's choices (unit) ----------------------------------------------------------


def bare_worker(**overrides: Any) -> BatchWorker:
    gw = SimpleNamespace(settings=Settings(batch_retry_s=7.0, **overrides))
    return BatchWorker(gw, FileStore(Path("/nonexistent")))  # type: ignore[arg-type]


def bare_run(worker: BatchWorker, batch_id: str, tenant: str, created_s: int, lines_left: int,
             **fields: Any) -> Run:
    run = Run(batch_id, tenant, "key", datetime(2026, 1, 1, tzinfo=UTC) + timedelta(
        seconds=created_s), datetime(2026, 1, 2, tzinfo=UTC), ENDPOINTS[CHAT_URL],
        Path("/nonexistent"), Path("/nonexistent"), "in_progress", **fields)
    run.pending.extend(Pending(i, 0, 1, f"{batch_id}-{i}") for i in range(lines_left))
    worker.runs[batch_id] = run
    worker._activate(run)
    return run


def test_the_next_line_is_the_least_busy_then_least_served_tenants():
    worker = bare_worker()
    a_old = bare_run(worker, "a-old", "A", 0, 5)
    bare_run(worker, "a-new", "A", 10, 5)
    b = bare_run(worker, "b", "B", 20, 5)
    assert worker._pick(0.0) is a_old  # both idle and unserved: by tenant, then oldest batch
    worker._tenant_in_flight["A"] = 1
    assert worker._pick(0.0) is b  # A has a line in flight, B none
    worker._tenant_in_flight["B"] = 1
    worker._served.update(A=3.0, B=1.0)
    assert worker._pick(0.0) is b  # as busy: the least served
    b.not_before = 5.0
    assert worker._pick(0.0) is a_old and worker._pick(5.0) is b  # B waits out a retry-after
    b.cap = 1
    assert worker._pick(5.0) is a_old  # B's own cap (half its concurrency limit) is full
    b.stopping = "cancelled"
    worker._tenant_in_flight.clear()
    assert worker._pick(5.0) is a_old  # a cancelled batch starts nothing new


def test_a_tenant_back_from_idle_starts_level_with_the_least_served():
    worker = bare_worker()
    bare_run(worker, "a", "A", 0, 5)
    worker._served["A"] = 40.0
    worker._served["B"] = 2.0  # B's service long ago
    bare_run(worker, "b", "B", 1, 5)
    assert worker._served["B"] == 40.0  # not 38 lines ahead of A for having been away


def test_which_refusals_wait_and_for_how_long():
    worker = bare_worker()
    assert worker._retry_after(APIError(429, "slow down", headers={"retry-after": "3"})) == 3
    assert worker._retry_after(APIError(429, "budget", code="insufficient_quota")) == 7.0
    assert worker._retry_after(APIError(503, "nothing can serve it now")) == 7.0
    for status in (400, 401, 403, 404, 500, 502):
        assert worker._retry_after(APIError(status, "no")) is None


@pytest.mark.parametrize("spins", range(3))
async def test_a_wakeup_that_meets_the_cancel_does_not_keep_the_dispatcher_running(spins):
    # On Python 3.11, asyncio.wait_for drops a cancel that comes as the awaited event is set;
    # the dispatcher then looped on and shutdown hung (a CI teardown ran into its timeout).
    worker = bare_worker()
    task = asyncio.create_task(worker._dispatch())
    for _ in range(2):
        await asyncio.sleep(0)
    worker._changed.set()
    for _ in range(spins):
        await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=1.0)
    task.cancel()
    assert done


# --- in-process, over a mock upstream ------------------------------------------------------


@dataclass
class BatchWorld(GatewayWorld):
    async def upload(self, rows: list[Any], *, key: str | None = None,
                     purpose: str = "batch", name: str = "in.jsonl") -> httpx.Response:
        data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
        return await self.client.post("/v1/files", headers=bearer(key or self.tenant.key),
                                      data={"purpose": purpose},
                                      files={"file": (name, data.encode())})

    async def batch(self, rows: list[Any], url: str = CHAT_URL, *, key: str | None = None,
                    **more: Any) -> dict[str, Any]:
        file = ok(await self.upload(rows, key=key))
        return ok(await self.client.post("/v1/batches", headers=bearer(key or self.tenant.key),
                                         json={"input_file_id": file["id"], "endpoint": url,
                                               "completion_window": "24h", **more}))

    async def get(self, batch_id: str, *, key: str | None = None) -> dict[str, Any]:
        return ok(await self.client.get(f"/v1/batches/{batch_id}",
                                        headers=bearer(key or self.tenant.key)))

    async def until(self, batch_id: str, statuses: tuple[str, ...] = FINAL, *,
                    timeout_s: float = 30.0, key: str | None = None,
                    done: int | None = None) -> dict[str, Any]:
        """The batch once its status is one of `statuses` (and `done` lines are answered)."""
        deadline = time.monotonic() + timeout_s
        while True:
            batch = await self.get(batch_id, key=key)
            counts = batch["request_counts"]
            if batch["status"] in statuses and (
                    done is None or counts["completed"] + counts["failed"] >= done):
                return batch
            assert time.monotonic() < deadline, batch
            await asyncio.sleep(0.05)

    async def content(self, file_id: str, *, key: str | None = None) -> list[dict[str, Any]]:
        r = await self.client.get(f"/v1/files/{file_id}/content",
                                  headers=bearer(key or self.tenant.key))
        assert r.status_code == 200, r.text
        return [json.loads(line) for line in r.text.splitlines()]


def embedding_deployment(mock: Any) -> dict[str, Any]:
    return {"name": "emb", "model_name": EMBED_MODEL, "provider": "openai",
            "mode": "embedding", "base_url": mock.base_url, "api_key": "sk-up",
            "upstream_model": "text-embedding-mock", "input_price_per_1m": "1000"}


def deployments(mocks: dict[str, Any]) -> list[dict[str, Any]]:
    # 1000 USD per 1M tokens: a micro-USD per token... times a thousand, so halves are exact
    return [priced_deployment("up", mocks["up"], "1000"), embedding_deployment(mocks["up"])]


def batch_settings(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    return {"files_dir": tmp_path / "files", "batch_poll_interval_s": 0.2, **overrides}


@asynccontextmanager
async def batch_world(sqlite_url: str, tmp_path: Path, mocks: dict[str, Any], *,
                      plan: dict[str, Any] | None = None, **overrides: Any
                      ) -> AsyncIterator[BatchWorld]:
    async with serve_world(BatchWorld, sqlite_url, tmp_path, mocks, deployments(mocks),
                           plan={"rpm": 10_000, **(plan or {})},
                           **batch_settings(tmp_path, **overrides)) as world:
        yield world


@pytest.fixture
async def world(sqlite_url, tmp_path, mocks) -> AsyncIterator[BatchWorld]:
    async with batch_world(sqlite_url, tmp_path, mocks) as w:
        yield w


async def test_a_batch_answers_every_line_in_openais_shapes(world, sqlite_url):
    rows = [chat_line(f"req-{i}", f"question {i}") for i in range(3)]
    rows += [chat_line("bad-temp", temperature=9), {**chat_line("bad-url"), "url": "/v1/x"}]
    created = await world.batch(rows, metadata={"job": "nightly"})
    assert created["status"] == "validating" and created["object"] == "batch"
    assert created["endpoint"] == CHAT_URL and created["metadata"] == {"job": "nightly"}
    assert created["expires_at"] - created["created_at"] == 24 * 3600

    batch = await world.until(created["id"])
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
    assert batch["model"] == CHAT_MODEL
    for stamp in ("in_progress_at", "finalizing_at", "completed_at"):
        assert batch[stamp] >= batch["created_at"]
    assert batch["usage"]["input_tokens"] > 0 and batch["usage"]["output_tokens"] > 0

    output = await world.content(batch["output_file_id"])
    assert sorted(o["custom_id"] for o in output) == ["req-0", "req-1", "req-2"]
    for line in output:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"] == line["id"]
        assert response["body"]["object"] == "chat.completion"
        assert response["body"]["choices"][0]["message"]["content"]
    errors = {e["custom_id"]: e for e in await world.content(batch["error_file_id"])}
    assert set(errors) == {"bad-temp", "bad-url"}
    assert errors["bad-temp"]["response"]["status_code"] == 400
    assert errors["bad-temp"]["response"]["body"]["error"]["param"] == "temperature"
    assert errors["bad-url"]["response"]["body"]["error"]["param"] == "url"

    files = ok(await world.client.get("/v1/files", headers=bearer(world.tenant.key)))["data"]
    outputs = {f["id"]: f for f in files if f["purpose"] == "batch_output"}
    assert set(outputs) == {batch["output_file_id"], batch["error_file_id"]}
    assert outputs[batch["output_file_id"]]["filename"] == f"{batch['id']}_output.jsonl"

    # Each line is metered as its own request, under the line's id, at the plan's batch price
    # (50%): half of what the same request costs live.
    records = await usage_rows(sqlite_url, [o["id"] for o in output])
    assert len(records) == 3 and all(r.status == "ok" for r in records)
    live = await world.chat("question 1", max_tokens=5)
    ok(live)
    live_record, = await usage_rows(sqlite_url, [live.headers["x-request-id"]])
    batch_record = next(r for r in records if r.request_id == next(
        o["id"] for o in output if o["custom_id"] == "req-1"))
    assert (batch_record.prompt_tokens, batch_record.completion_tokens) == (
        live_record.prompt_tokens, live_record.completion_tokens)
    assert batch_record.cost_micros * 2 == live_record.cost_micros > 0


async def test_an_embeddings_batch(world):
    rows = [{"custom_id": f"e{i}", "method": "POST", "url": EMBED_URL,
             "body": {"model": EMBED_MODEL, "input": [f"text {i}", "more"]}} for i in range(3)]
    batch = await world.until((await world.batch(rows, EMBED_URL))["id"])
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 3
    output = await world.content(batch["output_file_id"])
    body = output[0]["response"]["body"]
    assert body["object"] == "list" and len(body["data"]) == 2
    assert batch["error_file_id"] is None


async def test_a_file_no_line_of_which_can_be_reported_fails_validation(world):
    batch = await world.until((await world.batch(
        [chat_line("a"), "not json", chat_line("a")]))["id"])
    assert batch["status"] == "failed" and batch["failed_at"]
    assert [(e["code"], e["line"]) for e in batch["errors"]["data"]] == [
        ("invalid_json_line", 2), ("duplicate_custom_id", 3)]
    assert batch["output_file_id"] is None and batch["error_file_id"] is None


async def test_cancel_stops_new_lines_and_keeps_what_was_done(sqlite_url, tmp_path, mocks):
    mocks["up"].mock.mode.delay_ms = 150
    async with batch_world(sqlite_url, tmp_path, mocks, batch_max_concurrency=1) as world:
        created = await world.batch([chat_line(f"r{i}") for i in range(20)])
        await world.until(created["id"], ("in_progress",), done=1)
        r = await world.client.post(f"/v1/batches/{created['id']}/cancel",
                                    headers=bearer(world.tenant.key))
        assert ok(r)["status"] in ("cancelling", "cancelled")
        batch = await world.until(created["id"])
        assert batch["status"] == "cancelled" and batch["cancelling_at"] and batch[
            "cancelled_at"]
        done = batch["request_counts"]["completed"]
        assert 1 <= done < 20 and batch["request_counts"]["failed"] == 0
        assert len(await world.content(batch["output_file_id"])) == done
        # again: the same batch; a batch that ended cannot be cancelled
        again = ok(await world.client.post(f"/v1/batches/{created['id']}/cancel",
                                           headers=bearer(world.tenant.key)))
        assert again["status"] == "cancelled"
        mocks["up"].mock.mode.delay_ms = None
        finished = await world.until((await world.batch([chat_line("x")]))["id"])
        r = await world.client.post(f"/v1/batches/{finished['id']}/cancel",
                                    headers=bearer(world.tenant.key))
        assert_error(r, 409)


async def test_lines_not_run_within_the_window_expire(sqlite_url, tmp_path, mocks):
    mocks["up"].mock.mode.delay_ms = 150
    async with batch_world(sqlite_url, tmp_path, mocks, batch_max_concurrency=1) as world:
        created = await world.batch([chat_line(f"r{i}") for i in range(20)])
        await world.until(created["id"], ("in_progress",), done=1)
        await set_batch(sqlite_url, created["id"],
                        expires_at=datetime.now(UTC) - timedelta(seconds=1))
        batch = await world.until(created["id"])
        assert batch["status"] == "expired" and batch["expired_at"]
        counts = batch["request_counts"]
        assert counts["total"] == 20 and counts["completed"] + counts["failed"] == 20
        assert 1 <= counts["completed"] < 20
        errors = await world.content(batch["error_file_id"])
        assert len(errors) == counts["failed"]
        assert all(e["response"] is None and e["error"]["code"] == "batch_expired"
                   for e in errors)


async def batch_row(db_url: str, batch_id: str) -> Batch:
    engine = make_engine(db_url)
    try:
        async with make_sessionmaker(engine)() as session:
            row = await session.get(Batch, batch_id)
            assert row is not None
            return row
    finally:
        await engine.dispose()


async def set_batch(db_url: str, batch_id: str, **values: Any) -> None:
    engine = make_engine(db_url)
    try:
        async with make_sessionmaker(engine)() as session:
            await session.execute(update(Batch).where(Batch.id == batch_id).values(**values))
            await session.commit()
    finally:
        await engine.dispose()


async def test_lines_refused_for_limits_wait_and_run_later(sqlite_url, tmp_path, mocks):
    """An upstream that answers 429 (retry after 1 s): the lines wait, none fails."""
    mode = mocks["up"].mock.mode
    mode.status, mode.retry_after = 429, "1"
    async with batch_world(sqlite_url, tmp_path, mocks, breaker_failure_threshold=1000,
                           route_max_attempts=1) as world:
        created = await world.batch([chat_line(f"r{i}") for i in range(3)])
        await asyncio.sleep(1.0)
        waiting = await world.get(created["id"])
        assert waiting["status"] == "in_progress"
        assert waiting["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
        mode.status = None
        batch = await world.until(created["id"])
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}


async def test_a_line_refused_for_good_fails_alone(world):
    batch = await world.until((await world.batch(
        [chat_line("ok"), chat_line("missing", model="no-such-model")]))["id"])
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    error, = await world.content(batch["error_file_id"])
    assert error["custom_id"] == "missing" and error["response"]["status_code"] == 404
    assert error["response"]["body"]["error"]["code"] == "model_not_found"


async def test_a_restart_mid_batch_resumes_from_the_lines_not_done(sqlite_url, tmp_path, mocks):
    """A first gateway stops (as on a deploy) with the batch half done; a second one over
    the same database and files folder finishes it: every line answered exactly once."""
    mocks["up"].mock.mode.delay_ms = 100
    tenant = await seed_tenant(sqlite_url, tmp_path, name="acme", plan={"rpm": 10_000})
    cfg = settings(sqlite_url, tmp_path, deployments_file=write_deployments(
        tmp_path, deployments(mocks)), batch_max_concurrency=2, **batch_settings(tmp_path))
    rows = [chat_line(f"r{i}", f"line {i}") for i in range(16)]
    app = create_app(cfg)
    async with in_process(app) as client:
        first = BatchWorld(client, app, tenant, mocks)
        created = await first.batch(rows)
        await first.until(created["id"], ("in_progress",), done=4)
    row = await batch_row(sqlite_url, created["id"])
    assert row.status == "in_progress" and 4 <= row.completed < 16
    assert row.lease_owner is None  # given back on the way out: the next process goes on
    app = create_app(cfg)
    async with in_process(app) as client:
        second = BatchWorld(client, app, tenant, mocks)
        batch = await second.until(created["id"])
        assert batch["status"] == "completed"
        assert batch["request_counts"] == {"total": 16, "completed": 16, "failed": 0}
        output = await second.content(batch["output_file_id"])
    assert sorted(o["custom_id"] for o in output) == sorted(r["custom_id"] for r in rows)


# --- files ---------------------------------------------------------------------------------


async def test_files_upload_list_retrieve_content_and_delete(world):
    key = world.tenant.key
    created = ok(await world.upload([chat_line("a")], name="jobs.jsonl"))
    assert created["object"] == "file" and created["purpose"] == "batch"
    assert created["filename"] == "jobs.jsonl" and created["bytes"] > 0
    assert ok(await world.client.get(f"/v1/files/{created['id']}", headers=bearer(key))) == (
        created)
    r = await world.client.get(f"/v1/files/{created['id']}/content", headers=bearer(key))
    assert json.loads(r.content)["custom_id"] == "a"

    more = [ok(await world.upload([chat_line(str(i))]))["id"] for i in range(3)]
    first = ok(await world.client.get("/v1/files", params={"limit": 2}, headers=bearer(key)))
    assert [f["id"] for f in first["data"]] == more[::-1][:2] and first["has_more"]
    rest = ok(await world.client.get("/v1/files", params={"limit": 2, "after": first["last_id"]},
                                     headers=bearer(key)))
    assert [f["id"] for f in rest["data"]] == [more[0], created["id"]] and not rest["has_more"]
    ascending = ok(await world.client.get("/v1/files", params={"order": "asc"},
                                          headers=bearer(key)))
    assert [f["id"] for f in ascending["data"]] == [created["id"], *more]

    deleted = ok(await world.client.delete(f"/v1/files/{created['id']}", headers=bearer(key)))
    assert deleted == {"id": created["id"], "object": "file", "deleted": True}
    assert_error(await world.client.get(f"/v1/files/{created['id']}", headers=bearer(key)), 404)


async def test_uploads_are_bounded_and_for_batches_only(sqlite_url, tmp_path, mocks):
    async with batch_world(sqlite_url, tmp_path, mocks, max_file_bytes=2000) as world:
        assert_error(await world.upload([chat_line("a")], purpose="fine-tune"), 400)
        assert_error(await world.upload([chat_line("a", "x" * 3000)]), 413)
        assert_error(await world.upload([]), 400, code="empty_file")
        assert ok(await world.client.get("/v1/files", headers=bearer(world.tenant.key)))[
            "data"] == []
        r = await world.client.post("/v1/files", data={"purpose": "batch"},
                                    files={"file": ("a.jsonl", b"{}")})
        assert_error(r, 401)


async def test_a_running_batchs_input_cannot_be_deleted(sqlite_url, tmp_path, mocks):
    mocks["up"].mock.mode.delay_ms = 200
    async with batch_world(sqlite_url, tmp_path, mocks, batch_max_concurrency=1) as world:
        created = await world.batch([chat_line(f"r{i}") for i in range(5)])
        key = bearer(world.tenant.key)
        r = await world.client.delete(f"/v1/files/{created['input_file_id']}", headers=key)
        assert_error(r, 409)
        ok(await world.client.post(f"/v1/batches/{created['id']}/cancel", headers=key))
        await world.until(created["id"])
        ok(await world.client.delete(f"/v1/files/{created['input_file_id']}", headers=key))


async def test_batch_create_is_checked(world):
    key = bearer(world.tenant.key)
    file = ok(await world.upload([chat_line("a")]))

    async def create(**body: Any) -> httpx.Response:
        return await world.client.post("/v1/batches", headers=key, json={
            "input_file_id": file["id"], "endpoint": CHAT_URL, "completion_window": "24h",
            **body})

    assert_error(await create(endpoint="/v1/moderations"), 400)
    assert_error(await create(completion_window="48h"), 400)
    assert_error(await create(metadata={f"k{i}": "v" for i in range(17)}), 400)
    assert_error(await create(input_file_id="file-" + "0" * 32), 404)
    assert_error(await create(input_file_id="nonsense"), 404)
    assert_error(await create(surprise=True), 400)

    batches = [ok(await create())["id"] for _ in range(3)]
    page1 = ok(await world.client.get("/v1/batches", params={"limit": 2}, headers=key))
    assert [b["id"] for b in page1["data"]] == batches[::-1][:2] and page1["has_more"]
    page2 = ok(await world.client.get("/v1/batches", params={"after": page1["last_id"]},
                                      headers=key))
    assert [b["id"] for b in page2["data"]] == batches[:1] and not page2["has_more"]


async def test_another_tenants_files_and_batches_do_not_exist(world, sqlite_url, tmp_path):
    other = await seed_tenant(sqlite_url, tmp_path, name="other", plan={"rpm": 1000})
    batch = await world.until((await world.batch([chat_line("a")]))["id"])
    them = bearer(other.key)
    for url in (f"/v1/batches/{batch['id']}", f"/v1/files/{batch['input_file_id']}",
                f"/v1/files/{batch['output_file_id']}/content"):
        found = await world.client.get(url, headers=them)
        missing = await world.client.get(url.replace(url.split("/")[3], unknown(url)),
                                         headers=them)
        assert assert_error(found, 404)["message"] == assert_error(missing, 404)[
            "message"].replace(unknown(url), url.split("/")[3])
    assert_error(await world.client.post(f"/v1/batches/{batch['id']}/cancel", headers=them),
                 404)
    assert_error(await world.client.delete(f"/v1/files/{batch['input_file_id']}",
                                           headers=them), 404)
    r = await world.client.post("/v1/batches", headers=them, json={
        "input_file_id": batch["input_file_id"], "endpoint": CHAT_URL,
        "completion_window": "24h"})
    assert_error(r, 404)
    assert ok(await world.client.get("/v1/files", headers=them))["data"] == []
    assert ok(await world.client.get("/v1/batches", headers=them))["data"] == []
    assert_error(await world.client.get("/v1/batches", params={"after": batch["id"]},
                                        headers=them), 404)


def unknown(url: str) -> str:
    """An id of the same kind as the one in `url`, never issued."""
    return ("batch_" if "/batches/" in url else "file-") + "0" * 32

