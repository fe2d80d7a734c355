"""Prometheus scrapes: not behind tenant auth, behind a token of their own.

The counters name every tenant, so without `metrics_token` they are served only while the
gateway is bound to loopback (`host`); bound to anything else, a scrape needs the token, and
`switchboard serve` says at start which of the two holds.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from gateway.addresses import is_loopback
from gateway.deps import StateDep
from gateway.errors import APIError
from gateway.settings import Settings

router = APIRouter(tags=["metrics"])
logger = logging.getLogger(__name__)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request, state: StateDep) -> Response:
    token = state.settings.metrics_token
    if token and not _bearer_matches(request.headers.get("authorization"), token):
        raise APIError(401, "A valid metrics token is required: 'Authorization: Bearer <token>'.",
                       code="invalid_metrics_token")
    if not token and not is_loopback(state.settings.host):
        raise APIError(403, "/metrics needs SWITCHBOARD_METRICS_TOKEN when the gateway is not "
                       "bound to loopback.", type_="permission_error",
                       code="metrics_token_required")
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def announce_metrics_access(settings: Settings) -> None:
    """The start-up line that says who may scrape /metrics."""
    if settings.metrics_token:
        logger.info("/metrics requires the metrics token")
    elif is_loopback(settings.host):
        logger.info("/metrics is open on loopback (%s); set SWITCHBOARD_METRICS_TOKEN before "
                    "binding elsewhere", settings.host)
    else:
        logger.warning("/metrics is refused: bound to %s without SWITCHBOARD_METRICS_TOKEN",
                       settings.host)


def _bearer_matches(header: str | None, token: str) -> bool:
    """Constant-time, so response times do not leak how much of a guess was right."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())
