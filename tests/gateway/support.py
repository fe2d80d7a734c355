"""Helpers for gateway tests: seed tenants and keys, run apps in-process or live."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import httpx
import uvicorn
import yaml
from aiohttp import web
from fastapi import FastAPI
from sqlalchemy import select

from bench.common.mock_upstream import MockServerThread
from gateway.app import create_app
from gateway.server import uvicorn_config
from gateway.settings import Settings
from tenancy import service
from tenancy.db import make_engine, make_sessionmaker
from tenancy.keys import load_or_create_pepper
from tenancy.models import UsageRecord

REPO = Path(__file__).resolve().parents[2]
SECRET = "test-secret-key-for-gateway-tests"
CHAT_MODEL = "chat"  # the model name `priced_deployment` serves and `GatewayWorld.chat` asks for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pepper(tmp_path: Path) -> bytes:
    return load_or_create_pepper(secret_key=SECRET, secret_file=tmp_path / "unused")


@dataclass
class Seeded:
    tenant_id: str
    plan_id: str
    key: str
    key_id: str


async def seed_tenant(
    db_url: str, tmp_path: Path, *, name: str, plan: dict[str, Any] | None = None,
    key: dict[str, Any] | None = None,
) -> Seeded:
    """A plan (named after the tenant), a tenant on it, and one key."""
    engine = make_engine(db_url)
    try:
        async with make_sessionmaker(engine)() as session:
            p = await service.create_plan(session, name=f"{name}-plan", **(plan or {}))
            t = await service.create_tenant(session, name=name, plan_id=p.id)
            record, full = await service.create_api_key(
                session, tenant_id=t.id, pepper=pepper(tmp_path), **(key or {}))
            return Seeded(t.id, p.id, full, record.id)
    finally:
        await engine.dispose()


async def admin_key(db_url: str, tmp_path: Path) -> str:
    engine = make_engine(db_url)
    try:
        async with make_sessionmaker(engine)() as session:
            _, full = await service.create_admin_key(session, pepper=pepper(tmp_path),
                                                     name="test-admin")
            return full
    finally:
        await engine.dispose()


def write_deployments(tmp_path: Path, deployments: list[dict[str, Any]], *,
                      aliases: list[dict[str, Any]] | None = None) -> Path:
    """The routing file for `deployments_file`: the deployments, and the aliases if any."""
    routing: dict[str, Any] = {"deployments": deployments}
    if aliases:
        routing["aliases"] = aliases
    path = tmp_path / "deployments.yaml"
    path.write_text(yaml.safe_dump(routing))
    return path


def mock_deployment(base_url: str, **overrides: Any) -> dict[str, Any]:
    return {
        "name": "mock", "model_name": "mock-model", "provider": "openai",
        "upstream_model": "mock-upstream-model", "base_url": base_url,
        "api_key": "sk-upstream-secret", "tier": "standard",
        "input_price_per_1m": "1.0", "output_price_per_1m": "2.0", "context_window": 4096,
        **overrides,
    }


def priced_deployment(name: str, mock: MockServerThread, price: str, **more: Any
                      ) -> dict[str, Any]:
    """A deployment of CHAT_MODEL on `mock` at `price` USD per 1M tokens in and out. Its
    upstream key, `sk-<name>-upstream-secret`, is one a test can look for in what leaks."""
    return {"name": name, "model_name": CHAT_MODEL, "provider": "openai",
            "base_url": mock.base_url, "api_key": f"sk-{name}-upstream-secret",
            "upstream_model": f"up-{name}", "input_price_per_1m": price,
            "output_price_per_1m": price, **more}


def settings(db_url: str, tmp_path: Path, **overrides: Any) -> Settings:
    """Test settings: no model loads unless asked for (an engine handed to `create_app`
    serves as "embedded"); `embedded` overrides are fields over that."""
    embedded = {"model": "none", **overrides.pop("embedded", {})}
    values: dict[str, Any] = {
        "database_url": db_url, "secret_key": SECRET, "secret_file": tmp_path / "secret",
        "embedded": embedded, "embedding_model": "none",
        "auth_poll_interval_s": 0.2, "usage_flush_interval_s": 0.1,
        "usage_outbox_dir": tmp_path / "outbox", "files_dir": tmp_path / "files",
        "gc_freeze": False, "gc_thresholds": None,  # the test process's collector as it is
        **overrides,
    }
    return Settings(**values)


def mock_settings(db_url: str, tmp_path: Path, base_url: str, **overrides: Any) -> Settings:
    """`settings` for a gateway whose one deployment is the mock upstream at `base_url`."""
    return settings(db_url, tmp_path, deployments_file=write_deployments(
        tmp_path, [mock_deployment(base_url)]), **overrides)


@asynccontextmanager
async def in_process(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan run, behind an in-memory transport."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway",
                                     timeout=60) as client:
            yield client


@asynccontextmanager
async def gateway_client(cfg: Settings, **kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with in_process(create_app(cfg, **kwargs)) as client:
        yield client


@dataclass
class GatewayWorld:
    """A gateway app served in-process to one seeded tenant, over named mock upstreams.
    Modules subclass it for their own fields and helpers; `serve_world` builds any of them."""

    client: httpx.AsyncClient
    app: FastAPI
    tenant: Seeded
    mocks: dict[str, MockServerThread]
    prompt: ClassVar[str] = "hi"  # what `chat` sends when given no content

    async def chat(self, content: str | None = None, model: str = CHAT_MODEL, *,
                   key: str | None = None, headers: dict[str, str] | None = None,
                   **extra: Any) -> httpx.Response:
        """One user message as the tenant (or as `key`); `extra` goes into the body."""
        message = {"role": "user", "content": self.prompt if content is None else content}
        body = {"model": model, "messages": [message], **extra}
        return await self.client.post("/v1/chat/completions", json=body,
                                      headers={**bearer(key or self.tenant.key), **(headers or {})})

    async def settled(self) -> None:
        """Background work (cache stores) done, so the next identical request can hit."""
        await asyncio.gather(*self.app.state.gateway.background)


WorldT = TypeVar("WorldT", bound=GatewayWorld)


@asynccontextmanager
async def serve_world(
    world: type[WorldT], db_url: str, tmp_path: Path, mocks: dict[str, MockServerThread],
    deployments: list[dict[str, Any]], *, aliases: list[dict[str, Any]] | None = None,
    plan: dict[str, Any] | None = None, app_kwargs: dict[str, Any] | None = None,
    fields: dict[str, Any] | None = None, **overrides: Any,
) -> AsyncIterator[WorldT]:
    """A `world` whose gateway routes over `deployments` (and `aliases`) with `settings`
    overrides, for one tenant "acme" on `plan`. `app_kwargs` go to `create_app` and `fields`
    fill the subclass's own fields, so every module builds its world the same way."""
    cfg = settings(db_url, tmp_path, deployments_file=write_deployments(
        tmp_path, deployments, aliases=aliases), **overrides)
    tenant = await seed_tenant(db_url, tmp_path, name="acme", plan=plan)
    app = create_app(cfg, **(app_kwargs or {}))
    async with in_process(app) as client:
        yield world(client, app, tenant, mocks, **(fields or {}))


async def usage_rows(db_url: str, request_ids: list[str], *, timeout_s: float = 10.0
                     ) -> list[UsageRecord]:
    """The usage records of `request_ids`, once all are written."""
    engine = make_engine(db_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            async with make_sessionmaker(engine)() as session:
                found = list((await session.scalars(select(UsageRecord).where(
                    UsageRecord.request_id.in_(request_ids)))).all())
            if len(found) == len(request_ids) or time.monotonic() > deadline:
                return found
            await asyncio.sleep(0.05)
    finally:
        await engine.dispose()


def ok(response: httpx.Response, status: int = 200) -> Any:
    """The JSON of a response that must have `status`; the body is the failure message."""
    assert response.status_code == status, response.text
    return response.json()


def assert_error(response: httpx.Response, status: int, *, code: str | None = None
                 ) -> dict[str, Any]:
    """An error in OpenAI's shape, with a message and the request id; returns the error."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error
    assert response.headers["x-request-id"]
    return error


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


class MockUpstream:
    """`python -m bench.common.mock_upstream` as a subprocess on a free loopback port."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._args = args
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> MockUpstream:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.common.mock_upstream", "--host", "127.0.0.1",
             "--port", str(self.port), *self._args],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        wait_http(f"{self.base_url}/models")
        return self

    def last_request(self) -> dict[str, Any]:
        return httpx.get(f"http://127.0.0.1:{self.port}/_last_request").json()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


def wait_http(url: str, *, timeout_s: float = 120, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was up")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not come up in {timeout_s}s")


@contextmanager
def mock_servers(*names: str) -> Iterator[dict[str, MockServerThread]]:
    """In-process mock upstreams by name, for a module's tests; reset them per test."""
    servers = {name: MockServerThread().start() for name in names}
    try:
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@asynccontextmanager
async def loopback_upstream(handler: Any, paths: tuple[str, ...] = (
        "/v1/chat/completions", "/v1/completions")) -> AsyncIterator[str]:
    """An aiohttp upstream in the test's own loop answering POSTs to `paths` with `handler`;
    yields its OpenAI base URL."""
    app = web.Application()
    for path in paths:
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        await runner.cleanup()


# --- Raw sockets against the gateway served live on loopback (limits tests) --------------

WAIT_S = 10.0  # the most any socket read waits in these tests


@contextmanager
def live(cfg: Settings, app: Any = None) -> Iterator[int]:
    """`app` (the gateway of `cfg` by default) served by uvicorn with `gateway.server`'s
    limits, in a thread; its port."""
    port = free_port()
    config = uvicorn_config(app or create_app(cfg), cfg, host="127.0.0.1", port=port)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(15)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    sock.settimeout(WAIT_S)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (a read timeout fails the test)."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def send_quietly(sock: socket.socket, data: bytes) -> bool:
    """False once the server has closed the connection."""
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])
