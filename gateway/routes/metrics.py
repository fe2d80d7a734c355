"""Prometheus scrapes: not behind tenant auth, optionally behind a token of its own."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from gateway.deps import StateDep
from gateway.errors import APIError

router = APIRouter(tags=["metrics"])


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request, state: StateDep) -> Response:
    token = state.settings.metrics_token
    if token and not _bearer_matches(request.headers.get("authorization"), token):
        raise APIError(401, "A valid metrics token is required: 'Authorization: Bearer <token>'.",
                       code="invalid_metrics_token")
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _bearer_matches(header: str | None, token: str) -> bool:
    """Constant-time, so response times do not leak how much of a guess was right."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())
