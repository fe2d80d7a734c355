"""The surfaces benchmark's bookkeeping and the Portkey peer's setup, without starting servers."""

from __future__ import annotations

import json
from typing import Any

from bench import gateway_overhead as go
from bench import surfaces_overhead as so
from bench.common import portkey_peer


def _row(system: str, surface: str, stream: bool, c: int, p50: float, p99: float,
         cpu: float | None = None) -> dict[str, Any]:
    return {"system": system, "surface": surface, "stream": stream, "concurrency": c,
            "rps": 100.0, "latency_ms": {"p50": p50, "p99": p99}, "ttfb_ms": {"p50": p50},
            "self_reported_ms": {}, "server_cpu_ms_per_req": cpu, "errors": 0}


def test_bodies_ask_the_same_question_on_every_surface() -> None:
    for stream in (False, True):
        chat = so.body("chat", stream)
        messages = so.body("messages", stream)
        responses = so.body("responses", stream)
        assert messages["system"] == chat["messages"][0]["content"] == responses["instructions"]
        assert messages["messages"][0]["content"] == chat["messages"][1]["content"]
        assert responses["input"] == messages["messages"][0]["content"]
        assert messages["max_tokens"] == responses["max_output_tokens"] == chat["max_tokens"]
        assert "store" not in responses and so.body("responses-nostore", stream)["store"] is False
        assert messages.get("stream", False) is stream


def test_messages_carry_the_key_as_the_anthropic_sdk_does() -> None:
    target = go.Target("gateway", "http://127.0.0.1:1", "sk-sb-x")
    assert so.headers(target, "messages") == {"x-api-key": "sk-sb-x",
                                              "anthropic-version": so.ANTHROPIC_VERSION}
    assert so.headers(target, "chat") == {"Authorization": "Bearer sk-sb-x"}


def test_answers_are_checked_per_surface() -> None:
    assert so.check_answer("messages", False, 200, b'{"type": "message", "content": []}') is None
    assert so.check_answer("responses-nostore", True,
                           200, b"event: response.completed\ndata: {}\n\n") is None
    assert so.check_answer("chat", True, 200, b"data: [DONE]\n\n") is None
    assert "HTTP 404" in (so.check_answer("responses", False, 404, b"{}") or "")
    assert so.check_answer("messages", True, 200, b"data: {}\n\n") is not None


def test_summary_ratios_are_added_latency_over_chats() -> None:
    rows = [_row("direct", "chat", False, 1, 1.0, 2.0),
            _row("gateway", "chat", False, 1, 3.0, 12.0, cpu=1.0),
            _row("gateway", "messages", False, 1, 3.2, 13.0, cpu=1.1),
            _row("gateway", "messages", False, 1, 3.4, 11.0, cpu=1.3),
            _row("litellm", "chat", False, 1, 11.0, 22.0),
            _row("litellm", "messages", False, 1, 21.0, 42.0)]
    lines = so.summarize(rows)
    by = {(x["system"], x["surface"]): x for x in lines}
    msg = by[("gateway", "messages")]
    assert msg["rounds"] == 2 and msg["p50_ms"] == 3.3 and msg["p99_ms"] == 12.0
    assert msg["added_ms"] == {"p50": 2.3, "p99": 10.0}
    assert msg["x_chat"] == {"p50": 1.15, "p99": 1.0, "cpu": 1.2}
    assert by[("litellm", "messages")]["x_chat"]["p50"] == 2.0
    verdicts = {t["target"]: t["met"] for t in so.targets(lines) if "target" in t}
    assert verdicts == {"gateway messages added p50 / chat's, plain c=1": False,
                        "gateway messages added p99 / chat's, plain c=1": True}
    (comparison,) = [t for t in so.targets(lines) if "comparison" in t]
    assert comparison["value_ratio"] == round(20.0 / 2.3, 3)
    assert "NOT MET" in so.target_line(so.targets(lines)[0])
    assert "x chat p50" in so.table(lines)


def test_portkey_is_pinned_past_the_streaming_bug_and_named_per_request() -> None:
    spec = json.loads(portkey_peer.package_json())
    assert spec["dependencies"] == {"@portkey-ai/gateway": "1.15.2"}
    assert spec["overrides"] == {"@hono/node-server": "1.14.1"}
    argv = portkey_peer.command(portkey_peer.script(), 8790)
    assert argv[-2:] == ["--port=8790", "--headless"]  # it reads --port=N only
    assert portkey_peer.headers("http://127.0.0.1:9/v1", "sk-up") == {
        "x-portkey-provider": "openai", "x-portkey-custom-host": "http://127.0.0.1:9/v1",
        "Authorization": "Bearer sk-up"}
    target = go.Target("portkey", "http://127.0.0.1:1", "sk-up",
                       headers=portkey_peer.headers("http://127.0.0.1:9/v1", "sk-up"))
    assert target.request_headers()["x-portkey-provider"] == "openai"


def test_portkey_comparison_has_no_invented_bar() -> None:
    rows = [{"system": s, "stream": False, "concurrency": 32, "rps": rps}
            for s, rps in (("gateway", 300.0), ("litellm", 50.0), ("portkey", 100.0))]
    out = {t["target"]: t for t in go.targets(rows)}
    assert out["gateway RPS at c=32 vs LiteLLM (plain)"]["met"] is True
    portkey = out["gateway RPS at c=32 vs Portkey (plain)"]
    assert portkey["value_ratio"] == 3.0 and portkey["met"] is None
    assert go.target_line(portkey) == "comparison: gateway RPS at c=32 vs Portkey (plain): 3.00x"
