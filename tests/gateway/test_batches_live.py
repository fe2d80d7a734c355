"""The Batch API with the official `openai` client against a live gateway on loopback, over
the real engine (a tiny random Llama): files.create(purpose="batch"), batches.create /
retrieve / list / cancel, files.content of the output, typed errors; and a gateway stopped in
the middle of a batch, whose successor over the same database and files folder finishes it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.support import Seeded, live, seed_tenant, settings
from workers.async_engine import AsyncLLMEngine

MODEL = "tiny"


def chat_line(custom_id: str, content: str, max_tokens: int = 4) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
                     "messages": [{"role": "user", "content": content}]}}


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def batch_cfg(sqlite_url: str, tmp_path: Path, **overrides: Any) -> Settings:
    return settings(sqlite_url, tmp_path, embedded={"name": MODEL},
                    batch_poll_interval_s=0.2, **overrides)


@contextmanager
def serving(cfg: Settings, tiny_llama_path: Path) -> Iterator[str]:
    engine = AsyncLLMEngine(str(tiny_llama_path), device="cpu", kv_cache_memory=32 << 20)
    with live(cfg, create_app(cfg, engine=engine)) as port:
        yield f"http://127.0.0.1:{port}/v1"


@pytest.fixture
async def served(sqlite_url, tmp_path, tiny_llama_path):
    tenant = await seed_tenant(sqlite_url, tmp_path, name="batcher", plan={"rpm": 10_000})
    with serving(batch_cfg(sqlite_url, tmp_path), tiny_llama_path) as url:
        yield url, tenant


def client(url: str, tenant: Seeded) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key=tenant.key, max_retries=0)


async def until(ai: openai.AsyncOpenAI, batch_id: str, statuses: tuple[str, ...] = (
        "completed", "failed", "cancelled", "expired"), *, done: int = 0,
                timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await ai.batches.retrieve(batch_id)
        counts = batch.request_counts
        if batch.status in statuses and counts is not None and (
                counts.completed + counts.failed >= done):
            return batch
        assert time.monotonic() < deadline, batch
        await asyncio.sleep(0.05)


async def test_the_official_client_runs_a_batch(served):
    url, tenant = served
    rows = [chat_line(f"q{i}", f"Say {i}") for i in range(4)]
    rows.append({"custom_id": "r0", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                          "stream": True}})
    async with client(url, tenant) as ai:
        file = await ai.files.create(file=("jobs.jsonl", jsonl(rows)), purpose="batch")
        assert file.purpose == "batch" and file.bytes == len(jsonl(rows))
        created = await ai.batches.create(input_file_id=file.id,
                                          endpoint="/v1/chat/completions",
                                          completion_window="24h", metadata={"run": "1"})
        assert created.status == "validating" and created.metadata == {"run": "1"}
        batch = await until(ai, created.id)
        assert batch.status == "completed" and batch.model == MODEL
        assert (batch.request_counts.total, batch.request_counts.completed,
                batch.request_counts.failed) == (5, 4, 1)
        assert batch.usage is not None and batch.usage.output_tokens == 16
        assert [b.id async for b in ai.batches.list(limit=10)] == [created.id]

        output = (await ai.files.content(batch.output_file_id)).text.splitlines()
        answers = {o["custom_id"]: o for o in map(json.loads, output)}
        assert set(answers) == {"q0", "q1", "q2", "q3"}
        body = answers["q1"]["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["usage"]["completion_tokens"] == 4
        assert body["choices"][0]["finish_reason"] == "length"
        # the same request live gets the same (greedy) answer
        again = await ai.chat.completions.create(**chat_line("x", "Say 1")["body"])
        assert again.choices[0].message.content == body["choices"][0]["message"]["content"]

        error = json.loads((await ai.files.content(batch.error_file_id)).text)
        assert error["custom_id"] == "r0" and error["response"]["status_code"] == 400
        assert error["response"]["body"]["error"]["param"] == "stream"

        listed = [f.id async for f in ai.files.list()]
        assert set(listed) == {file.id, batch.output_file_id, batch.error_file_id}
        assert (await ai.files.retrieve(batch.output_file_id)).purpose == "batch_output"
        assert (await ai.files.delete(file.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await ai.files.retrieve(file.id)


async def test_a_responses_batch_and_an_embeddings_endpoint_refused_here(served):
    url, tenant = served
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
             "body": {"model": MODEL, "input": f"Hello {i}", "max_output_tokens": 3,
                      "temperature": 0}} for i in range(2)]
    async with client(url, tenant) as ai:
        file = await ai.files.create(file=("r.jsonl", jsonl(rows)), purpose="batch")
        batch = await until(ai, (await ai.batches.create(
            input_file_id=file.id, endpoint="/v1/responses", completion_window="24h")).id)
        assert batch.status == "completed" and batch.request_counts.completed == 2
        lines = [json.loads(x) for x in (await ai.files.content(batch.output_file_id))
                 .text.splitlines()]
        body = lines[0]["response"]["body"]
        assert body["object"] == "response" and body["usage"]["output_tokens"] == 3
        # stored like a live response of the tenant's
        assert (await ai.responses.retrieve(body["id"])).id == body["id"]

        # no embedding model is served here: each line is the live request's 404/400
        emb = [{"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
                "body": {"model": MODEL, "input": "x"}}]
        file = await ai.files.create(file=("e.jsonl", jsonl(emb)), purpose="batch")
        batch = await until(ai, (await ai.batches.create(
            input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h")).id)
        assert batch.request_counts.failed == 1 and batch.output_file_id is None
        error = json.loads((await ai.files.content(batch.error_file_id)).text)
        assert error["response"]["status_code"] in (400, 404)


async def test_cancel_and_typed_errors(sqlite_url, tmp_path, tiny_llama_path):
    tenant = await seed_tenant(sqlite_url, tmp_path, name="batcher", plan={"rpm": 10_000})
    cfg = batch_cfg(sqlite_url, tmp_path, batch_max_concurrency=1)
    with serving(cfg, tiny_llama_path) as url:
        async with client(url, tenant) as ai:
            rows = [chat_line(f"q{i}", f"Count {i}", max_tokens=16) for i in range(30)]
            file = await ai.files.create(file=("c.jsonl", jsonl(rows)), purpose="batch")
            created = await ai.batches.create(input_file_id=file.id,
                                              endpoint="/v1/chat/completions",
                                              completion_window="24h")
            await until(ai, created.id, ("in_progress",), done=1)
            with pytest.raises(openai.ConflictError):
                await ai.files.delete(file.id)  # a running batch reads it
            cancelling = await ai.batches.cancel(created.id)
            assert cancelling.status in ("cancelling", "cancelled")
            batch = await until(ai, created.id)
            assert batch.status == "cancelled" and batch.cancelled_at
            assert 1 <= batch.request_counts.completed < 30
            with pytest.raises(openai.ConflictError):
                done = await until(ai, (await ai.batches.create(
                    input_file_id=(await ai.files.create(
                        file=("d.jsonl", jsonl(rows[:1])), purpose="batch")).id,
                    endpoint="/v1/chat/completions", completion_window="24h")).id)
                await ai.batches.cancel(done.id)
            with pytest.raises(openai.NotFoundError):
                await ai.batches.retrieve("batch_" + "0" * 32)
            with pytest.raises(openai.BadRequestError):
                await ai.batches.create(input_file_id=file.id, endpoint="/v1/moderations",
                                        completion_window="24h")
            with pytest.raises(openai.BadRequestError):
                await ai.files.create(file=("f.jsonl", b"{}\n"), purpose="fine-tune")


async def test_a_gateway_restarted_mid_batch_finishes_it(sqlite_url, tmp_path,
                                                         tiny_llama_path):
    """The first gateway stops with the batch under way; a second one, with a new engine,
    over the same database and files folder, answers the rest: every line once."""
    tenant = await seed_tenant(sqlite_url, tmp_path, name="batcher", plan={"rpm": 10_000})
    cfg = batch_cfg(sqlite_url, tmp_path, batch_max_concurrency=1)
    rows = [chat_line(f"q{i}", f"Tell {i}") for i in range(10)]
    with serving(cfg, tiny_llama_path) as url:
        async with client(url, tenant) as ai:
            file = await ai.files.create(file=("big.jsonl", jsonl(rows)), purpose="batch")
            created = await ai.batches.create(input_file_id=file.id,
                                              endpoint="/v1/chat/completions",
                                              completion_window="24h")
            half = await until(ai, created.id, ("in_progress",), done=2)
    assert half.request_counts.completed < 10
    with serving(cfg, tiny_llama_path) as url:
        async with client(url, tenant) as ai:
            batch = await until(ai, created.id)
            assert batch.status == "completed"
            assert (batch.request_counts.completed, batch.request_counts.failed) == (10, 0)
            output = [json.loads(x) for x in (await ai.files.content(batch.output_file_id))
                      .text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == sorted(r["custom_id"] for r in rows)
