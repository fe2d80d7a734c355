"""`switchboard serve` as a newcomer runs it: SQLite, in-process limiter, embedded SmolLM2.

Driven with the official `openai` client against the live server; the admin API sets up a
tenant from the bootstrap admin key printed at first start.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.support import REPO, free_port, wait_http

pytestmark = pytest.mark.slow


class Live:
    def __init__(self, base: str, admin_key: str, db_path: Path) -> None:
        self.base = base
        self.admin = {"authorization": f"Bearer {admin_key}"}
        self.db_path = db_path

    def tenant_key(self, name: str, **plan: object) -> str:
        p = httpx.post(f"{self.base}/admin/plans", json={"name": f"{name}-plan", **plan},
                       headers=self.admin).json()
        t = httpx.post(f"{self.base}/admin/tenants", json={"name": name, "plan_id": p["id"]},
                       headers=self.admin).json()
        k = httpx.post(f"{self.base}/admin/tenants/{t['id']}/keys", json={},
                       headers=self.admin)
        assert k.status_code == 201, k.text
        return k.json()["key"]


@pytest.fixture(scope="module")
def live(tmp_path_factory, smollm2_path) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("live")
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO),
           "SWITCHBOARD_DATABASE_URL": f"sqlite+aiosqlite:///{tmp}/gw.db",
           "SWITCHBOARD_SECRET_FILE": str(tmp / "secret"),
           "SWITCHBOARD_USAGE_OUTBOX_DIR": str(tmp / "outbox"),
           "SWITCHBOARD_LOG_LEVEL": "warning",  # stdout is a pipe read only up to the key
           "SWITCHBOARD_EMBEDDED_KV_CACHE_MEMORY": str(128 << 20)}
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        admin_key = _read_admin_key(proc)
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/health", timeout_s=180, proc=proc)
        yield Live(base, admin_key, tmp / "gw.db")
    finally:
        proc.terminate()
        proc.wait(30)


def _read_admin_key(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    for _ in range(200):
        line = proc.stdout.readline()
        if not line:
            break
        if line.strip().startswith("sk-sb-admin-"):
            return line.strip()
    raise RuntimeError(f"no bootstrap admin key printed (exit code {proc.poll()})")


def client(live: Live, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base}/v1", api_key=key, max_retries=0, timeout=120)


def test_bootstrap_key_is_stored_hashed(live):
    key = live.admin["authorization"].split()[1]
    secret = key.rsplit("-", 1)[1]
    assert secret.encode() not in live.db_path.read_bytes()
    r = httpx.get(f"{live.base}/admin/admin-keys", headers=live.admin)
    assert r.status_code == 200 and "key" not in r.json()[0]


def test_chat_completions_and_streaming(live):
    oa = client(live, live.tenant_key("alpha"))
    models = [m.id for m in oa.models.list()]
    assert models == ["all-minilm-l6-v2", "smollm2-135m-instruct", "auto"]
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    raw = oa.chat.completions.with_raw_response.create(
        model="smollm2-135m-instruct", messages=messages, max_tokens=16, temperature=0)
    assert raw.headers["x-request-id"] and "x-gateway-overhead-ms" in raw.headers
    reply = raw.parse()
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens <= 16 and reply.usage.prompt_tokens > 10

    stream = oa.chat.completions.create(
        model="smollm2-135m-instruct", messages=messages, max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_headers={"cache-control": "no-cache"})  # past the response cache, to the engine
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content  # greedy: the same answer either way
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    # The same prompt again: its full blocks come from the prefix cache the first call filled.
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16

    done = oa.completions.create(model="smollm2-135m-instruct", prompt="1, 2, 3,",
                                 max_tokens=6, temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens <= 6


def test_errors_reach_the_client_typed(live):
    oa = client(live, live.tenant_key("beta"))
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError):
        oa.chat.completions.create(model="nope", messages=messages)
    with pytest.raises(openai.BadRequestError) as err:
        oa.chat.completions.create(model="smollm2-135m-instruct", messages=messages,
                                   temperature=7)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.AuthenticationError):
        client(live, "sk-sb-aaaaaaaaaaaa-" + "0" * 40).models.list()


def test_rate_limit_reaches_the_client(live):
    oa = client(live, live.tenant_key("gamma", rpm=1))
    messages = [{"role": "user", "content": "hi"}]
    oa.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as err:
        oa.chat.completions.create(model="smollm2-135m-instruct", messages=messages,
                                   max_tokens=1)
    assert int(err.value.response.headers["retry-after"]) >= 1


def test_client_disconnect_mid_stream_aborts_the_engine(live):
    key = live.tenant_key("delta")
    body = {"model": "smollm2-135m-instruct", "stream": True, "max_tokens": 500,
            "ignore_eos": True, "messages": [{"role": "user", "content": "Count to a thousand."}]}
    with httpx.stream("POST", f"{live.base}/v1/chat/completions", json=body,
                      headers={"authorization": f"Bearer {key}"}, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # The connection is closed after one event; 500 tokens would take far longer than this.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = httpx.get(f"{live.base}/health").json()["deployments"]["embedded"]
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"engine still busy after the client left: {stats}")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with sqlite3.connect(live.db_path) as db:
            rows = db.execute("select status, completion_tokens from usage_records "
                              "where status = 'aborted'").fetchall()
        if rows:
            break
        time.sleep(0.2)
    assert rows and 0 < rows[0][1] < 500
