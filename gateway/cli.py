"""`switchboard`: serve the gateway, run a bare worker, and administer tenants and keys."""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import sys
from pathlib import Path

from gateway.commands import tenancy as tenancy_commands
from gateway.commands import usage as usage_commands
from gateway.observability.logs import configure_logging, configured_secrets
from gateway.settings import Settings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="switchboard")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="migrate the database and serve the gateway")
    serve.add_argument("--host", default=None, help="default: SWITCHBOARD_HOST or 127.0.0.1")
    serve.add_argument("--port", type=int, default=None, help="default: SWITCHBOARD_PORT or 8000")
    serve.add_argument("--server", choices=("uvicorn", "granian"), default=None,
                       help="the HTTP server (default: SWITCHBOARD_SERVER or uvicorn)")
    serve.set_defaults(func=_serve)
    worker = sub.add_parser("worker", help="serve one engine over HTTP, without tenancy")
    _worker_arguments(worker)
    worker.set_defaults(func=_worker)
    tenancy_commands.register(sub)
    usage_commands.register(sub)
    args = parser.parse_args(argv)
    settings = Settings()
    configure_logging(settings.log_level, settings.log_format,
                      secrets=configured_secrets(settings))
    sys.exit(args.func(args, settings))


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    from gateway.app import create_app
    from gateway.routes.metrics import announce_metrics_access
    from gateway.server import serve
    from tenancy.db import create_private_sqlite_file
    from tenancy.migrate import upgrade

    chosen = {"host": args.host, "port": args.port, "server": args.server}
    settings = settings.model_copy(update={k: v for k, v in chosen.items() if v is not None})
    for name, spec in settings.embedded_engines().items():
        if refused := _refuse_model(spec.model, f"{name} model"):
            return refused
    if settings.server == "granian":  # its worker process reads the environment
        os.environ["SWITCHBOARD_SERVER"] = "granian"
        os.environ["SWITCHBOARD_HOST"] = settings.host
        os.environ["SWITCHBOARD_PORT"] = str(settings.port)

    create_private_sqlite_file(settings.database_url)  # before alembic creates it 0644
    if settings.migrate_on_start:
        upgrade(settings.database_url)
    key = asyncio.run(_bootstrap_admin_key(settings))
    if key is not None:
        print(f"\nBootstrap admin key (shown once, stored only hashed):\n\n    {key}\n",
              flush=True)
    announce_metrics_access(settings)
    app = None if settings.server == "granian" else create_app(settings)
    serve(app, settings, host=settings.host, port=settings.port)
    return 0


BOOTSTRAP_LOCK_KEY = 0x5357_4254  # "SWBT": PostgreSQL advisory lock for the first admin key


async def _bootstrap_admin_key(settings: Settings) -> str | None:
    """The first start creates one admin key; later starts create none."""
    from sqlalchemy import text

    from tenancy import service
    from tenancy.db import make_engine, make_sessionmaker
    from tenancy.keys import load_or_create_pepper

    engine = make_engine(settings.database_url)
    try:
        async with make_sessionmaker(engine)() as session:
            if engine.dialect.name == "postgresql":
                # Replicas starting together on a new database: one creates the key, the
                # others wait here and then find it (the lock ends with the transaction).
                await session.execute(text("SELECT pg_advisory_xact_lock(:key)"),
                                      {"key": BOOTSTRAP_LOCK_KEY})
            if await service.count_admin_keys(session) > 0:
                return None
            pepper = load_or_create_pepper(secret_key=settings.secret_key,
                                           secret_file=settings.secret_file)
            _, full = await service.create_admin_key(session, pepper=pepper, name="bootstrap")
            return full
    finally:
        await engine.dispose()


def _worker_arguments(worker: argparse.ArgumentParser) -> None:
    """The worker's own flags, then one per engine argument (`workers.config`, declared once,
    with the serving defaults the gateway's embedded engine has too)."""
    from workers.config import SERVING_DEFAULTS, add_engine_arguments

    worker.add_argument("--served-model-name", default="smollm2-135m-instruct")
    worker.add_argument("--host", default="127.0.0.1")
    worker.add_argument("--port", type=int, default=8001)
    worker.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"),
                        default="hermes", help="how tool calls are read out of the model's text")
    worker.add_argument("--worker-id", default=None, help="default: host:port")
    worker.add_argument("--register-redis", default=None, metavar="URL",
                        help="announce this worker in Redis with heartbeats (gateway discovery)")
    worker.add_argument("--advertise-url", default=None,
                        help="the URL gateways reach this worker at (default: http(s)://host:port)")
    worker.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    worker.add_argument("--ssl-keyfile", default=None)
    worker.add_argument("--ssl-ca-certs", default=None,
                        help="require client certificates signed by this CA (mutual TLS)")
    add_engine_arguments(worker, defaults=SERVING_DEFAULTS)


def _refuse_model(model: str | None, setting: str) -> int:
    """A model folder whose architecture the engine does not serve: one line on stderr and
    exit status 2, before the database, the engine or the server start (0: go on). Read from
    config.json alone; what is not a folder with one is left to the engine to judge."""
    if model is None or not (Path(model) / "config.json").is_file():
        return 0
    from workers.runner.models import check_model_folder

    try:
        check_model_folder(model)
    except ValueError as exc:
        print(f"switchboard: {setting}={model}: {exc}", file=sys.stderr)
        return 2
    return 0


def _worker(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    if refused := _refuse_model(args.model, "--model"):
        return refused

    from pydantic import ValidationError

    from workers.async_engine import AsyncLLMEngine
    from workers.config import engine_args_from
    from workers.server import WorkerOptions, create_app
    from workers.telemetry import make_tracer_provider

    try:
        engine_args = engine_args_from(args)
    except ValidationError as exc:
        print(f"switchboard worker: {exc}", file=sys.stderr)
        return 2
    engine = AsyncLLMEngine(**engine_args.engine_kwargs())
    scheme = "https" if args.ssl_certfile else "http"
    advertise = args.advertise_url or f"{scheme}://{args.host}:{args.port}"
    options = WorkerOptions(
        model_name=args.served_model_name, secret=settings.worker_secret,
        worker_id=args.worker_id or f"{args.host}:{args.port}", advertise_url=advertise,
        redis_url=args.register_redis, heartbeat_ttl_s=settings.worker_heartbeat_ttl_s,
        tool_call_parser=args.tool_call_parser,
        tracer_provider=make_tracer_provider(
            service_name=_worker_service_name(settings), exporter=settings.otel_exporter,
            endpoint=settings.otel_endpoint, sample_ratio=settings.otel_sample_ratio),
    )
    tls: dict[str, object] = {}
    if args.ssl_certfile:
        tls = {"ssl_certfile": args.ssl_certfile, "ssl_keyfile": args.ssl_keyfile}
        if args.ssl_ca_certs:
            tls |= {"ssl_ca_certs": args.ssl_ca_certs, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    uvicorn.run(create_app(engine, options), host=args.host, port=args.port,
                log_level=settings.log_level, access_log=False, log_config=None, **tls)
    return 0


def _worker_service_name(settings: Settings) -> str:
    """The gateway's default service name is not the worker's; an explicit one is kept."""
    if "otel_service_name" in settings.model_fields_set:
        return settings.otel_service_name
    return "switchboard-worker"


if __name__ == "__main__":
    main()
