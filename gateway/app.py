"""The app factory: routes, error shapes, middleware, and a lifespan that owns all resources."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from gateway.auth_throttle import AuthThrottle, FailureThrottle
from gateway.batches.files import FileStore
from gateway.batches.worker import BatchWorker
from gateway.body_guard import BodyRefused
from gateway.console import auth as console_auth
from gateway.console import router as console_router
from gateway.errors import APIError, error_body
from gateway.middleware import AdminGuard, GatewayMiddleware, TenantUploadGuard
from gateway.routes import (
    adapters,
    batches,
    embeddings,
    files,
    health,
    messages,
    metrics,
    openai,
    responses,
    tenant,
    usage,
)
from gateway.routes.admin import router as admin_router
from gateway.settings import Settings
from gateway.state import close_state, open_state
from tenancy.errors import ConflictError, InvalidError, NotFoundError, ServiceError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from workers.async_engine import AsyncLLMEngine


def tune_collector(settings: Settings) -> None:
    """Once started: collect once, then keep what is left (built at startup, alive for the
    process's life) out of later collections, so a full collection walks only what requests
    allocate; and collect young objects less often than Python's default."""
    if settings.gc_freeze:
        gc.collect()
        gc.freeze()
    if settings.gc_thresholds is not None:
        gc.set_threshold(*settings.gc_thresholds)


def create_app(settings: Settings | None = None, *, engine: AsyncLLMEngine | None = None,
               tracer_provider: TracerProvider | None = None) -> FastAPI:
    """`engine`: an engine to embed (the app starts and stops it); otherwise settings decide.
    `tracer_provider`: where this app's spans go (tests; the caller shuts it down); otherwise
    the `otel_*` settings make one, or none."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.gateway = await open_state(settings, engine=engine,
                                             tracer_provider=tracer_provider)
        app.state.batch_worker = None
        try:
            if settings.batch_worker:  # tenants' batches, in the background (stopped first)
                worker = BatchWorker(app.state.gateway, FileStore(settings.files_dir))
                await worker.start()
                app.state.batch_worker = worker
            tune_collector(settings)
            yield
        finally:
            try:
                if app.state.batch_worker is not None:
                    await app.state.batch_worker.stop()
            finally:
                await close_state(app.state.gateway)

    # FastAPI's own OpenTelemetry is off: the gateway's spans are the one source (and its check
    # ran on every request).
    app = FastAPI(title="Switchboard", lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    for module in (responses, messages, embeddings, openai):  # the surfaces, matched first
        app.router.routes[:0] = module.routes
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(openai.router)
    app.include_router(messages.router)
    app.include_router(responses.router)
    app.include_router(usage.router)  # before tenant's: its /v1/usage supersedes that one
    app.include_router(tenant.router)
    app.include_router(adapters.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(admin_router)
    app.include_router(console_router)  # the admin web console at /console
    app.add_middleware(AdminGuard)  # admin auth before any body is parsed
    app.add_middleware(TenantUploadGuard, path=adapters.UPLOAD_PATH)
    app.add_middleware(TenantUploadGuard, path=files.FILES_PATH)
    app.add_middleware(AuthThrottle, throttle=FailureThrottle(  # before any key is looked at
        free=settings.auth_failures_free, max_s=settings.auth_backoff_max_s,
        max_sources=settings.auth_throttle_max_sources))
    app.add_middleware(GatewayMiddleware, max_body_bytes=settings.max_body_bytes,
                       body_timeout_s=settings.body_read_timeout_s,
                       max_upload_bytes=settings.max_adapter_upload_bytes,
                       upload_timeout_s=settings.adapter_upload_read_timeout_s,
                       max_file_bytes=settings.max_file_bytes,
                       file_timeout_s=settings.file_upload_read_timeout_s,
                       login_path=console_auth.LOGIN_PATH,
                       max_login_bytes=settings.max_login_body_bytes)
    _add_error_handlers(app)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body("We could not parse the JSON body of your request.",
                                           "invalid_request_error", "invalid_json"),
                                status_code=400)
        loc = [str(p) for p in first.get("loc", ())]
        if loc and loc[0] in ("body", "query", "path", "header", "cookie"):
            loc = loc[1:]  # where it came from, not a field (a field may be called "path")
        param = ".".join(loc) or None
        message = f"Invalid value for '{param}': {first.get('msg')}." if param else str(
            first.get("msg", "Invalid request."))
        return JSONResponse(error_body(message, "invalid_request_error", "invalid_value", param),
                            status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        if isinstance(exc, BodyRefused):  # 413 or 408 while the body was being received
            return exc.response(request.url.path)
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "body_too_large" if exc.status_code == 413 else None
        return JSONResponse(error_body(str(exc.detail), type_, code),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, exc: ServiceError) -> Response:
        status = {ConflictError: 409, NotFoundError: 404, InvalidError: 400}.get(type(exc), 400)
        return JSONResponse(error_body(str(exc), "invalid_request_error"), status_code=status)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        # Logged by GatewayMiddleware, inside the request's log context and span: this
        # handler runs outside every middleware, where the request's ids are gone.
        return APIError(500, "The server had an error processing your request.",
                        type_="server_error").response(request.url.path)
