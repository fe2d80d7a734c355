"""The shared secret between gateways and a worker, as a pure ASGI middleware.

Probes stay open so an orchestrator can check a worker without the secret; everything else
(generation, adapters, stats, metrics, drain) needs `Authorization: Bearer <secret>`.
For mutual TLS, run the worker with `--ssl-ca-certs` as well (docs/scaling.md).
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health/live", "/health/ready"})


class SharedSecretMiddleware:
    def __init__(self, app: ASGIApp, secret: str) -> None:
        self.app = app
        self._expected = f"Bearer {secret}".encode() if secret else b""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._expected or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {
            "message": "this worker needs the gateway's shared secret",
            "type": "invalid_request_error", "param": None, "code": "invalid_worker_secret",
        }}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"),
        ]})
        await send({"type": "http.response.body", "body": body})
