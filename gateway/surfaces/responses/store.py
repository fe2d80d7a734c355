"""The tenant's stored responses, as this surface uses them: the answer kept when it finishes
(unless `store` is false), found again by `previous_response_id` and the `/v1/responses/{id}`
routes (`tenancy.stored_responses`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.errors import APIError, not_found
from gateway.surfaces.responses.objects import from_fold
from gateway.surfaces.responses.turn import turn_of
from tenancy import stored_responses
from workers.protocol.render import Fold

if TYPE_CHECKING:
    from gateway.state import GatewayState
    from gateway.ticket import Ticket


def kept(gw: GatewayState) -> stored_responses.Keeper:
    """The gateway's stored responses (writes queued off the answer's path, reads that see
    them: `tenancy.stored_responses.Keeper`)."""
    return stored_responses.Keeper(gw.sessionmaker, gw.spawn)


async def keep(ticket: Ticket, fold: Fold) -> None:
    """Store a finished answer for its tenant (unless `store` is false): queued before its
    last byte leaves and written in the background, so a client that saw it complete finds it
    (`Keeper.find` waits for the write). A failed write costs the client nothing but the
    stored copy (logged)."""
    turn = turn_of(ticket.call.request)
    if not turn.store:
        return
    body = from_fold(turn, fold)
    if body["status"] not in ("completed", "incomplete"):
        return
    kept(ticket.gw).keep(
        response_id=turn.response_id, tenant_id=ticket.key.tenant_id, status=body["status"],
        previous_response_id=turn.previous_response_id, body=body,
        input_items=turn.input_items, history=turn.history)


def missing(response_id: str) -> APIError:
    return not_found(f"Response with id '{response_id}' not found.", param="response_id")
