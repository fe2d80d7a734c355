"""The auth version: every tenancy mutation commits itself and bumps `AuthState.version` in
the same transaction, so replicas polling the version drop their key caches as soon as the
change is visible."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from tenancy.errors import ConflictError
from tenancy.models import AUTH_STATE_ID, AuthState


async def auth_version(session: AsyncSession) -> int:
    """The current auth version (0 before the first mutation)."""
    version = await session.scalar(select(AuthState.version).where(AuthState.id == AUTH_STATE_ID))
    return int(version or 0)


async def _bump_auth_version(session: AsyncSession) -> None:
    result = await session.execute(
        update(AuthState)
        .where(AuthState.id == AUTH_STATE_ID)
        .values(version=AuthState.version + 1)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount == 0:  # tables made without the migration's seed row
        session.add(AuthState(id=AUTH_STATE_ID, version=1))


async def commit_mutation(session: AsyncSession, what: str) -> None:
    """Bump the version and commit; a unique/foreign-key violation becomes ConflictError."""
    try:
        await session.flush()  # constraint violations surface here, before the bump
        await _bump_auth_version(session)
        await session.commit()
    except IntegrityError as exc:
        await session.rollback()
        raise ConflictError(f"{what} conflicts with existing data") from exc
