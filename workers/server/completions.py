"""OpenAI-compatible generation on this worker's engine, streamed or whole.

Two extensions the gateway uses: `cache_salt` (vLLM's name; the prefix-cache namespace, the
tenant by default) and `response_model` (what the response calls the model, so a tenant sees
`base:adapter` rather than the engine's tenant-scoped adapter name). A `model` that is not the
base model is an adapter registered here, or a 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from workers.async_engine import EngineDeadError
from workers.client import AnswerFailed, PreparedCall
from workers.engine.sampling_params import InvalidRequestError
from workers.llm_engine import EngineOverloadedError
from workers.protocol.events import Event, started
from workers.protocol.render import sse
from workers.server.http import error, request_body
from workers.server.state import WorkerState

DISCONNECT_POLL_S = 0.25


async def chat(request: Request) -> Response:
    return await _complete(request, chat=True)


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def _complete(request: Request, *, chat: bool) -> Response:
    state: WorkerState = request.app.state.worker
    kind = "chat" if chat else "completion"
    if state.draining or not state.ready:
        state.metrics.requests.labels(kind, "draining").inc()
        return error(503, "this worker is draining; send the request to another one",
                     code="worker_draining")
    state.in_flight += 1
    streaming = False
    try:
        body = await request_body(request, chat=chat)
        call = _prepare(state, body, chat=chat)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = await started(state.client.events(call, request_id=request_id))
            chunks = sse(events or _nothing(), chat=chat, include_usage=include_usage)
            streaming = True
            return StreamingResponse(_observed(chunks, call, state, kind),
                                     media_type="text/event-stream")
        final = await _until_done_or_disconnect(
            state.client.complete(call, request_id=request_id), request)
        if final is None:
            _finish(state, call, kind, "aborted")
            return Response(status_code=499)  # the client left; the work was aborted
        _finish(state, call, kind, "ok")
        return JSONResponse(final)
    except InvalidRequestError as exc:
        state.metrics.requests.labels(kind, "invalid").inc()
        status = 404 if exc.code == "model_not_found" else 400
        return error(status, str(exc), code=exc.code, param=exc.param)
    except EngineOverloadedError as exc:
        state.metrics.requests.labels(kind, "overloaded").inc()
        return error(503, str(exc), code="overloaded")
    except EngineDeadError:
        state.metrics.requests.labels(kind, "error").inc()
        return error(503, "the engine has failed", code="worker_failed")
    except AnswerFailed as exc:  # broke midway (a grammar error): no answer to give
        _finish(state, call, kind, "error")
        return error(exc.failed.status, exc.failed.message, code=exc.failed.code)
    finally:
        if not streaming:
            state.in_flight -= 1


async def _nothing() -> AsyncIterator[Event]:
    return
    yield


def _prepare(state: WorkerState, body: dict[str, Any], *, chat: bool) -> PreparedCall:
    model = body.get("model")
    lora = None
    if model not in (None, state.options.model_name):
        if not isinstance(model, str) or not state.serves_adapters:
            raise InvalidRequestError(f"model {model!r} does not exist", param="model",
                                      code="model_not_found")
        lora = model
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise InvalidRequestError("'cache_salt' must be a string", param="cache_salt")
    shown = body.get("response_model")
    if shown is not None and not isinstance(shown, str):
        raise InvalidRequestError("'response_model' must be a string", param="response_model")
    tenant = body.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise InvalidRequestError("'tenant' must be a string", param="tenant")
    weight = body.get("engine_weight", 1.0)
    if (isinstance(weight, bool) or not isinstance(weight, int | float)
            or not 0 < weight <= 100):
        raise InvalidRequestError("'engine_weight' must be a number in (0, 100]",
                                  param="engine_weight")
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError("'priority' must be an integer", param="priority")
    return state.client.prepare(body, chat=chat, cache_salt=salt, lora=lora,
                                model=shown or model or state.options.model_name,
                                tenant=tenant, weight=float(weight), priority=priority)


async def _observed(chunks: AsyncIterator[bytes], call: PreparedCall, state: WorkerState,
                    kind: str) -> AsyncIterator[bytes]:
    """The stream as it goes; counted once it ends, however it ends."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
        state.in_flight -= 1
        _finish(state, call, kind, "ok" if call.usage.finished else "aborted")


def _finish(state: WorkerState, call: PreparedCall, kind: str, status: str) -> None:
    state.metrics.observe(kind=kind, status=status, metrics=call.metrics,
                          prompt_tokens=call.usage.prompt_tokens,
                          completion_tokens=call.usage.completion_tokens)
    if state.on_finish is not None:
        state.on_finish(call)


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
