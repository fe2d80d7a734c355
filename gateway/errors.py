"""Every error leaves the gateway in the shape of the API it came in on: OpenAI's
{"error": {message, type, param, code}}, or under /v1/messages Anthropic's
{"type": "error", "error": {type, message}} (overloaded there is its 529)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse


class APIError(Exception):
    """An error meant for the client, with its HTTP status and OpenAI error fields."""

    def __init__(
        self, status: int, message: str, *, type_: str = "invalid_request_error",
        code: str | None = None, param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)

    def response(self, path: str = "") -> JSONResponse:
        """The error as answered on `path` (the API's shape follows the path)."""
        if is_anthropic(path):
            return JSONResponse(anthropic_error(self.status, self.message),
                                status_code=529 if self.status == 503 else self.status,
                                headers=self.headers)
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


ANTHROPIC_PATH = "/v1/messages"
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
    403: "permission_error", 404: "not_found_error", 408: "timeout_error",
    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
    529: "overloaded_error"}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_type(status: int) -> str:
    return ANTHROPIC_ERROR_TYPES.get(
        status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key")


def forbidden(message: str, *, code: str = "permission_denied") -> APIError:
    return APIError(403, message, type_="permission_error", code=code)


def not_found(message: str, *, code: str = "not_found", param: str | None = None) -> APIError:
    return APIError(404, message, code=code, param=param)


def model_not_found(model: str) -> APIError:
    return not_found(f"The model '{model}' does not exist or you do not have access to it.",
                     code="model_not_found", param="model")


def conflict(message: str) -> APIError:
    return APIError(409, message, code="conflict")


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than {limit} bytes.", code="body_too_large")


def body_timeout(timeout_s: float) -> APIError:
    return APIError(408, f"The request body did not arrive within {timeout_s:g} seconds.",
                    code="body_timeout")


def unavailable(message: str, *, code: str = "overloaded") -> APIError:
    return APIError(503, message, type_="server_error", code=code)


def bad_gateway(message: str, *, status: int = 502, code: str = "upstream_error") -> APIError:
    return APIError(status, message, type_="server_error", code=code)
