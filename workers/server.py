"""A minimal OpenAI-compatible HTTP front for one engine: what `make serve` runs today.

It has no tenants or keys; it listens on loopback only unless told otherwise. The gateway
(gateway/) puts authentication, limits and routing in front of engines like this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from workers.async_engine import AsyncLLMEngine
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import InvalidRequestError
from workers.llm_engine import EngineOverloadedError
from workers.openai_protocol import error_body, sampling_params

MAX_BODY_BYTES = 4 << 20
DISCONNECT_POLL_S = 0.25


def create_app(engine: AsyncLLMEngine, model_name: str) -> Starlette:
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
            params = sampling_params(body, chat=chat)
            prompt = _prompt(body, chat=chat, tokenizer=engine.tokenizer)
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            stream = engine.generate(prompt, params, request_id)
            if body.get("stream"):
                first = await anext(stream)  # surfaces validation errors as HTTP errors
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return StreamingResponse(
                    _sse(first, stream, request_id, model_name, chat, include_usage),
                    media_type="text/event-stream",
                )
            final = await _until_done_or_disconnect(stream, request)
            if final is None:
                return Response(status_code=499)  # the client left; the work was aborted
            return JSONResponse(_response(final, request_id, model_name, chat))
        except InvalidRequestError as exc:
            return _error(400, str(exc), "invalid_request_error")
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
    stream: AsyncIterator[RequestOutput], request: Request
) -> RequestOutput | None:
    """The final output, or None if the client disconnected first (the request is aborted)."""

    async def last() -> RequestOutput:
        final = None
        async for final in stream:  # noqa: B007 - the last output is the answer
            pass
        assert final is not None
        return final

    task = asyncio.create_task(last())
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


def _prompt(body: dict[str, Any], *, chat: bool, tokenizer: Any) -> str | list[int]:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str) for m in messages
        ):
            raise InvalidRequestError("'messages' must be a non-empty list of "
                                      "{role: system|user|assistant, content: string}")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    ):
        return prompt
    raise InvalidRequestError("'prompt' must be a string or a list of token ids")


def _error(status: int, message: str, type_: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code), status_code=status)


def _usage(out: RequestOutput) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in out.outputs)
    prompt = len(out.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _response(out: RequestOutput, request_id: str, model: str, chat: bool) -> dict[str, Any]:
    choices = []
    for c in out.outputs:
        choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason,
                                  "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        choices.append(choice)
    return {
        "id": request_id, "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": model, "choices": choices, "usage": _usage(out),
    }


async def _sse(
    first: RequestOutput, rest: AsyncIterator[RequestOutput], request_id: str, model: str,
    chat: bool, include_usage: bool,
) -> AsyncIterator[bytes]:
    """Text deltas per choice; leaving early (client gone) closes `rest`, aborting upstream."""
    sent: dict[int, int] = {}
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        data = {"id": request_id, "object": kind, "created": created, "model": model,
                "choices": choices}
        if include_usage:
            data["usage"] = usage
        return f"data: {json.dumps(data)}\n\n".encode()

    async def outputs() -> AsyncIterator[RequestOutput]:
        yield first
        async for out in rest:
            yield out

    last = first
    try:
        async for out in outputs():
            last = out
            choices = []
            for c in out.outputs:
                is_first = c.index not in sent
                delta = c.text[sent.get(c.index, 0):]
                if not delta and c.finish_reason is None and not is_first:
                    continue
                sent[c.index] = len(c.text)
                if chat:
                    piece: dict[str, Any] = {"content": delta}
                    if is_first:
                        piece["role"] = "assistant"
                    choices.append({"index": c.index, "delta": piece,
                                    "finish_reason": c.finish_reason})
                else:
                    choices.append({"index": c.index, "text": delta,
                                    "finish_reason": c.finish_reason})
            if choices:
                yield chunk(choices)
        if include_usage:
            yield chunk([], _usage(last))
        yield b"data: [DONE]\n\n"
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
