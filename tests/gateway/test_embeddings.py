"""POST /v1/embeddings in-process: the bundled all-MiniLM-L6-v2, an OpenAI-compatible upstream
and a litellm provider (both the mock upstream on loopback), on SQLite.

What is checked: OpenAI's shapes (string, list, token ids; float and base64), the refusals
(`dimensions`, unknown fields, empty or too many inputs, over-long inputs, chat models and
embedding models on each other's endpoints), that the upstream receives the request intact
with its own key and never the caller's, fallbacks, metering at the input price, TPM, and
that usage, exports and invoices show the rows to their tenant only.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before anything imports litellm

import asyncio
import base64
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.gateway.support import (
    GatewayWorld,
    admin_key,
    assert_error,
    bearer,
    ok,
    seed_tenant,
    serve_world,
)
from workers.telemetry import make_tracer_provider

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:litellm"),
              pytest.mark.filterwarnings("ignore:.*ReadOnly:UserWarning")]

MOCKS = ("up", "down")
MINILM = "all-minilm-l6-v2"
UPSTREAM_KEY = "sk-embed-upstream-secret"


@dataclass
class EmbedWorld(GatewayWorld):
    admin: str = ""

    async def embed(self, key: str | None = None, **body: Any) -> Any:
        return await self.client.post("/v1/embeddings", json={"model": MINILM, **body},
                                      headers=bearer(key or self.tenant.key))

    async def records(self) -> list[dict[str, Any]]:
        """The usage ledger as the admin API lists it, once the meter has written."""
        await self.app.state.gateway.meter.flush()
        return ok(await self.client.get("/admin/usage", params={"order": "asc"},
                                        headers=bearer(self.admin)))["data"]


def http_embedding(mock: Any, name: str = "http-emb", **more: Any) -> dict[str, Any]:
    return {"name": name, "model_name": "remote-embed", "provider": "openai",
            "mode": "embedding", "base_url": mock.base_url, "api_key": UPSTREAM_KEY,
            "upstream_model": "text-embedding-mock", "input_price_per_1m": "0.02", **more}


def litellm_embedding(mock: Any) -> dict[str, Any]:
    return {"name": "litellm-emb", "model_name": "litellm-embed", "provider": "litellm",
            "mode": "embedding", "base_url": mock.base_url, "api_key": UPSTREAM_KEY,
            # litellm forwards `dimensions` to OpenAI's text-embedding-3 models only
            "upstream_model": "openai/text-embedding-3-small", "input_price_per_1m": "0.02"}


def chat_deployment(mock: Any) -> dict[str, Any]:
    return {"name": "chat", "model_name": "chat", "provider": "openai",
            "base_url": mock.base_url, "upstream_model": "up-chat"}


@pytest.fixture
async def world(sqlite_url: str, tmp_path: Path, mocks: dict[str, Any]
                ) -> AsyncIterator[EmbedWorld]:
    admin = await admin_key(sqlite_url, tmp_path)
    deployments = [http_embedding(mocks["up"]), litellm_embedding(mocks["up"]),
                   chat_deployment(mocks["up"])]
    async with serve_world(EmbedWorld, sqlite_url, tmp_path, mocks, deployments,
                           plan={"tpm": 2000}, fields={"admin": admin},
                           embedding_model="default") as w:
        yield w


def vectors(body: dict[str, Any]) -> list[np.ndarray]:
    out = []
    for i, item in enumerate(body["data"]):
        assert item["object"] == "embedding" and item["index"] == i
        value = item["embedding"]
        if isinstance(value, str):
            out.append(np.frombuffer(base64.b64decode(value), dtype="<f4"))
        else:
            out.append(np.asarray(value, dtype=np.float32))
    return out


async def test_string_and_list_input_in_openai_shape(world: EmbedWorld) -> None:
    one = ok(await world.embed(input="The cat sat on the mat."))
    assert one["object"] == "list" and one["model"] == MINILM
    (vector,) = vectors(one)
    assert vector.shape == (384,) and abs(float(np.linalg.norm(vector)) - 1) < 1e-5
    encoder = world.app.state.gateway.deployments.get("embedded-embedding").encoder
    tokens = len(encoder.tokenize(["The cat sat on the mat."])[0])
    assert one["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}

    many = ok(await world.embed(input=["The cat sat on the mat.", "Stocks fell sharply."]))
    first, second = vectors(many)
    assert np.abs(first - vector).max() < 1e-5
    assert float(first @ second) < 0.5  # different texts, different directions
    assert many["usage"]["prompt_tokens"] > tokens


async def test_base64_decodes_to_the_floats(world: EmbedWorld) -> None:
    texts = ["hello world", "a longer sentence about embeddings and gateways"]
    floats = vectors(ok(await world.embed(input=texts, encoding_format="float")))
    packed = ok(await world.embed(input=texts, encoding_format="base64"))
    assert all(isinstance(item["embedding"], str) for item in packed["data"])
    for a, b in zip(floats, vectors(packed), strict=True):
        assert np.array_equal(a, b)


async def test_token_ids_embed_as_their_text(world: EmbedWorld) -> None:
    encoder = world.app.state.gateway.deployments.get("embedded-embedding").encoder
    ids = encoder.tokenize(["token ids work"])[0][1:-1]  # without [CLS] and [SEP]
    by_text = vectors(ok(await world.embed(input="token ids work")))[0]
    by_ids = ok(await world.embed(input=ids))
    assert np.abs(vectors(by_ids)[0] - by_text).max() < 1e-5
    both = vectors(ok(await world.embed(input=[ids, ids[:1]])))
    assert np.abs(both[0] - by_text).max() < 1e-5
    assert_error(await world.embed(input=[10**6]), 400, code="invalid_value")


async def test_refusals_name_the_field(world: EmbedWorld) -> None:
    error = assert_error(await world.embed(input="x", dimensions=128), 400,
                         code="unsupported_parameter")
    assert error["param"] == "dimensions"
    ok(await world.embed(input="x", dimensions=384))  # its native size is no change
    error = assert_error(await world.embed(input="x", temperature=0.5), 400,
                         code="unknown_parameter")
    assert error["param"] == "temperature" and "temperature" in error["message"]
    assert assert_error(await world.embed(input=""), 400)["param"] == "input"
    assert assert_error(await world.embed(input=["a", ""]), 400)["param"] == "input"
    assert assert_error(await world.embed(input=[]), 400)["param"] == "input"
    assert assert_error(await world.embed(input=["a"] * 2049), 400)["param"] == "input"
    assert_error(await world.embed(input="x", encoding_format="int8"), 400)
    assert_error(await world.embed(input=[True]), 400)
    error = assert_error(await world.embed(input="word " * 400), 400,
                         code="context_length_exceeded")
    assert error["param"] == "input" and "256" in error["message"]
    assert_error(await world.embed(model="nope", input="x"), 404, code="model_not_found")


async def test_chat_and_embedding_models_keep_to_their_endpoints(world: EmbedWorld) -> None:
    error = assert_error(await world.chat("hi", model=MINILM), 400, code="model_not_supported")
    assert "/v1/embeddings" in error["message"]
    error = assert_error(await world.embed(model="chat", input="hi"), 400,
                         code="model_not_supported")
    assert "does not serve embeddings" in error["message"]
    ok(await world.chat("hi", model="chat", max_tokens=8))
    ok(await world.chat("hi", model="auto", max_tokens=8))  # `auto` is chat deployments only
    assert world.mocks["up"].mock.stats.by_path.get("/v1/embeddings") is None


async def test_models_lists_the_embedding_models(world: EmbedWorld) -> None:
    models = ok(await world.client.get("/v1/models", headers=bearer(world.tenant.key)))
    names = [m["id"] for m in models["data"]]
    assert {MINILM, "remote-embed", "litellm-embed", "chat"} <= set(names)
    ok(await world.client.get(f"/v1/models/{MINILM}", headers=bearer(world.tenant.key)))


async def test_http_upstream_gets_the_request_intact(world: EmbedWorld) -> None:
    mock = world.mocks["up"].mock
    body = ok(await world.embed(model="remote-embed", input=["alpha", "beta"], dimensions=4,
                                encoding_format="base64", user="user-7"))
    sent = mock.last_request
    assert sent["path"] == "/v1/embeddings"
    assert sent["body"] == {"model": "text-embedding-mock", "input": ["alpha", "beta"],
                            "dimensions": 4, "encoding_format": "base64", "user": "user-7"}
    assert sent["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert world.tenant.key not in str(sent)
    assert body["model"] == "remote-embed" and [v.shape for v in vectors(body)] == [(4,), (4,)]
    floats = ok(await world.embed(model="remote-embed", input=["alpha", "beta"], dimensions=4))
    assert all(np.array_equal(a, b) for a, b in zip(vectors(body), vectors(floats),
                                                     strict=True))
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}  # the upstream's count


async def test_litellm_deployment_reaches_the_upstream(world: EmbedWorld) -> None:
    mock = world.mocks["up"].mock
    body = ok(await world.embed(model="litellm-embed", input=["alpha", "beta"], dimensions=4,
                                user="user-7"))
    sent = mock.last_request
    assert sent["path"] == "/v1/embeddings"
    assert sent["body"]["model"] == "text-embedding-3-small"
    assert sent["body"]["input"] == ["alpha", "beta"] and sent["body"]["dimensions"] == 4
    assert sent["body"]["user"] == "user-7"
    assert sent["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert world.tenant.key not in str(sent)
    direct = ok(await world.embed(model="remote-embed", input=["alpha", "beta"], dimensions=4))
    assert body["model"] == "litellm-embed"
    assert all(np.allclose(a, b) for a, b in zip(vectors(body), vectors(direct), strict=True))
    packed = ok(await world.embed(model="litellm-embed", input="alpha", dimensions=4,
                                  encoding_format="base64"))
    assert isinstance(packed["data"][0]["embedding"], str)
    assert np.allclose(vectors(packed)[0], vectors(direct)[0])


async def test_usage_is_metered_at_the_input_price(world: EmbedWorld) -> None:
    body = ok(await world.embed(input=["metered text", "and more"]))
    tokens = body["usage"]["prompt_tokens"]
    ok(await world.embed(model="remote-embed", input="priced upstream"))
    local, remote = await world.records()
    assert (local["model"], local["deployment"], local["status"]) == (
        MINILM, "embedded-embedding", "ok")
    assert (local["prompt_tokens"], local["completion_tokens"]) == (tokens, 0)
    # 0.01 USD per 1M tokens = 0.01 micro-USD a token, rounded up
    assert local["cost_micros"] == local["input_cost_micros"] == -(-tokens // 100)
    assert local["output_cost_micros"] == 0 and local["price_id"]
    assert (remote["model"], remote["deployment"], remote["prompt_tokens"]) == (
        "remote-embed", "http-emb", 4)


async def test_tpm_is_enforced(world: EmbedWorld) -> None:
    text = "word " * 200  # about 200 tokens each; the plan allows 2000 a minute
    statuses = []
    for _ in range(12):
        statuses.append((await world.embed(input=[text])).status_code)
    assert 200 in statuses and statuses[-1] == 429
    refused = await world.embed(input=[text])
    error = assert_error(refused, 429, code="rate_limit_exceeded")
    assert "tokens per minute" in error["message"] and refused.headers["retry-after"]


async def test_other_tenants_never_see_the_usage(world: EmbedWorld, sqlite_url: str,
                                                 tmp_path: Path) -> None:
    ok(await world.embed(input="private text"))
    other = await seed_tenant(sqlite_url, tmp_path, name="other")
    await world.app.state.gateway.meter.flush()
    mine = ok(await world.client.get("/v1/usage/records", headers=bearer(world.tenant.key)))
    assert [r["model"] for r in mine["data"]] == [MINILM]
    theirs = ok(await world.client.get("/v1/usage/records", headers=bearer(other.key)))
    assert theirs["data"] == []
    summary = ok(await world.client.get("/v1/usage", headers=bearer(other.key)))
    assert summary["models"] == []
    export = await world.client.get("/admin/usage/export", headers=bearer(world.admin),
                                    params={"format": "jsonl"})
    assert export.status_code == 200 and MINILM in export.text
    period = datetime.now(UTC).strftime("%Y-%m")
    invoice = ok(await world.client.get(
        f"/admin/tenants/{world.tenant.tenant_id}/invoices/{period}",
        headers=bearer(world.admin)))
    assert MINILM in str(invoice)
    invoice = ok(await world.client.get(f"/admin/tenants/{other.tenant_id}/invoices/{period}",
                                        headers=bearer(world.admin)))
    assert MINILM not in str(invoice)


async def test_key_scopes_apply(world: EmbedWorld, sqlite_url: str, tmp_path: Path) -> None:
    scoped = await seed_tenant(sqlite_url, tmp_path, name="scoped",
                               plan={"allowed_models": ["chat"]})
    assert_error(await world.embed(key=scoped.key, input="x"), 403, code="model_not_allowed")
    assert_error(await world.client.post("/v1/embeddings", json={"model": MINILM, "input": "x"}),
                 401)


async def test_fallback_to_the_next_upstream(sqlite_url: str, tmp_path: Path,
                                             mocks: dict[str, Any]) -> None:
    from bench.common.mock_upstream import MockMode

    mocks["down"].mock.mode = MockMode(status=500)
    deployments = [http_embedding(mocks["down"], "first", input_price_per_1m="0.01"),
                   http_embedding(mocks["up"], "second", input_price_per_1m="0.03")]
    async with serve_world(EmbedWorld, sqlite_url, tmp_path, mocks, deployments) as w:
        response = await w.embed(model="remote-embed", input="falls back")
        ok(response)
        assert response.headers["x-switchboard-deployment"] == "second"
        assert response.headers["x-switchboard-attempts"] == "2"
        assert mocks["down"].mock.stats.failures == 1
        mocks["up"].mock.mode = MockMode(status=503)
        assert_error(await w.embed(model="remote-embed", input="x"), 502)


async def test_off_by_setting(sqlite_url: str, tmp_path: Path, mocks: dict[str, Any]) -> None:
    async with serve_world(EmbedWorld, sqlite_url, tmp_path, mocks,
                           [chat_deployment(mocks["up"])], embedding_model="none") as w:
        assert_error(await w.embed(input="x"), 404, code="model_not_found")


async def test_concurrent_requests_share_forwards(world: EmbedWorld) -> None:
    deployment = world.app.state.gateway.deployments.get("embedded-embedding")
    alone = vectors(ok(await world.embed(input="the same text")))[0]
    before = deployment.batcher.forwards
    texts = [f"request number {i} with some words" for i in range(16)]
    answers = await asyncio.gather(*(world.embed(input=[t, "the same text"]) for t in texts))
    assert deployment.batcher.forwards - before < len(texts)
    for response in answers:
        assert np.abs(vectors(ok(response))[1] - alone).max() < 1e-5


async def test_admin_api_lists_and_adds_embedding_deployments(world: EmbedWorld) -> None:
    admin = bearer(world.admin)
    listed = ok(await world.client.get("/admin/deployments/embedded-embedding", headers=admin))
    assert listed["mode"] == "embedding" and "queued_rows" in listed["load"]
    added = http_embedding(world.mocks["up"], "added-emb", model_name="added-embed")
    ok(await world.client.post("/admin/deployments", json=added, headers=admin), 201)
    body = ok(await world.embed(model="added-embed", input="added at runtime"))
    assert body["model"] == "added-embed" and len(body["data"]) == 1
    health = ok(await world.client.get("/health"))
    assert "embedded-embedding" in str(health)


async def test_budget_is_enforced(sqlite_url: str, tmp_path: Path,
                                  mocks: dict[str, Any]) -> None:
    pricey = http_embedding(mocks["up"], "pricey", input_price_per_1m="100")  # 100 µ$ a token
    async with serve_world(EmbedWorld, sqlite_url, tmp_path, mocks, [pricey],
                           plan={"budget_micros": 1000}) as w:
        statuses = [(await w.embed(model="remote-embed", input="abcd")).status_code
                    for _ in range(15)]
        assert statuses[0] == 200 and statuses[-1] == 429
        refused = await w.embed(model="remote-embed", input="abcd")
        assert_error(refused, 429, code="insufficient_quota")


async def test_refused_requests_count_for_rpm_and_a_held_key_is_not_read(
        world: EmbedWorld, sqlite_url: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a 2-RPM plan: a 400 uses one request, a 200 the other; the next 400 is a 429,
    and within the hold even a valid body is refused without being parsed."""
    from gateway import request_path

    limited = await seed_tenant(sqlite_url, tmp_path, name="limited", plan={"rpm": 2})
    parsed: list[bytes] = []
    real = request_path.parse_body

    def counted(raw: bytes, *, surface: Any) -> Any:
        parsed.append(raw)
        return real(raw, surface=surface)

    monkeypatch.setattr(request_path, "parse_body", counted)
    assert_error(await world.embed(limited.key, input=[]), 400)
    ok(await world.embed(limited.key, input=["hi"]))
    assert_error(await world.embed(limited.key, input=[]), 429, code="rate_limit_exceeded")
    assert len(parsed) == 3
    assert_error(await world.embed(limited.key, input=["hi"]), 429, code="rate_limit_exceeded")
    assert len(parsed) == 3  # held: not parsed
    ok(await world.embed(input=["hi"]))  # another tenant is not held


async def test_each_stage_is_entered_once(sqlite_url: str, tmp_path: Path,
                                          mocks: dict[str, Any]) -> None:
    """The one request path, walked as a completion walks it, less the response cache: the
    model in this process is admitted on an estimate, then on its exact count (a `prepare`
    and a `limits` each); an upstream, which does not tokenize here, once."""
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider(service_name="test-gateway", exporter="none",
                                    span_processors=[SimpleSpanProcessor(exporter)])
    assert provider is not None
    try:
        async with serve_world(EmbedWorld, sqlite_url, tmp_path, mocks,
                               [http_embedding(mocks["up"])], embedding_model="default",
                               app_kwargs={"tracer_provider": provider}) as w:
            for model, steps in (
                    (MINILM, ["auth", "route", "prepare", "limits", "prepare", "limits"]),
                    ("remote-embed", ["auth", "route", "prepare", "limits"])):
                exporter.clear()
                response = await w.embed(model=model, input="one walk")
                ok(response)
                assert "x-cache" not in response.headers
                spans = exporter.get_finished_spans()
                [server] = [s for s in spans if s.kind == SpanKind.SERVER]
                walked = [s.name for s in spans if s.parent is not None
                          and s.parent.span_id == server.context.span_id]
                assert walked == [*steps, "dispatch"]
                assert server.attributes["switchboard.status"] == "ok"
                assert server.attributes["gen_ai.usage.output_tokens"] == 0
    finally:
        provider.shutdown()
