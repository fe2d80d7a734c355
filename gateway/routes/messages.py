"""Anthropic's Messages API, for tenant keys (in `x-api-key` or `Authorization: Bearer`)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.admission import admit, counted_if_refused, limit_scopes
from gateway.deployments.base import Call, Deployment
from gateway.observability.metrics import OTHER
from gateway.request_path import asked_tier, credentials, first_that_fits, surface_route
from gateway.routing.router import plan_route
from gateway.state import GatewayState
from gateway.surfaces import MESSAGES, anthropic
from tenancy.limits import AdmissionRequest

router = APIRouter(prefix="/v1", tags=["anthropic"])
# the surface: a plain route at the app's top level (`request_path.SurfaceEndpoint`)
routes = [surface_route("/v1/messages", MESSAGES)]


@router.post("/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    """The prompt's tokens on the deployment the model routes to: exact where its tokenizer
    runs here (in a thread), the admission estimate for an upstream. It counts against the
    key's RPM (tokenizing is work), and reserves no tokens. The client's `anthropic-version`
    and `anthropic-beta` are checked as on /v1/messages (a 400 naming the header)."""
    gw: GatewayState = request.app.state.gateway
    key = await gw.keys.tenant(credentials(request, MESSAGES))
    admission = AdmissionRequest(request_id=f"count-{uuid.uuid4().hex}",
                                 scopes=limit_scopes(key), tokens=0)
    await admit(gw, admission, key=key, model=OTHER, adapter=False)
    gw.spawn(gw.limiter.settle(admission, tokens=0, cost_micros=0))
    async with counted_if_refused(gw, key):
        body = anthropic.with_headers(anthropic.parse(await request.body(), count_only=True),
                                      request.headers)
        plan = await plan_route(gw.deployments, gw.adapters, key, body.model,
                                tier=asked_tier(request.headers), logprobs=False, request=body)

        def prepare(deployment: Deployment) -> Call:
            return deployment.prepare(body, chat=True, tenant_id=key.tenant_id,
                                      adapter=plan.adapter)

        _, call = await first_that_fits(plan.order, prepare)
    return JSONResponse({"input_tokens": call.prompt_tokens})
