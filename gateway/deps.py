"""Typed dependencies for routes: the app state, a DB session, and who is calling."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.state import GatewayState
from tenancy.context import AdminContext, KeyContext


def get_state(request: Request) -> GatewayState:
    return request.app.state.gateway


StateDep = Annotated[GatewayState, Depends(get_state)]


async def get_session(state: StateDep) -> AsyncIterator[AsyncSession]:
    async with state.sessionmaker() as session:
        yield session


SessionDep = Annotated[AsyncSession, Depends(get_session)]


async def get_tenant_key(request: Request, state: StateDep) -> KeyContext:
    return await state.keys.tenant(request.headers.get("authorization"))


TenantDep = Annotated[KeyContext, Depends(get_tenant_key)]


def get_admin(request: Request) -> AdminContext:
    """Authenticated by `AdminGuard` before the route (and its body) was reached."""
    return request.state.admin


AdminDep = Annotated[AdminContext, Depends(get_admin)]
