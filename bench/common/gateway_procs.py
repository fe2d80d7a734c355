"""Server processes for the gateway benchmarks: start (optionally pinned), wait, measure, stop;
the project's interpreter and a throwaway gateway's environment and setup CLI.

Only loopback addresses are ever contacted; every wait is bounded in time.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
PROJECT_PY = ROOT / ".venv" / "bin" / "python"
READY_POLL_S = 0.2


def python() -> str:
    """The project's interpreter when present (the gateway and uvloop live there)."""
    return str(PROJECT_PY) if PROJECT_PY.exists() else sys.executable


def gateway_env(tmp: Path, server: str = "uvicorn") -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "SWITCHBOARD_SERVER": server,
        "SWITCHBOARD_DATABASE_URL": f"sqlite+aiosqlite:///{tmp / 'gw.db'}",
        "SWITCHBOARD_SECRET_FILE": str(tmp / "secret"),
        "SWITCHBOARD_USAGE_OUTBOX_DIR": str(tmp / "outbox"),
        "SWITCHBOARD_EMBEDDED__MODEL": "none",
        "SWITCHBOARD_DEPLOYMENTS_FILE": str(tmp / "deployments.yaml"),
        "SWITCHBOARD_LOG_LEVEL": "warning",
        "HF_HUB_OFFLINE": "1",
    })
    return env


def gateway_cli(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run one ``gateway.cli`` setup command; its JSON output (the last JSON line printed)."""
    argv = [python(), "-m", "gateway.cli", *args]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=180, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"`{shlex.join(args)}` exited {done.returncode}: "
                           f"{(done.stderr or done.stdout)[-1500:]}")
    for line in reversed(done.stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                parsed = json.loads(line)
            except ValueError:
                continue
            if isinstance(parsed, dict):
                return parsed
    try:
        parsed = json.loads(done.stdout)
    except ValueError as exc:
        raise RuntimeError(f"`{shlex.join(args)}` printed no JSON: {done.stdout[-500:]}") from exc
    return parsed if isinstance(parsed, dict) else {"value": parsed}


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Pinning:
    """Which CPUs each role runs on (``taskset -c``); empty strings mean "not pinned".

    With two or more CPUs and ``taskset`` present: the load generator and the mock share CPU 0,
    the system under test (gateway or LiteLLM) gets the others, so the servers compared never
    compete with the client or the mock for a core.
    """

    loadgen: str = ""
    mock: str = ""
    server: str = ""

    @classmethod
    def plan(cls, enabled: bool) -> Pinning:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if not enabled or len(cpus) < 2 or shutil.which("taskset") is None:
            return cls()
        rest = ",".join(str(c) for c in cpus[1:])
        return cls(loadgen=str(cpus[0]), mock=str(cpus[0]), server=rest)

    @property
    def enabled(self) -> bool:
        return bool(self.server)

    def wrap(self, cpus: str, argv: list[str]) -> list[str]:
        return ["taskset", "-c", cpus, *argv] if cpus else argv

    def describe(self) -> str:
        if not self.enabled:
            return "not pinned (the OS schedules all processes over all CPUs)"
        return (f"taskset: load generator and mock on CPU {self.loadgen}, "
                f"system under test on CPU {self.server}")

    def as_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "loadgen": self.loadgen, "mock": self.mock,
                "server": self.server, "description": self.describe()}


@dataclass
class ServerProcess:
    """A child process serving HTTP on a loopback port, with its output in a log file."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    cwd: Path | None = None
    host: str = "127.0.0.1"
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerProcess:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd,
                                         start_new_session=True)
        return self

    def wait_ready(self, path: str, timeout_s: float) -> float:
        """Poll ``GET path`` until it answers 200; returns the seconds it took."""
        start = time.monotonic()
        for _ in range(int(timeout_s / READY_POLL_S) + 1):
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early: {self.log_tail()}")
            status, _, _ = http_request("GET", self.url + path, timeout_s=2.0)
            if status == 200:
                return time.monotonic() - start
            time.sleep(READY_POLL_S)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f}s: {self.log_tail()}")

    def cpu_seconds(self) -> float:
        """User+system CPU seconds of the process and its children so far."""
        if self.proc is None:
            return 0.0
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0.0
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM this process's own session, then SIGKILL it if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)  # the group this process leads (start_new_session)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=timeout_s)
                return
            except subprocess.TimeoutExpired:
                continue


def http_request(method: str, url: str, body: bytes | None = None,
                 headers: dict[str, str] | None = None,
                 timeout_s: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """One loopback request; (status, lower-cased headers, body), status 0 if unreachable."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, {}, b""


def post_json(url: str, payload: dict[str, Any], api_key: str | None,
              timeout_s: float = 30.0, headers: dict[str, str] | None = None
              ) -> tuple[int, dict[str, str], bytes]:
    """POST JSON with the key as a bearer token (if any) and any further ``headers``."""
    sent = {"Content-Type": "application/json"}
    if api_key:
        sent["Authorization"] = f"Bearer {api_key}"
    sent.update(headers or {})
    return http_request("POST", url, json.dumps(payload).encode(), sent, timeout_s)
