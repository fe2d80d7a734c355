"""Request bodies and error responses in OpenAI's shape, for the worker's routes."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from workers.engine.sampling_params import InvalidRequestError
from workers.openai_protocol import error_body

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


def error(status: int, message: str, *, code: str | None = None, param: str | None = None,
          type_: str | None = None) -> JSONResponse:
    kind = type_ or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(error_body(message, kind, code, param), status_code=status)
