"""The official `openai` client's `embeddings.create` against a live gateway on loopback:
`python -m gateway.cli serve` with the bundled all-MiniLM-L6-v2, an OpenAI-compatible upstream
and a litellm provider (both `bench.common.mock_upstream` on loopback) as embedding deployments; the
embedding model's defaults as served (the work bound, the forwards' size)."""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.dbutil import migrated_database
from tests.e2e.support import Gateway, gateway_env
from tests.gateway.support import (
    MockUpstream,
    Seeded,
    admin_key,
    seed_tenant,
    write_deployments,
)

MINILM = "all-minilm-l6-v2"
UPSTREAM_KEY = "sk-live-embed-upstream"


@dataclass
class Live:
    base: str
    upstream: MockUpstream
    alpha: Seeded
    beta: Seeded
    tight: Seeded  # a plan of 300 tokens a minute
    gamma: Seeded

    def client(self, tenant: Seeded) -> openai.OpenAI:
        return openai.OpenAI(api_key=tenant.key, base_url=f"{self.base}/v1", max_retries=0,
                             timeout=60)

    def queued_rows(self) -> float:
        """Inputs waiting for the bundled model's forwards (GET /health)."""
        health = httpx.get(f"{self.base}/health", timeout=10).json()
        return health["deployments"]["embedded-embedding"]["queued_rows"]

    def records(self, tenant: Seeded, **params: Any) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.base}/v1/usage/records", params=params,
                             headers={"authorization": f"Bearer {tenant.key}"}, timeout=10)
        assert response.status_code == 200, response.text
        return response.json()["data"]


async def _seed(tmp: Path) -> tuple[str, list[Seeded]]:
    async with migrated_database("sqlite", tmp) as url:
        await admin_key(url, tmp)
        tenants = [await seed_tenant(url, tmp, name="alpha"),
                   await seed_tenant(url, tmp, name="beta"),
                   await seed_tenant(url, tmp, name="tight", plan={"tpm": 300}),
                   await seed_tenant(url, tmp, name="gamma")]
        return url, tenants


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("embeddings-live")
    upstream = MockUpstream().start()
    gateway: Gateway | None = None
    try:
        db_url, (alpha, beta, tight, gamma) = asyncio.run(_seed(tmp))
        deployments = write_deployments(tmp, [
            {"name": "http-emb", "model_name": "remote-embed", "provider": "openai",
             "mode": "embedding", "base_url": upstream.base_url, "api_key": UPSTREAM_KEY,
             "upstream_model": "text-embedding-mock", "input_price_per_1m": "0.02"},
            {"name": "litellm-emb", "model_name": "litellm-embed", "provider": "litellm",
             "mode": "embedding", "base_url": upstream.base_url, "api_key": UPSTREAM_KEY,
             "upstream_model": "openai/text-embedding-3-small", "input_price_per_1m": "0.02"},
        ])
        env = gateway_env(db_url, tmp, embedding_model="default", usage_flush_interval_s=0.1,
                          deployments_file=deployments)
        env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
        gateway = Gateway(env, tmp / "gateway.log").start(timeout_s=120)
        yield Live(gateway.url, upstream, alpha, beta, tight, gamma)
    finally:
        if gateway is not None:
            gateway.stop()
        upstream.stop()


def test_string_and_list_input(live: Live) -> None:
    client = live.client(live.alpha)
    one = client.embeddings.create(model=MINILM, input="The quick brown fox.")
    assert one.object == "list" and one.model == MINILM and len(one.data) == 1
    vector = np.asarray(one.data[0].embedding)
    assert vector.shape == (384,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    assert one.usage.prompt_tokens == one.usage.total_tokens == 7  # [CLS] 5 pieces [SEP]
    many = client.embeddings.create(model=MINILM, input=["The quick brown fox.", "Rain."])
    assert [d.index for d in many.data] == [0, 1]
    assert np.abs(np.asarray(many.data[0].embedding) - vector).max() < 1e-5


def test_base64_decodes_to_the_floats(live: Live) -> None:
    client = live.client(live.alpha)
    texts = ["one text", "and another, longer, text"]
    floats = client.embeddings.create(model=MINILM, input=texts, encoding_format="float")
    packed = client.embeddings.create(model=MINILM, input=texts, encoding_format="base64")
    default = client.embeddings.create(model=MINILM, input=texts)  # base64, decoded by the client
    for f, p, d in zip(floats.data, packed.data, default.data, strict=True):
        assert isinstance(p.embedding, str)
        decoded = np.frombuffer(base64.b64decode(p.embedding), dtype="<f4")
        assert np.array_equal(decoded, np.asarray(f.embedding, dtype=np.float32))
        assert np.array_equal(np.asarray(d.embedding, dtype=np.float32), decoded)


def test_dimensions_and_unknown_fields_are_refused(live: Live) -> None:
    client = live.client(live.alpha)
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MINILM, input="x", dimensions=64)
    assert caught.value.param == "dimensions" and caught.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MINILM, input="x", extra_body={"truncate": "END"})
    assert caught.value.param == "truncate" and caught.value.code == "unknown_parameter"
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MINILM, input="")
    assert caught.value.param == "input"


def test_models_lists_the_embedding_models(live: Live) -> None:
    names = [m.id for m in live.client(live.alpha).models.list()]
    assert {MINILM, "remote-embed", "litellm-embed"} <= set(names)


def test_upstream_receives_the_request_intact(live: Live) -> None:
    response = live.client(live.alpha).embeddings.create(
        model="remote-embed", input=["alpha", "beta"], dimensions=4, encoding_format="float",
        user="end-user-1")
    sent = live.upstream.last_request()
    assert sent["path"] == "/v1/embeddings"
    assert sent["body"] == {"model": "text-embedding-mock", "input": ["alpha", "beta"],
                            "dimensions": 4, "encoding_format": "float", "user": "end-user-1"}
    assert sent["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert live.alpha.key not in str(sent)
    assert response.model == "remote-embed" and len(response.data[1].embedding) == 4


def test_litellm_deployment(live: Live) -> None:
    response = live.client(live.alpha).embeddings.create(model="litellm-embed",
                                                         input="gamma", dimensions=4)
    sent = live.upstream.last_request()
    assert sent["body"]["model"] == "text-embedding-3-small"
    assert sent["body"]["input"] == ["gamma"] and sent["body"]["dimensions"] == 4
    assert sent["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert live.alpha.key not in str(sent)
    direct = live.client(live.alpha).embeddings.create(model="remote-embed", input="gamma",
                                                       dimensions=4)
    assert np.allclose(response.data[0].embedding, direct.data[0].embedding)


def test_usage_is_metered_and_private(live: Live) -> None:
    response = live.client(live.alpha).embeddings.create(model=MINILM, input="count me")
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = [r for r in live.records(live.alpha, model=MINILM)
                if r["prompt_tokens"] == response.usage.prompt_tokens]
        if rows:
            break
        time.sleep(0.1)
    assert rows and rows[0]["completion_tokens"] == 0 and rows[0]["status"] == "ok"
    assert rows[0]["cost_micros"] > 0
    assert live.records(live.beta) == []


def test_tpm_is_enforced(live: Live) -> None:
    client = live.client(live.tight)
    text = "word " * 100  # 102 tokens; the plan allows 300 a minute
    with pytest.raises(openai.RateLimitError) as caught:
        for _ in range(5):
            client.embeddings.create(model=MINILM, input=text)
    assert caught.value.code == "rate_limit_exceeded"
    assert caught.value.response.headers["retry-after"]


def test_a_client_that_leaves_aborts_the_request(live: Live) -> None:
    mode = f"http://127.0.0.1:{live.upstream.port}/_mode"
    httpx.post(mode, json={"delay_ms": 4000}).raise_for_status()
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.base}/v1/embeddings",
                       json={"model": "remote-embed", "input": "too slow"},
                       headers={"authorization": f"Bearer {live.beta.key}"},
                       timeout=httpx.Timeout(5, read=0.5))
        left = time.monotonic()
        rows: list[dict[str, Any]] = []
        while time.monotonic() - left < 3 and not rows:
            rows = live.records(live.beta, status="aborted")
            time.sleep(0.05)
        assert [(r["model"], r["prompt_tokens"]) for r in rows] == [("remote-embed", 0)]
    finally:
        httpx.post(f"http://127.0.0.1:{live.upstream.port}/_reset").raise_for_status()


def token_ids(rows: int) -> list[list[int]]:
    """`rows` inputs of 254 token ids: 256 tokens each with [CLS] and [SEP], the window."""
    return [[1000 + (i * 31 + j) % 28000 for j in range(254)] for i in range(rows)]


def test_the_largest_request_is_refused_at_once(live: Live) -> None:
    """2048 inputs of the whole window: more than the default bound, refused before any
    work (it used to run 30-60 s into a 504 billed nothing)."""
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as caught:
        live.client(live.alpha).embeddings.create(model=MINILM, input=token_ids(2048))
    assert time.monotonic() - started < 10  # the body is 3 MB of ids; no forward ran
    assert (caught.value.code, caught.value.param) == ("embedding_work_exceeded", "input")
    assert "524288 tokens" in caught.value.message and "131072" in caught.value.message


def test_a_client_that_gives_up_pays_for_the_work_done(live: Live) -> None:
    client = openai.OpenAI(api_key=live.gamma.key, base_url=f"{live.base}/v1",
                           max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        client.embeddings.create(model=MINILM, input=token_ids(128))  # ~4 s on 2 cores
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not rows:
        rows = live.records(live.gamma, model=MINILM, status="aborted")
        time.sleep(0.1)
    assert len(rows) == 1, rows
    tokens = rows[0]["prompt_tokens"]
    assert 0 < tokens < 128 * 256 and tokens % 256 == 0  # whole inputs, not all of them
    assert rows[0]["cost_micros"] > 0


def test_another_tenant_is_answered_while_a_large_request_runs(live: Live) -> None:
    large: dict[str, Any] = {}

    def run_large() -> None:
        started = time.monotonic()
        response = live.client(live.alpha).embeddings.create(model=MINILM,
                                                             input=token_ids(96))
        large["took"], large["rows"] = time.monotonic() - started, len(response.data)

    thread = threading.Thread(target=run_large)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        before = 0.0
        while before == 0 and time.monotonic() < deadline:
            before = live.queued_rows()  # until the large request is queued, 16 inputs a forward
            time.sleep(0.02)
        one = live.client(live.gamma).embeddings.create(model=MINILM, input="just one")
        after = live.queued_rows()
        still_running = thread.is_alive()
    finally:
        thread.join(60)
    assert len(one.data) == 1 and large["rows"] == 96
    assert still_running, large  # it ran beside the large one, not after it
    # Counted in forwards, not seconds (a shared CPU runs every forward slower): the small
    # request waits for the forward in flight and its own (about 31 rows here), and one or
    # two more may start before /health answers; first come first served would have waited
    # for every queued input (80 or more).
    assert before - after <= 4 * 16, (before, after)
