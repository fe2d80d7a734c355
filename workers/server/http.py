"""Request bodies and error responses in OpenAI's shape, for the worker's routes."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from workers.engine.sampling_params import InvalidRequestError
from workers.openai_protocol import error_body
from workers.protocol.requests import RequestError, parse_request

MAX_BODY_BYTES = 4 << 20


async def json_body(request: Request) -> dict[str, Any]:
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


# What a worker takes besides OpenAI's fields: the gateway's prefix-cache namespace, the name
# the response gives the model, and whom the fair-share scheduler charges (tenant, its weight,
# the priority within it); see workers/server/completions.py.
WORKER_FIELDS = frozenset({"cache_salt", "response_model", "tenant", "engine_weight",
                           "priority"})


async def request_body(request: Request, *, chat: bool) -> dict[str, Any]:
    """The body checked with the gateway's own request models (workers.protocol.requests):
    the same 400 for the same mistake, and a field the engine does not know is refused by
    name rather than ignored."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise InvalidRequestError("request body too large")
    try:
        parsed = parse_request(raw, chat=chat)
    except RequestError as exc:
        raise InvalidRequestError(str(exc), param=exc.param, code=exc.code) from None
    for name in parsed.extra_fields():
        if name not in WORKER_FIELDS:
            raise InvalidRequestError(f"Unrecognized request argument supplied: {name}",
                                      param=name, code="unsupported_parameter")
    return parsed.upstream_body()


def error(status: int, message: str, *, code: str | None = None, param: str | None = None,
          type_: str | None = None) -> JSONResponse:
    kind = type_ or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(error_body(message, kind, code, param), status_code=status)
