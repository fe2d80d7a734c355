"""`switchboard-probe` (deploy/docker/probe.py): the image's healthcheck, the workers' preStop
drain and the gateways' wait-for-schema initContainer, against real servers and databases."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tenancy.migrate import upgrade
from tests.deploy.support import REPO

SCRIPT = REPO / "deploy" / "docker" / "probe.py"


def load_probe() -> ModuleType:
    spec = importlib.util.spec_from_file_location("switchboard_probe", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe = load_probe()


class FakeWorker:
    """A loopback HTTP server: /ok answers 200, /down 503; /admin/drain counts down."""

    def __init__(self, in_flight: int = 2) -> None:
        self.in_flight = in_flight
        self.drain_calls: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                self._answer(200 if self.path == "/ok" else 503, {"status": self.path})

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                owner.drain_calls.append({"auth": self.headers.get("authorization"),
                                          "body": body})
                if self.headers.get("authorization") != "Bearer s3cret":
                    self._answer(401, {"error": "unauthorized"})
                    return
                in_flight, owner.in_flight = owner.in_flight, max(owner.in_flight - 1, 0)
                self._answer(200, {"draining": True, "in_flight": in_flight})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeWorker:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def worker() -> Iterator[FakeWorker]:
    with FakeWorker() as server:
        yield server


def test_http_mode(worker: FakeWorker) -> None:
    assert probe.main(["http", f"{worker.url}/ok"]) == 0
    assert probe.main(["http", f"{worker.url}/down"]) == 1


def test_http_mode_on_a_closed_port() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert probe.main(["http", f"http://127.0.0.1:{port}/health/ready", "--timeout", "1"]) == 1


def test_drain_waits_until_nothing_is_in_flight(worker: FakeWorker,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWITCHBOARD_WORKER_SECRET", "s3cret")
    assert probe.main(["drain", worker.url, "--wait", "10", "--interval", "0.01"]) == 0
    assert [c["auth"] for c in worker.drain_calls] == ["Bearer s3cret"] * 3  # 2, 1, 0
    assert all(c["body"] == {"drain": True} for c in worker.drain_calls)
    assert worker.in_flight == 0


def test_drain_gives_up_at_the_deadline_and_never_fails_the_hook(
        worker: FakeWorker, monkeypatch: pytest.MonkeyPatch) -> None:
    worker.in_flight = 10**6
    monkeypatch.setenv("SWITCHBOARD_WORKER_SECRET", "s3cret")
    assert probe.main(["drain", worker.url, "--wait", "0.05", "--interval", "0.01"]) == 0
    monkeypatch.setenv("SWITCHBOARD_WORKER_SECRET", "wrong")
    calls = len(worker.drain_calls)
    assert probe.main(["drain", worker.url, "--wait", "5"]) == 0  # refused: stop at once
    assert len(worker.drain_calls) == calls + 1


def test_schema_waits_for_the_migrations(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'sb.db'}"
    monkeypatch.setenv("SWITCHBOARD_DATABASE_URL", url)
    assert probe.main(["schema", "--timeout", "0.2", "--interval", "0.05"]) == 1  # empty
    upgrade(url, "0001")
    assert probe.schema_at_head(url) is False  # behind the head
    upgrade(url)
    assert probe.main(["schema", "--timeout", "5"]) == 0


def test_runs_as_a_script() -> None:
    """The image runs it as /usr/local/bin/switchboard-probe: a file, not a module."""
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0
    assert "drain" in result.stdout and "schema" in result.stdout
    assert SCRIPT.read_text().startswith("#!/usr/bin/env python3\n")
