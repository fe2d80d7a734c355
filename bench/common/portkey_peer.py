"""Portkey's open-source gateway as the gateway benchmark's second peer: install, argv, headers.

``@portkey-ai/gateway@1.15.2`` (Node) is installed with npm on first use into ``bench/.portkey``
(git-ignored, also through a ``.gitignore`` written inside it) and reused afterwards. It runs as
``node node_modules/@portkey-ai/gateway/build/start-server.js --port=N --headless`` (the
server reads ``--port=N`` only; ``--headless`` skips its web console).

One pin beside it: ``@hono/node-server`` 1.14.1, through npm ``overrides``. The package asks for
``^1.3.3``, npm resolves the newest 1.x, and from 1.14.2 on that version hands a streamed
upstream response's immutable ``Headers`` to Portkey, whose ``updateHeaders`` then throws
``TypeError: immutable``: every streamed chat completion answers 500 ``"Something went
wrong"`` (Portkey-AI/gateway issue 1389, open). Plain requests are unaffected.

What it does per request, with the upstream named in headers (``x-portkey-provider: openai``,
``x-portkey-custom-host``): parse, map the body to the provider's (OpenAI to OpenAI here),
forward with the caller's bearer key, map the answer back, add ``x-portkey-*`` headers. Its
open gateway has no keys of its own, no rate limits, budgets or usage metering (those are in
Portkey's hosted control plane), so it does less per request than Switchboard or LiteLLM do
here. Its ``/v1/messages`` does not translate for an OpenAI upstream ("messages is not
supported by openai"), so it is not a peer for the Messages surface.

Node's stream path sleeps 25 ms before relaying the first chunk of every streamed answer
(``setTimeout(25)`` in the built ``start-server.js``): its streamed latency includes that.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PORTKEY_VERSION = "1.15.2"
PACKAGE = "@portkey-ai/gateway"
NODE_SERVER_PIN = "1.14.1"  # see the module docstring: 1.14.2+ breaks its streams
DIR = ROOT / "bench" / ".portkey"
INSTALL_TIMEOUT_S = 900
HEALTH_PATH = "/"  # "AI Gateway says hey!"
SELF_REPORTED_HEADER = None  # it reports no overhead of its own


def script(folder: Path = DIR) -> Path:
    return folder / "node_modules" / PACKAGE / "build" / "start-server.js"


def installed_marker(folder: Path = DIR) -> Path:
    return folder / f".installed-portkey-{PORTKEY_VERSION}-hono-node-server-{NODE_SERVER_PIN}"


def package_json() -> str:
    return json.dumps({"private": True, "dependencies": {PACKAGE: PORTKEY_VERSION},
                       "overrides": {"@hono/node-server": NODE_SERVER_PIN}}, indent=2) + "\n"


def ensure_installed(folder: Path = DIR, log: Path | None = None) -> Path:
    """npm-install the gateway unless done before; returns its ``start-server.js``.

    Raises ``RuntimeError`` when Node or npm is missing or the install fails (with npm's tail).
    """
    entry = script(folder)
    if installed_marker(folder).exists() and entry.exists():
        return entry
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None:
        raise RuntimeError("Portkey's gateway needs Node.js and npm on PATH (apt-get install "
                           "nodejs npm)")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".gitignore").write_text("*\n")  # keep git and ruff out of node_modules
    (folder / "package.json").write_text(package_json())
    log = log or Path(tempfile.gettempdir()) / "switchboard-portkey-install.log"
    argv = [npm, "install", "--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=warn"]
    with log.open("w") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=folder,
                              timeout=INSTALL_TIMEOUT_S, check=False)
    if done.returncode != 0 or not entry.exists():
        raise RuntimeError(f"npm install {PACKAGE}@{PORTKEY_VERSION} failed: "
                           f"{log.read_text()[-2000:]}")
    installed_marker(folder).write_text(package_json())
    return entry


def command(entry: Path, port: int) -> list[str]:
    """The server's argv on a loopback port (it listens on all interfaces; nothing else runs)."""
    return [shutil.which("node") or "node", str(entry), f"--port={port}", "--headless"]


def headers(mock_base_url: str, upstream_key: str) -> dict[str, str]:
    """What each request carries: the provider, the upstream's base URL and the upstream key."""
    return {"x-portkey-provider": "openai", "x-portkey-custom-host": mock_base_url,
            "Authorization": f"Bearer {upstream_key}"}


def versions(folder: Path = DIR) -> dict[str, str | None]:
    """Installed versions of the gateway and of the HTTP layer under it, and Node's."""
    out: dict[str, str | None] = {}
    for name in (PACKAGE, "@hono/node-server", "hono"):
        meta = folder / "node_modules" / name / "package.json"
        try:
            out[name] = json.loads(meta.read_text()).get("version")
        except (OSError, ValueError):
            out[name] = None
    node = shutil.which("node")
    if node:
        done = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30,
                              check=False)
        out["node"] = done.stdout.strip() or None
    return out
