"""GET /metrics: exact counters after real requests through the gateway (an answer, a
fallback, a rate-limit refusal, a response-cache hit), bounded labels, breaker gauges read at
scrape time, the optional scrape token, and nothing secret or private in the output."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.common.mock_upstream import MockMode, MockServerThread
from gateway.deployments.registry import DeploymentRegistry
from gateway.observability.metrics import OTHER, GatewayMetrics
from tests.gateway.support import CHAT_MODEL as MODEL
from tests.gateway.support import GatewayWorld, bearer, ok, priced_deployment, serve_world

MOCKS = ("a", "b")
PROMPT = "What is the capital of Atlantis?"
METRICS_TOKEN = "scrape-token-for-tests"

Samples = dict[tuple[tuple[str, str], ...], float]


def samples(text: str, name: str) -> Samples:
    """The values of one sample name, keyed by their sorted labels."""
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def labels(**values: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(values.items()))


class World(GatewayWorld):
    async def metrics(self, headers: dict[str, str] | None = None) -> str:
        r = await self.client.get("/metrics", headers=headers or {})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain")
        return r.text


@asynccontextmanager
async def make_world(sqlite_url: str, tmp_path, mocks: dict[str, MockServerThread],
                     **overrides: Any) -> AsyncIterator[World]:
    deployments = [priced_deployment("a", mocks["a"], "1"),
                   priced_deployment("b", mocks["b"], "2")]
    async with serve_world(World, sqlite_url, tmp_path, mocks, deployments, plan={"rpm": 3},
                           breaker_failure_threshold=2, breaker_window_s=30,
                           breaker_cooldown_s=30, **overrides) as w:
        yield w


@pytest.fixture
async def world(sqlite_url, tmp_path, mocks: dict[str, MockServerThread]
                ) -> AsyncIterator[World]:
    async with make_world(sqlite_url, tmp_path, mocks) as w:
        yield w


def usage_of(*responses: dict[str, Any]) -> tuple[int, int]:
    return (sum(r["usage"]["prompt_tokens"] for r in responses),
            sum(r["usage"]["completion_tokens"] for r in responses))


async def test_counters_after_answers_a_fallback_a_refusal_and_a_cache_hit(world):
    first = ok(await world.chat(PROMPT, temperature=0))  # a answers; exact cache miss
    await world.settled()
    r = await world.chat(PROMPT, temperature=0)
    assert r.headers["x-cache-kind"] == "exact"
    hit = ok(r)
    world.mocks["a"].mock.mode = MockMode(status=500)
    r = await world.chat("hello")  # a fails, b answers
    assert r.headers["x-switchboard-deployment"] == "b"
    fallback = ok(r)
    refused = await world.chat("one too many")  # the plan allows 3 a minute
    assert refused.status_code == 429
    text = await world.metrics()

    t = world.tenant.tenant_id
    assert samples(text, "switchboard_requests_total") == {
        labels(tenant=t, model=MODEL, status="ok", cache="none"): 2,
        labels(tenant=t, model=MODEL, status="ok", cache="exact"): 1,
        labels(tenant=t, model=MODEL, status="refused", cache="none"): 1,
    }
    assert samples(text, "switchboard_ratelimit_rejections_total") == {labels(reason="rpm"): 1}
    assert samples(text, "switchboard_cache_lookups_total") == {
        labels(kind="exact", result="miss"): 1, labels(kind="exact", result="hit"): 1}
    assert samples(text, "switchboard_upstream_attempts_total") == {
        labels(deployment="a"): 2, labels(deployment="b"): 1}
    assert samples(text, "switchboard_upstream_errors_total") == {
        labels(deployment="a", code="upstream_error"): 1}
    prompt, completion = usage_of(first, hit, fallback)
    tokens = samples(text, "switchboard_tokens_total")
    assert tokens[labels(tenant=t, model=MODEL, kind="prompt")] == prompt
    assert tokens[labels(tenant=t, model=MODEL, kind="completion")] == completion
    # Prices are 1 and 2 USD per 1M tokens (1 and 2 micro-USD a token); hits cost nothing.
    assert samples(text, "switchboard_cost_micro_usd_total") == {
        labels(tenant=t): sum(usage_of(first)) + 2 * sum(usage_of(fallback))}
    assert samples(text, "switchboard_request_seconds_count") == {labels(model=MODEL): 3}
    assert samples(text, "switchboard_ttft_seconds_count") == {labels(model=MODEL): 3}
    assert samples(text, "switchboard_upstream_in_flight") == {
        labels(deployment="a"): 0, labels(deployment="b"): 0}
    # Nothing secret or private: no keys, no upstream credentials, no prompt text.
    for private in (world.tenant.key, "sk-a-upstream-secret", "sk-b-upstream-secret", PROMPT,
                    "hello", "one too many", first["choices"][0]["message"]["content"]):
        assert private not in text


async def test_streamed_answers_give_time_per_output_token(world):
    r = await world.chat("stream please", stream=True,
                         stream_options={"include_usage": True})
    assert r.status_code == 200
    text = await world.metrics()
    assert samples(text, "switchboard_tpot_seconds_count") == {labels(model=MODEL): 1}
    assert samples(text, "switchboard_ttft_seconds_count") == {labels(model=MODEL): 1}


async def test_breaker_gauge_shows_an_open_breaker(world):
    world.mocks["a"].mock.mode = MockMode(status=503)
    for _ in range(2):  # the threshold: a's breaker opens, b answers both
        assert (await world.chat()).headers["x-switchboard-deployment"] == "b"
    text = await world.metrics()
    assert samples(text, "switchboard_breaker_state") == {
        labels(deployment="a"): 2, labels(deployment="b"): 0}
    assert samples(text, "switchboard_upstream_errors_total") == {
        labels(deployment="a", code="upstream_error"): 2}


async def test_the_metrics_token_is_required_when_set(sqlite_url, tmp_path, mocks):
    async with make_world(sqlite_url, tmp_path, mocks, metrics_token=METRICS_TOKEN) as world:
        assert (await world.client.get("/metrics")).status_code == 401
        for wrong in ("Bearer nope", f"Basic {METRICS_TOKEN}", world.tenant.key):
            r = await world.client.get("/metrics", headers={"authorization": wrong})
            assert r.status_code == 401, wrong
        text = await world.metrics(bearer(METRICS_TOKEN))
        assert "switchboard_breaker_state" in text
        assert METRICS_TOKEN not in text


async def test_metrics_are_open_without_a_token(world):
    r = await world.client.get("/metrics")  # no tenant key needed
    assert r.status_code == 200


# --- the metrics object alone ---------------------------------------------------------------


def finish(metrics: GatewayMetrics, tenant: str, model: str = "m", **more: Any) -> None:
    values: dict[str, Any] = {
        "status": "ok", "cache": "none", "prompt_tokens": 10, "completion_tokens": 5,
        "cached_tokens": 0, "cost_micros": 7, "ttft_s": 0.1, "total_s": 0.5,
        "streamed": True, **more}
    metrics.finished(tenant=tenant, model=model, **values)


def test_tenants_past_the_cap_are_counted_as_other():
    metrics = GatewayMetrics(tenant_cap=2)
    for tenant in ("t1", "t2", "t3", "t4", "t1"):
        finish(metrics, tenant)
    text = metrics.render().decode()
    assert samples(text, "switchboard_cost_micro_usd_total") == {
        labels(tenant="t1"): 14, labels(tenant="t2"): 7, labels(tenant=OTHER): 14}
    assert "t3" not in text and "t4" not in text


def test_adapters_are_labelled_by_their_base_model():
    metrics = GatewayMetrics(model_cap=2)
    finish(metrics, "t", metrics.model_label("base", adapter=True))
    finish(metrics, "t", metrics.model_label("base", adapter=False))
    finish(metrics, "t", metrics.model_label("third", adapter=False))
    requests = samples(metrics.render().decode(), "switchboard_requests_total")
    assert {dict(k)["model"] for k in requests} == {"base:adapter", "base", OTHER}


def test_time_per_output_token_only_for_streams_of_two_tokens_or_more():
    metrics = GatewayMetrics()
    finish(metrics, "t", ttft_s=0.1, total_s=0.5, completion_tokens=5)  # 0.4 s / 4 tokens
    finish(metrics, "t", completion_tokens=1)
    finish(metrics, "t", streamed=False)
    finish(metrics, "t", status="error")
    text = metrics.render().decode()
    assert samples(text, "switchboard_tpot_seconds_sum") == {labels(model="m"): 0.1}
    assert samples(text, "switchboard_request_seconds_count") == {labels(model="m"): 3}


def test_engine_figures_are_read_at_scrape_time():
    stats = {"num_waiting": 3, "kv_cache_usage": 0.25, "lora_device_loads": 2}
    deployment = SimpleNamespace(name="embedded", config=SimpleNamespace(model_name="small"),
                                 stats=lambda: stats)
    registry = DeploymentRegistry()
    registry.add(deployment)  # type: ignore[arg-type]
    metrics = GatewayMetrics(registry)
    text = metrics.render().decode()
    assert samples(text, "switchboard_engine_num_waiting") == {labels(deployment="embedded"): 3}
    stats["num_waiting"] = 0
    text = metrics.render().decode()
    assert samples(text, "switchboard_engine_num_waiting") == {labels(deployment="embedded"): 0}
    assert samples(text, "switchboard_engine_kv_cache_usage") == {
        labels(deployment="embedded"): 0.25}
    assert samples(text, "switchboard_breaker_state") == {labels(deployment="embedded"): 0}


def test_apps_do_not_share_figures():
    one, two = GatewayMetrics(), GatewayMetrics()
    finish(one, "t")
    assert samples(two.render().decode(), "switchboard_requests_total") == {}


def test_the_per_request_cost_is_small():
    """Measured for the report; the bound only catches an accident (a lock storm, I/O)."""
    metrics = GatewayMetrics()
    n = 20_000
    start = time.perf_counter()
    for i in range(n):
        finish(metrics, f"t{i % 50}", metrics.model_label("m", adapter=False))
    per_request_us = (time.perf_counter() - start) / n * 1e6
    print(f"metrics.finished: {per_request_us:.1f} us per request")
    assert per_request_us < 500


def test_a_semantic_hit_counts_an_exact_miss_first():
    metrics = GatewayMetrics()
    metrics.cache_lookup(["exact", "semantic"], "semantic")
    metrics.cache_lookup(["exact", "semantic"], None)
    metrics.cache_lookup(["exact"], "exact")
    assert samples(metrics.render().decode(), "switchboard_cache_lookups_total") == {
        labels(kind="exact", result="miss"): 2, labels(kind="exact", result="hit"): 1,
        labels(kind="semantic", result="hit"): 1, labels(kind="semantic", result="miss"): 1}
