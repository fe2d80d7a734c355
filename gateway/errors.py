"""Every error leaves the gateway in OpenAI's shape: {"error": {message, type, param, code}}."""

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

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


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
