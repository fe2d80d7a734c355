"""The worker's app: generation, adapters, probes, stats, metrics and drain.

It has no tenants or keys of its own: gateways put authentication, limits and routing in
front and prove themselves with the shared secret. Probes are open; all else needs it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from workers.async_engine import AsyncLLMEngine
from workers.client import PreparedCall
from workers.server import adapters, completions
from workers.server.auth import SharedSecretMiddleware
from workers.server.http import error
from workers.server.registration import Heartbeat
from workers.server.state import WorkerOptions, WorkerState
from workers.telemetry import TraceMiddleware, record_engine_spans

logger = logging.getLogger(__name__)

__all__ = ["WorkerOptions", "create_app"]


def create_app(engine: AsyncLLMEngine, options: WorkerOptions) -> Starlette:
    state = WorkerState(engine, options)
    if options.tracer_provider is not None:
        state.on_finish = functools.partial(_record_spans, options.tracer_provider)
    heartbeat = None if not options.redis_url else Heartbeat(
        options.redis_url, worker_id=options.worker_id, ttl_s=options.heartbeat_ttl_s,
        describe=state.describe)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        state.ready = True
        logger.info("worker %s ready: model %s", options.worker_id, options.model_name)
        if heartbeat is not None:
            await heartbeat.start()
        try:
            yield
        finally:
            state.ready = False
            if heartbeat is not None:
                await heartbeat.stop()
            await engine.shutdown()
            if options.tracer_provider is not None:
                options.tracer_provider.shutdown()  # flushes batched spans

    app = Starlette(
        routes=[
            Route("/health", ready),
            Route("/health/live", live),
            Route("/health/ready", ready),
            Route("/stats", stats),
            Route("/metrics", metrics),
            Route("/admin/drain", drain, methods=["POST"]),
            Route("/v1/models", models),
            Route("/v1/chat/completions", completions.chat, methods=["POST"]),
            Route("/v1/completions", completions.completions, methods=["POST"]),
            Route("/v1/lora_adapters", adapters.list_adapters),
            Route("/v1/load_lora_adapter", adapters.load_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", adapters.unload_adapter, methods=["POST"]),
        ],
        middleware=[Middleware(SharedSecretMiddleware, secret=options.secret),
                    Middleware(TraceMiddleware, tracer_provider=options.tracer_provider)],
        lifespan=lifespan,
    )
    app.state.worker = state
    return app


def _record_spans(provider: object, call: PreparedCall) -> None:
    """The engine's queue, prefill and decode, under this request's server span."""
    if call.metrics is not None:
        record_engine_spans(provider, call.metrics,  # type: ignore[arg-type]
                            prompt_tokens=call.usage.prompt_tokens,
                            cached_tokens=call.usage.cached_tokens,
                            completion_tokens=call.usage.completion_tokens)


async def live(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """200 while this worker takes new requests; 503 while loading or draining."""
    state: WorkerState = request.app.state.worker
    if not state.ready:
        return JSONResponse({"status": "loading"}, status_code=503)
    if state.draining:
        return JSONResponse({"status": "draining", "in_flight": state.in_flight},
                            status_code=503)
    return JSONResponse({"status": "ok", **state.engine_stats()})


async def stats(request: Request) -> Response:
    state: WorkerState = request.app.state.worker
    return JSONResponse(await state.describe())


async def metrics(request: Request) -> Response:
    state: WorkerState = request.app.state.worker
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def drain(request: Request) -> Response:
    """Stop taking requests (`{"drain": false}` resumes); those in flight run to the end."""
    state: WorkerState = request.app.state.worker
    try:
        body = await request.json() if await request.body() else {}
    except ValueError:
        return error(400, "body is not valid JSON")
    on = body.get("drain", True) if isinstance(body, dict) else None
    if not isinstance(on, bool):
        return error(400, "'drain' must be a boolean", param="drain")
    state.draining = on
    logger.info("worker %s %s", state.options.worker_id, "draining" if on else "resumed")
    return JSONResponse({"draining": state.draining, "in_flight": state.in_flight})


async def models(request: Request) -> Response:
    """The model and its loaded adapters, shaped as vLLM lists them: an adapter's `id` is its
    name, `parent` the base model's and `root` where it was loaded from; the base model's
    `root` is its path, its `parent` null."""
    state: WorkerState = request.app.state.worker
    base = state.options.model_name
    core = state.engine.engine
    card = {"object": "model", "created": 0, "owned_by": "switchboard"}
    data = [{"id": base, **card, "root": (core.args.model if core else None) or base,
             "parent": None, "max_model_len": core.max_model_len if core else None}]
    data += [{"id": name, **card, "root": state.adapter_path(name) or name, "parent": base}
             for name in sorted(await state.adapters())]
    return JSONResponse({"object": "list", "data": data})
