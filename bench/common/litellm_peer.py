"""LiteLLM Proxy as the gateway benchmark's peer: its own venv, a DB-less config, the CLI argv.

``litellm[proxy]==1.106.0`` is installed on first use into ``bench/.venv-litellm`` (git-ignored
through a ``.gitignore`` written inside it), apart from the project's venv so that its pins do
not meet ours. 1.106.0 installs from PyPI as is (its certifi pin resolves); newer releases need a
certifi the registry lacks, and 1.107.x is a reported supply-chain compromise, so the version
is pinned exactly.

What the DB-less config has on, as near to "a valid tenant key, limits and usage metering" as
LiteLLM allows without its PostgreSQL database:

- auth: the master key (virtual keys, and with them per-key/team RPM, TPM and budgets, need
  the DB: any other bearer key is refused with "No connected db");
- limits: ``global_max_parallel_requests`` (the proxy's in-memory parallel-request limiter) and
  per-deployment ``rpm``/``tpm`` (tracked in memory by the router, reported as
  ``x-ratelimit-*`` headers), all set far above the load so that nothing is refused;
- metering: per-request cost from ``model_info`` prices (``x-litellm-response-cost``, and the
  key's running spend in ``x-litellm-key-spend``); nothing is persisted without the DB.

Its ``/v1/messages`` (Anthropic Messages, ``bench/surfaces_overhead.py``) would go to an
``openai/`` deployment's Responses API (``/v1/responses``), which the mock, like most
OpenAI-compatible upstreams, does not serve; the environment variable
``LITELLM_USE_CHAT_COMPLETIONS_URL_FOR_ANTHROPIC_MESSAGES`` makes it translate to chat
completions instead, as the gateway does. It changes nothing else.

Logging is turned down with ``LITELLM_LOG=ERROR`` (the CLI passes it to uvicorn, which then
drops its access log) and the model cost map is the local one (``LITELLM_LOCAL_MODEL_COST_MAP``),
so nothing reaches for the network.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parents[2]
LITELLM_VERSION = "1.106.0"
LITELLM_REQUIREMENT = f"litellm[proxy]=={LITELLM_VERSION}"
VENV = ROOT / "bench" / ".venv-litellm"
MASTER_KEY = "sk-litellm-bench-master"
UPSTREAM_KEY = "sk-upstream-secret"
INPUT_PRICE_PER_TOKEN = 0.15 / 1e6
OUTPUT_PRICE_PER_TOKEN = 0.60 / 1e6
INSTALL_TIMEOUT_S = 1800
SELF_REPORTED_HEADER = "x-litellm-overhead-duration-ms"
HEALTH_PATH = "/health/liveliness"


def venv_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def installed_marker(venv: Path = VENV) -> Path:
    return venv / f".installed-litellm-{LITELLM_VERSION}"


def ensure_venv(venv: Path = VENV, log: Path | None = None) -> Path:
    """Create the venv and install LiteLLM Proxy unless done before; returns its ``litellm``.

    Raises ``RuntimeError`` (with the tail of pip's output) when the install fails.
    """
    litellm = venv / "bin" / "litellm"
    if installed_marker(venv).exists() and litellm.exists():
        return litellm
    log = log or Path(tempfile.gettempdir()) / "switchboard-litellm-install.log"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        _run_logged([sys.executable, "-m", "venv", str(venv)], out, log)
        (venv / ".gitignore").write_text("*\n")  # keep git and ruff out of the venv
        _run_logged([str(venv_python(venv)), "-m", "pip", "install", "-q", LITELLM_REQUIREMENT],
                    out, log)
    installed_marker(venv).write_text(LITELLM_REQUIREMENT + "\n")
    return litellm


def _run_logged(argv: list[str], out: TextIO, log: Path) -> None:
    out.write(f"$ {' '.join(argv)}\n")
    out.flush()
    done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S,
                          check=False, env=litellm_env())
    if done.returncode != 0:
        raise RuntimeError(f"installing {LITELLM_REQUIREMENT} failed: {log.read_text()[-2000:]}")


def config_yaml(mock_base_url: str, model: str = "mock-model") -> str:
    """The proxy's DB-less config: one model on the mock, master key, limits, prices."""
    return f"""\
model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {mock_base_url}
      api_key: {UPSTREAM_KEY}
      rpm: 10000000
      tpm: 10000000000
    model_info:
      input_cost_per_token: {INPUT_PRICE_PER_TOKEN:.10f}
      output_cost_per_token: {OUTPUT_PRICE_PER_TOKEN:.10f}
general_settings:
  master_key: {MASTER_KEY}
  global_max_parallel_requests: 100000
litellm_settings:
  drop_params: true
  telemetry: false
"""


def litellm_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for pip and the proxy: local cost map, quiet logs, no DB, no Redis."""
    env = dict(os.environ if base is None else base)
    for name in ("DATABASE_URL", "DIRECT_URL", "REDIS_HOST", "REDIS_URL", "REDIS_PORT",
                 "VIRTUAL_ENV", "PYTHONPATH"):
        env.pop(name, None)
    env.update({"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
                "HF_HUB_OFFLINE": "1", "NO_DOCS": "True", "NO_REDOC": "True",
                "DISABLE_ADMIN_UI": "True",
                "LITELLM_USE_CHAT_COMPLETIONS_URL_FOR_ANTHROPIC_MESSAGES": "True"})
    return env


def command(litellm: Path, config: Path, host: str, port: int) -> list[str]:
    """The CLI line: uvicorn with one worker on a loopback port."""
    return [str(litellm), "--config", str(config), "--host", host, "--port", str(port),
            "--num_workers", "1"]


def version(venv: Path = VENV) -> str | None:
    """The installed LiteLLM version, read from the venv's metadata (None if absent)."""
    found = sorted((venv / "lib").glob("python*/site-packages/litellm-*.dist-info"))
    return found[0].name.removeprefix("litellm-").removesuffix(".dist-info") if found else None
