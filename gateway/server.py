"""Serving the gateway app over HTTP, with the connection limits from `Settings`.

uvicorn (the default) runs with `gateway.http_guard`'s protocol, which adds the header-read
timeout, head size limit and connection cap that uvicorn lacks; granian (optional,
`pip install granian`) has its own. docs/security.md lists the limits and says why uvicorn is
the default (the measurement is in docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from fastapi import FastAPI

from gateway.http_guard import ConnectionLimits, guarded_protocol
from gateway.settings import Settings

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger(__name__)
GRANIAN_MIN_BUFFER = 65_536  # granian refuses a smaller read buffer


def connection_limits(settings: Settings) -> ConnectionLimits:
    return ConnectionLimits(max_header_bytes=settings.server_max_header_bytes,
                            header_read_timeout_s=settings.server_header_read_timeout_s,
                            max_connections=settings.server_max_connections)


def serve(app: FastAPI | None, settings: Settings, *, host: str, port: int) -> None:
    """Serve `app` until interrupted; granian builds its own app (`granian_app`), so it takes
    None."""
    logger.info("serving with %s on %s:%d: headers <= %d bytes within %.1f s, keep-alive "
                "%.1f s, <= %d connections", settings.server, host, port,
                settings.server_max_header_bytes, settings.server_header_read_timeout_s,
                settings.server_keep_alive_timeout_s, settings.server_max_connections)
    if settings.server == "granian":
        _serve_granian(settings, host=host, port=port)
        return
    import uvicorn

    if app is None:
        raise ValueError("uvicorn needs the app")
    uvicorn.Server(uvicorn_config(app, settings, host=host, port=port)).run()


def uvicorn_config(app: FastAPI, settings: Settings, *, host: str, port: int) -> uvicorn.Config:
    """uvicorn's configuration with the limits (the tests serve through it too)."""
    import uvicorn

    return uvicorn.Config(
        app, host=host, port=port, log_level=settings.log_level, access_log=False,
        log_config=None, http=guarded_protocol(connection_limits(settings)),
        timeout_keep_alive=max(1, math.ceil(settings.server_keep_alive_timeout_s)))


def _serve_granian(settings: Settings, *, host: str, port: int) -> None:
    """granian runs the app in a worker process of its own, built by `granian_app`.

    Its keep-alive cannot be timed (only on or off), and its connection cap is per worker
    (`backpressure`): past it, connections wait in the listen backlog."""
    from granian.constants import Interfaces
    from granian.http import HTTP1Settings
    from granian.server import Server

    http1 = HTTP1Settings(
        header_read_timeout=int(settings.server_header_read_timeout_s * 1000),
        max_buffer_size=max(GRANIAN_MIN_BUFFER, settings.server_max_header_bytes),
        keep_alive=settings.server_keep_alive_timeout_s > 0)
    Server("gateway.server:granian_app", address=host, port=port, interface=Interfaces.ASGI,
           factory=True, http1_settings=http1, backpressure=settings.server_max_connections,
           log_access=False).serve()


def granian_app() -> FastAPI:
    """granian's worker builds the app here, from the same `SWITCHBOARD_*` environment."""
    from gateway.app import create_app
    from gateway.observability.logs import configure_logging, configured_secrets

    settings = Settings()
    configure_logging(settings.log_level, settings.log_format,
                      secrets=configured_secrets(settings))
    return create_app(settings)
