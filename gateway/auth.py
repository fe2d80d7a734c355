"""API key authentication without a database query on the hot path.

Key contexts are cached per key id after one lookup. Every mutation of keys, tenants, plans or
adapters bumps a version row in the database; each replica polls it (default every 0.5 s) and
drops its caches (keys, and tenant adapters: `gateway.adapters.cache`) when it moves, so a
revocation reaches every replica well within 2 seconds. The replica that made the change
catches up at once (`AuthWatcher.catch_up`).
Unknown key ids are cached too (bounded), so random keys cannot hammer the database.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Sequence
from typing import Protocol, TypeVar

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.errors import forbidden, unauthorized
from gateway.lookup import LookupCache
from tenancy.admin_keys import load_admin_context
from tenancy.api_keys import load_key_context
from tenancy.auth_state import auth_version
from tenancy.context import AdminContext, KeyContext
from tenancy.keys import parse_key, verify_secret
from workers.periodic import Periodic

logger = logging.getLogger(__name__)
T = TypeVar("T", KeyContext, AdminContext)
T_co = TypeVar("T_co", KeyContext, AdminContext, covariant=True)


class _Loader(Protocol[T_co]):
    def __call__(self, session: AsyncSession, *, key_id: str) -> Awaitable[T_co | None]: ...


def bearer_token(authorization: str | None) -> str:
    if not authorization:
        raise unauthorized("You didn't provide an API key. Send 'Authorization: Bearer <key>'.")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise unauthorized("Malformed Authorization header; expected 'Bearer <key>'.")
    return token.strip()


class KeyCache:
    def __init__(
        self, sessionmaker: async_sessionmaker[AsyncSession], pepper: bytes,
        *, negative_size: int = 10_000,
    ) -> None:
        self._sessionmaker = sessionmaker
        self.pepper = pepper
        self._tenant: LookupCache[str, KeyContext] = LookupCache(negative_size)
        self._admin: LookupCache[str, AdminContext] = LookupCache(negative_size)

    def clear(self) -> None:
        self._tenant.clear()
        self._admin.clear()

    async def tenant(self, authorization: str | None) -> KeyContext:
        """The caller's key context, or a 401/403 APIError."""
        parsed = parse_key(bearer_token(authorization))
        if parsed is None or parsed.admin:
            raise unauthorized("Incorrect API key provided.")
        ctx = await self._lookup(self._tenant, parsed.key_id, load_key_context)
        if ctx is None or not verify_secret(self.pepper, parsed.secret, ctx.secret_hash):
            raise unauthorized("Incorrect API key provided.")
        reason = ctx.usable(time.time())
        if reason == "tenant suspended":
            raise forbidden("This tenant is suspended.", code="tenant_suspended")
        if reason is not None:
            raise unauthorized(f"This API key is {reason}.")
        return ctx

    async def tenant_by_id(self, key_id: str) -> KeyContext:
        """A key's context by its id, for work it started earlier (a batch's lines, answered
        long after the request that created the batch): the same cache, and the same 401/403
        as `tenant` once the key is revoked or expired or its tenant suspended. No secret is
        checked: it is not kept."""
        ctx = await self._lookup(self._tenant, key_id, load_key_context)
        if ctx is None:
            raise unauthorized("The API key that created this batch no longer exists.")
        reason = ctx.usable(time.time())
        if reason == "tenant suspended":
            raise forbidden("This tenant is suspended.", code="tenant_suspended")
        if reason is not None:
            raise unauthorized(f"The API key that created this batch is {reason}.")
        return ctx

    async def admin(self, authorization: str | None) -> AdminContext:
        parsed = parse_key(bearer_token(authorization))
        if parsed is None:
            raise unauthorized("Incorrect API key provided.")
        if not parsed.admin:
            raise forbidden("This endpoint needs an admin key.")
        ctx = await self._lookup(self._admin, parsed.key_id, load_admin_context)
        if ctx is None or ctx.revoked or not verify_secret(
            self.pepper, parsed.secret, ctx.secret_hash
        ):
            raise unauthorized("Incorrect API key provided.")
        return ctx

    async def _lookup(self, cache: LookupCache[str, T], key_id: str, load: _Loader[T]
                      ) -> T | None:
        async def query() -> T | None:
            async with self._sessionmaker() as session:
                return await load(session, key_id=key_id)

        return await cache.get(key_id, query)


class Clearable(Protocol):
    def clear(self) -> None: ...


class AuthWatcher:
    """Polls the auth version and clears the caches (keys, adapters) when it changes."""

    def __init__(self, caches: Sequence[Clearable],
                 sessionmaker: async_sessionmaker[AsyncSession], *, interval_s: float) -> None:
        self._caches = tuple(caches)
        self.version: int | None = None
        self._sessionmaker = sessionmaker
        # Keep serving from the cache when the database does not answer (availability);
        # revocations then wait for it.
        self._loop = Periodic(self.check, interval_s=interval_s, name="auth-watcher",
                              survive=(SQLAlchemyError, OSError))

    async def start(self) -> None:
        await self.check()
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def check(self) -> None:
        async with self._sessionmaker() as session:
            version = await auth_version(session)
        if version != self.version:
            self.version = version
            for cache in self._caches:
                cache.clear()

    async def catch_up(self) -> None:
        """After a mutation through this replica: apply it here now, not at the next poll."""
        try:
            await self.check()
        except (SQLAlchemyError, OSError) as exc:  # committed anyway; the next poll applies it
            logger.warning("auth version check failed: %s", type(exc).__name__)
