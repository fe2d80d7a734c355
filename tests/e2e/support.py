"""Live gateway processes for end-to-end tests: `python -m gateway.cli serve` on free loopback
ports, with their output in a log file, always stopped by the caller's `finally`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.gateway.support import REPO, SECRET, free_port


def gateway_env(db_url: str, tmp_path: Path, **settings: Any) -> dict[str, str]:
    """The environment of a gateway on `db_url` with no embedded models: this process's
    environment without any SWITCHBOARD_* of its own, then `settings` as SWITCHBOARD_<NAME>
    (None leaves a setting out)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHBOARD_")}
    env.update({
        "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
        "SWITCHBOARD_DATABASE_URL": db_url, "SWITCHBOARD_SECRET_KEY": SECRET,
        "SWITCHBOARD_SECRET_FILE": str(tmp_path / "secret"),
        "SWITCHBOARD_EMBEDDED__MODEL": "none", "SWITCHBOARD_EMBEDDING_MODEL": "none",
        "SWITCHBOARD_LOG_LEVEL": "warning",
        "SWITCHBOARD_USAGE_OUTBOX_DIR": str(tmp_path / "outbox"),
    })
    for name, value in settings.items():
        if isinstance(value, dict):  # a nested setting: SWITCHBOARD_<NAME>__<FIELD>
            env.update({f"SWITCHBOARD_{name.upper()}__{k.upper()}": str(v)
                        for k, v in value.items()})
        elif value is not None:
            env[f"SWITCHBOARD_{name.upper()}"] = str(value)
    return env


class Gateway:
    """`python -m gateway.cli serve` on a free port, its output in a log file."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env = env
        self.log = log
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> Gateway:
        """Start the process without waiting for it (see `wait_ready`)."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1",
                 "--port", str(self.port)],
                cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout_s: float = 90) -> Gateway:
        """Until GET /health answers; fails (with the log) if the process exits or time runs
        out."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode} before it was "
                                   f"up\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.url}/health did not come up in {timeout_s}s\n"
                           f"{self.log_tail()}")

    def start(self, timeout_s: float = 90) -> Gateway:
        return self.launch().wait_ready(timeout_s)

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def wait(self, timeout_s: float = 60) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        """Kill it if it still runs (for a `finally`; a graceful stop is `signal`)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def start_all(gateways: list[Gateway], timeout_s: float = 90) -> list[Gateway]:
    """Launch every gateway at once, then wait for each (the slowest bounds the wait)."""
    for gateway in gateways:
        gateway.launch()
    deadline = time.monotonic() + timeout_s
    for gateway in gateways:
        gateway.wait_ready(max(1.0, deadline - time.monotonic()))
    return gateways
