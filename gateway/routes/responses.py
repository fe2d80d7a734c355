"""OpenAI's Responses API, for tenant keys: create (the one request path), and the tenant's
stored responses by id (retrieve, delete, list input items). Another tenant's id is a 404,
as an unknown one is."""

from __future__ import annotations

import re
from typing import Literal

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from gateway.deps import StateDep, TenantDep
from gateway.errors import bad_request
from gateway.request_path import surface_route
from gateway.state import GatewayState
from gateway.surfaces import RESPONSES
from gateway.surfaces.responses import kept, missing
from tenancy.stored_responses import RESPONSE_ID_LENGTH, StoredResponse

router = APIRouter(prefix="/v1", tags=["responses"])
# What an id of ours can be; anything else (too long, a NUL PostgreSQL refuses) is no response.
RESPONSE_ID = re.compile(rf"[A-Za-z0-9_-]{{1,{RESPONSE_ID_LENGTH}}}")
# creating one is the surface: a plain route at the app's top level (`SurfaceEndpoint`)
routes = [surface_route("/v1/responses", RESPONSES)]


async def _stored(gw: GatewayState, response_id: str, tenant_id: str) -> StoredResponse:
    found = None if not RESPONSE_ID.fullmatch(response_id) else await kept(gw).find(
        response_id, tenant_id)
    if found is None:
        raise missing(response_id)
    return found


@router.get("/responses/{response_id}")
async def retrieve_response(response_id: str, key: TenantDep, gw: StateDep,
                            stream: bool = False) -> JSONResponse:
    """The stored Response, as it was answered (`include` changes nothing: what it could add
    is never produced here)."""
    if stream:
        raise bad_request("Streaming a stored response is not supported: responses here are "
                          "never in the background, so each is complete when stored.",
                          param="stream")
    return JSONResponse((await _stored(gw, response_id, key.tenant_id)).body)


@router.delete("/responses/{response_id}")
async def delete_response(response_id: str, key: TenantDep, gw: StateDep) -> JSONResponse:
    if not RESPONSE_ID.fullmatch(response_id) or not await kept(gw).remove(
            response_id, key.tenant_id):
        raise missing(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.get("/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str, key: TenantDep, gw: StateDep,
    order: Literal["asc", "desc"] = "desc", limit: int = Query(20, ge=1, le=100),
    after: str | None = None,
) -> JSONResponse:
    """The response's own input items (not those of the responses it continued), newest
    first unless `order=asc`, a page of `limit` after the item `after`."""
    items = list((await _stored(gw, response_id, key.tenant_id)).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise bad_request(f"No input item with id '{after}' in this response.",
                              param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page,
                         "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None,
                         "has_more": len(items) > limit})
