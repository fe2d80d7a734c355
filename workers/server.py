"""A minimal OpenAI-compatible HTTP front for one engine: a remote worker (`switchboard worker`).

It has no tenants or keys; it listens on loopback only unless told otherwise. The gateway
(gateway/) puts authentication, limits and routing in front of engines like this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers.async_engine import AsyncLLMEngine
from workers.client import EmbeddedClient
from workers.engine.sampling_params import InvalidRequestError
from workers.llm_engine import EngineOverloadedError
from workers.openai_protocol import error_body

MAX_BODY_BYTES = 4 << 20
DISCONNECT_POLL_S = 0.25


def create_app(engine: AsyncLLMEngine, model_name: str) -> Starlette:
    client = EmbeddedClient(engine, model_name)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.shutdown()

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", **engine.stats()})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "switchboard"}
        ]})

    async def chat(request: Request) -> Response:
        return await _complete(request, chat=True)

    async def completions(request: Request) -> Response:
        return await _complete(request, chat=False)

    async def _complete(request: Request, *, chat: bool) -> Response:
        try:
            body = await _json_body(request)
            if body.get("model") not in (None, model_name):
                return _error(404, f"model {body.get('model')!r} does not exist",
                              "invalid_request_error", "model_not_found")
            call = client.prepare(body, chat=chat)
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                chunks = await client.open_stream(call, request_id=request_id,
                                                  include_usage=include_usage)
                return StreamingResponse(chunks, media_type="text/event-stream")
            final = await _until_done_or_disconnect(
                client.complete(call, request_id=request_id), request
            )
            if final is None:
                return Response(status_code=499)  # the client left; the work was aborted
            return JSONResponse(final)
        except InvalidRequestError as exc:
            return _error(400, str(exc), "invalid_request_error", exc.code, exc.param)
        except EngineOverloadedError as exc:
            return _error(503, str(exc), "server_error", "overloaded")

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ],
        lifespan=lifespan,
    )


async def _until_done_or_disconnect(
    call: Awaitable[dict[str, Any]], request: Request
) -> dict[str, Any] | None:
    """The response, or None if the client disconnected first (the request is aborted)."""
    task = asyncio.ensure_future(call)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()  # closes the engine stream, which aborts the request
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise InvalidRequestError("request body too large")
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("body must be a JSON object")
    return body


def _error(
    status: int, message: str, type_: str, code: str | None = None, param: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code, param), status_code=status)
