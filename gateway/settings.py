"""All gateway configuration in one place, read from `SWITCHBOARD_*` environment variables."""

from __future__ import annotations

import os
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from workers.config import SERVING_DEFAULTS, EngineArgs


class EmbeddedModel(EngineArgs):
    """An engine embedded in the gateway: its engine arguments (declared once, in
    `EngineArgs`, with the serving defaults), and how the gateway offers it."""

    model: str | None = Field(
        "default", description='"default" (the bundled SmolLM2), a model folder, or "none"')
    name: str = "smollm2-135m-instruct"  # the model name clients ask for
    tier: str = "economy"
    # USD per 1M tokens (budgets need a price to bite)
    input_price_per_1m: Decimal = Decimal("0.05")
    output_price_per_1m: Decimal = Decimal("0.10")
    shared_prefix_cache: bool = False  # share prefix-cache KV across tenants
    tool_call_parser: Literal["hermes", "llama3_json"] = "hermes"

    @model_validator(mode="before")
    @classmethod
    def _serving(cls, data: Any) -> Any:
        return {**SERVING_DEFAULTS, **data} if isinstance(data, dict) else data

    def engine_kwargs(self) -> dict[str, Any]:
        kwargs = super().engine_kwargs()
        if kwargs["model"] == "default":
            kwargs["model"] = None  # the bundled model
        return kwargs


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SWITCHBOARD_", extra="ignore",
                                      env_nested_delimiter="__")

    # Persistence: SQLite is the embedded default; PostgreSQL via postgresql+asyncpg://...
    database_url: str = "sqlite+aiosqlite:///./switchboard.db"
    # Empty: in-process limiter (one gateway process). redis://127.0.0.1:6379/0 for replicas.
    redis_url: str = ""
    redis_fail_open: bool = True
    redis_timeout_s: float = 1.0
    # The keyed-hash secret for API keys. Empty: read or create `secret_file` (mode 0600).
    secret_key: str = ""
    secret_file: Path = Path(".switchboard-secret")

    # Deployments: a YAML file (see docs/gateway.md), plus the embedded engine unless disabled.
    deployments_file: Path | None = None
    # The engine embedded in this process (`EmbeddedModel`: every engine argument of
    # `workers.config.EngineArgs`, and how the gateway offers it), e.g.
    # SWITCHBOARD_EMBEDDED__MAX_NUM_SEQS=32, SWITCHBOARD_EMBEDDED__MODEL=none (off).
    embedded: EmbeddedModel = Field(default_factory=lambda: EmbeddedModel())
    # More engines in this process, each with its own KV budget, name and tier (an economy and
    # a standard model without a second process): a JSON list of the same fields, e.g.
    # [{"model": "/models/qwen3", "name": "qwen3", "tier": "standard",
    #   "kv_cache_memory": 1073741824}].
    embedded_models: list[EmbeddedModel] = Field(default_factory=list)
    # POST /v1/embeddings from an embedding model in this process (docs/gateway.md,
    # "Embeddings"): "default" (the bundled all-MiniLM-L6-v2), a model folder, or "none".
    embedding_model: str = "default"
    embedding_model_name: str = "all-minilm-l6-v2"
    embedding_device: str | None = None  # None: CPU
    embedding_input_price_per_1m: Decimal = Decimal("0.01")  # USD; embeddings have no output
    embedding_tier: str = "economy"
    # Micro-batching: concurrent requests share forwards of at most this many rows, and of
    # rows x longest row tokens; tenants share them fairly, by plan weight. A forward is what
    # another tenant's request may wait for: 4096 tokens take ~0.5 s on 2 CPU cores, and
    # larger ones compute no more tokens a second there (docs/gateway.md, "Embeddings").
    embedding_max_batch_rows: int = Field(default=64, ge=1)
    embedding_max_batch_tokens: int = Field(default=4096, ge=1)
    # The most input tokens one request may embed (all its inputs together, [CLS]/[SEP]
    # included): larger is a 400 `embedding_work_exceeded` before any forward. 131072 take
    # ~16 s on 2 CPU cores, well within route_budget_s. A deployment's `max_request_tokens`
    # replaces it; a plan's `embedding_max_request_tokens` may lower it for its tenants.
    embedding_max_request_tokens: int = Field(default=131_072, ge=1)
    # Uploaded adapter files, one folder each. Shared storage when several replicas serve.
    adapter_dir: Path = Path(".switchboard-adapters")
    max_adapter_upload_bytes: int = 256 << 20
    max_adapters_per_tenant: int = 100  # for tenant self-service uploads

    # Routing and fallbacks (docs/gateway.md, "Routing").
    route_max_attempts: int = 3  # deployments tried per request before the client's error
    route_budget_s: float = 60.0  # all attempts together, until the first byte
    breaker_failure_threshold: int = 5  # failures within the window that open a breaker
    breaker_window_s: float = 30.0
    breaker_cooldown_s: float = 15.0  # open this long, then one probe request
    # Response caches (docs/caching.md): in-process, or in Redis when redis_url is set.
    cache_ttl_s: float = 3600.0
    cache_max_entries_per_tenant: int = 10_000
    semantic_cache_max_entries_per_tenant: int = 100_000
    cache_max_entry_bytes: int = 1 << 20
    semantic_threshold: float | None = None  # None: the measured default (caching.semantic)

    # Request handling. Every limit below is listed in docs/security.md.
    max_body_bytes: int = 4 << 20  # counted on the bytes received, whatever the framing
    # The console's sign-in form (POST /console/login), answered to anyone: a key and a token.
    max_login_body_bytes: int = Field(default=64 << 10, ge=1024)
    # After a key or tenant is refused for requests per minute, its next requests within this
    # many seconds (or the retry-after, if sooner) are refused before their body is parsed
    # (gateway/recent_refusals.py); 0: off.
    rpm_refusal_hold_s: float = Field(default=1.0, ge=0.0, le=60.0)
    # The whole body must arrive within this after the request head, else 408 and the
    # connection is closed; adapter uploads (up to max_adapter_upload_bytes) get their own.
    body_read_timeout_s: float = 30.0
    adapter_upload_read_timeout_s: float = 600.0
    # The HTTP server (`switchboard serve`; docs/security.md says why uvicorn is the default).
    # Bound to anything but loopback, /metrics requires `metrics_token`.
    host: str = "127.0.0.1"
    port: int = 8000
    server: Literal["uvicorn", "granian"] = "uvicorn"
    server_max_header_bytes: int = 32 << 10  # request line and headers: larger is a 431
    server_header_read_timeout_s: float = 10.0  # a request head must arrive within this
    server_keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed then
    server_max_connections: int = 1000  # open connections; past it a new one gets 503, closed
    # Failed sign-ins and bearer keys per source address: after `auth_failures_free` failures
    # each further one waits twice as long (up to the max) before it is answered 429.
    auth_failures_free: int = 5
    auth_backoff_max_s: float = 60.0
    auth_throttle_max_sources: int = 10_000  # sources remembered; the stalest go first
    upstream_timeout_s: float = 600.0
    upstream_max_connections: int = 256
    # Auth cache: how often each replica checks the auth version (revocations, plan edits).
    auth_poll_interval_s: float = 0.5
    auth_negative_cache_size: int = 10_000
    usage_flush_interval_s: float = 0.5
    # Once started, the heap built so far (modules, the app, deployments) is frozen out of
    # the garbage collector's passes (gc.freeze): a full collection walking it paused the
    # event loop 250-300 ms, every request in flight then, the gateway's whole p99 at c=32.
    gc_freeze: bool = True
    # The collector's thresholds once started (None: Python's, 700/10/10). A request allocates
    # thousands of objects, so the default young generation was collected several times a
    # request: 100,000 took 0.56 -> 0.49 ms of CPU a request at c=32 (docs/benchmarks.md).
    gc_thresholds: tuple[int, int, int] | None = (100_000, 50, 50)
    # The usage outbox: records survive a crash here until they are in the database.
    usage_outbox_dir: Path | None = Path(".switchboard-outbox")
    budget_reconcile_interval_s: float = 60.0  # budget counters raised to the ledger's spend
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Logs: one JSON object per line (request id, tenant, trace id), or plain text for a
    # terminal. Prompt and completion text is never logged unless `log_prompts` is set.
    log_format: Literal["json", "text"] = "json"
    log_prompts: bool = False
    # Traces (docs/observability.md): "otlp" sends spans over OTLP/HTTP to `otel_endpoint`
    # (e.g. http://otel-collector:4318/v1/traces), "console" prints them (development).
    otel_exporter: Literal["none", "console", "otlp"] = "none"
    otel_endpoint: str = ""
    otel_service_name: str = "switchboard-gateway"
    otel_sample_ratio: float = 1.0
    # `serve` applies migrations first; replicas set this false and run `switchboard migrate`
    # once before they start (docker-compose's `migrate` service, a Helm hook).
    migrate_on_start: bool = True

    # --- Files and batches (docs/gateway.md, "Batches and files") ----------------------
    # Tenants' files (batch inputs, outputs and errors), one folder per tenant; the database
    # holds their metadata. Shared storage when several replicas serve.
    files_dir: Path = Path(".switchboard-files")
    max_file_bytes: int = Field(default=200 << 20, ge=1)  # one upload, as OpenAI's batch limit
    max_files_per_tenant: int = Field(default=10_000, ge=1)
    file_upload_read_timeout_s: float = 600.0  # the whole upload must arrive within this
    batch_max_lines: int = Field(default=50_000, ge=1)  # requests in one input file
    # This process runs batches (a replica may leave them to the others).
    batch_worker: bool = True
    # Lines answered at once, every tenant's batches together, shared fairly between tenants;
    # each runs as the engine's background work (priority 10: after every live request).
    batch_max_concurrency: int = Field(default=2, ge=1, le=1024)
    # While live requests are in flight in this process, batch lines in flight are held to
    # this many (0: none start until live traffic is idle), so live traffic is not slowed.
    batch_concurrency_under_load: int = Field(default=1, ge=0, le=1024)
    batch_poll_interval_s: float = Field(default=2.0, gt=0)  # looks for batches to run
    batch_lease_s: float = Field(default=30.0, gt=0)  # a dead process's batches resume after
    batch_retry_s: float = Field(default=5.0, gt=0)  # a line refused 503 waits this long

    # --- Remote workers (docs/scaling.md) ------------------------------------------------
    # The shared secret between gateways and `switchboard worker` processes: the gateway sends
    # it as a bearer token, the worker refuses calls without it. Empty: workers are open.
    worker_secret: str = ""
    # Workers that register themselves in Redis (`switchboard worker --register-redis`)
    # become deployments of the matching `provider: worker` entry with `discover: true`.
    worker_heartbeat_ttl_s: float = 6.0  # a worker unseen this long is dropped
    worker_stats_interval_s: float = 1.0  # how often the gateway polls each worker's /stats
    # Mutual TLS to workers started with --ssl-certfile/--ssl-ca-certs: the CA that signed
    # their certificates, and this gateway's client certificate and key.
    worker_tls_ca_file: Path | None = None
    worker_tls_cert_file: Path | None = None
    worker_tls_key_file: Path | None = None
    # GET /metrics: scrapers send `Authorization: Bearer <token>`. Empty: /metrics answers only
    # when the gateway is bound to loopback (`host`), and is refused otherwise.
    metrics_token: str = ""

    # --- Console (docs/console.md): the admin web console at /console --------------------
    console_session_ttl_s: float = 8 * 3600.0  # a sign-in lasts this long, then sign in again
    console_max_sessions: int = 10_000  # per process; the oldest session goes first

    @model_validator(mode="after")
    def _no_flat_engine_names(self) -> Settings:
        """An engine argument set the flat way (SWITCHBOARD_EMBEDDED_MAX_NUM_SEQS, as before
        the settings nested `EngineArgs`) would be ignored in silence: a startup error that
        names the variable to set instead."""
        prefix = "SWITCHBOARD_EMBEDDED_"
        for name in os.environ:
            upper = name.upper()
            if not upper.startswith(prefix) or upper.startswith(prefix + "_"):
                continue
            field = upper.removeprefix(prefix).lower()
            if field in EmbeddedModel.model_fields:
                raise ValueError(f"{name} is not read: engine settings nest, set "
                                 f"SWITCHBOARD_EMBEDDED__{field.upper()} instead")
        return self

    def embedded_engines(self) -> dict[str, EmbeddedModel]:
        """The embedded engines by deployment name ("embedded", then "embedded-<name>"),
        those switched on."""
        engines = {"embedded": self.embedded} if self.embedded.model != "none" else {}
        for extra in self.embedded_models:
            if extra.model != "none":
                engines[f"embedded-{extra.name}"] = extra
        return engines
