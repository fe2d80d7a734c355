"""API key authentication without a database query on the hot path.

Key contexts are cached per key id after one lookup. Every mutation of keys, tenants or plans
bumps a version row in the database; each replica polls it (default every 0.5 s) and drops
its cache when it moves, so a revocation reaches every replica well within 2 seconds. The
replica that made the change catches up at once (`AuthWatcher.catch_up`).
Unknown key ids are cached too (bounded), so random keys cannot hammer the database.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import Generic, Protocol, TypeVar

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.errors import forbidden, unauthorized
from tenancy import service
from tenancy.context import AdminContext, KeyContext
from tenancy.keys import parse_key, verify_secret

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


class _Cache(Generic[T]):
    """Positive and (bounded) negative entries, with one database load per key at a time."""

    def __init__(self, negative_size: int) -> None:
        self.found: dict[str, T] = {}
        self.missing: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.loading: dict[str, asyncio.Future[T | None]] = {}
        self._negative_size = negative_size

    def clear(self) -> None:
        self.found.clear()
        self.missing.clear()

    def remember_missing(self, key_id: str) -> None:
        self.missing[key_id] = None
        if len(self.missing) > self._negative_size:
            self.missing.popitem(last=False)


class KeyCache:
    def __init__(
        self, sessionmaker: async_sessionmaker[AsyncSession], pepper: bytes,
        *, negative_size: int = 10_000,
    ) -> None:
        self._sessionmaker = sessionmaker
        self.pepper = pepper
        self._tenant: _Cache[KeyContext] = _Cache(negative_size)
        self._admin: _Cache[AdminContext] = _Cache(negative_size)
        self.version: int | None = None

    def clear(self) -> None:
        self._tenant.clear()
        self._admin.clear()

    async def tenant(self, authorization: str | None) -> KeyContext:
        """The caller's key context, or a 401/403 APIError."""
        parsed = parse_key(bearer_token(authorization))
        if parsed is None or parsed.admin:
            raise unauthorized("Incorrect API key provided.")
        ctx = await self._lookup(self._tenant, parsed.key_id, service.load_key_context)
        if ctx is None or not verify_secret(self.pepper, parsed.secret, ctx.secret_hash):
            raise unauthorized("Incorrect API key provided.")
        reason = ctx.usable(time.time())
        if reason == "tenant suspended":
            raise forbidden("This tenant is suspended.", code="tenant_suspended")
        if reason is not None:
            raise unauthorized(f"This API key is {reason}.")
        return ctx

    async def admin(self, authorization: str | None) -> AdminContext:
        parsed = parse_key(bearer_token(authorization))
        if parsed is None:
            raise unauthorized("Incorrect API key provided.")
        if not parsed.admin:
            raise forbidden("This endpoint needs an admin key.")
        ctx = await self._lookup(self._admin, parsed.key_id, service.load_admin_context)
        if ctx is None or ctx.revoked or not verify_secret(
            self.pepper, parsed.secret, ctx.secret_hash
        ):
            raise unauthorized("Incorrect API key provided.")
        return ctx

    async def _lookup(self, cache: _Cache[T], key_id: str, load: _Loader[T]) -> T | None:
        if key_id in cache.found:
            return cache.found[key_id]
        if key_id in cache.missing:
            return None
        pending = cache.loading.get(key_id)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[T | None] = asyncio.get_running_loop().create_future()
        cache.loading[key_id] = future
        version = self.version
        try:
            async with self._sessionmaker() as session:
                ctx = await load(session, key_id=key_id)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it, nobody logs it twice
            raise
        finally:
            cache.loading.pop(key_id, None)
        if version == self.version:  # no invalidation raced with this load
            if ctx is None:
                cache.remember_missing(key_id)
            else:
                cache.found[key_id] = ctx
        future.set_result(ctx)
        return ctx


class AuthWatcher:
    """Polls the auth version and clears the key cache when it changes."""

    def __init__(self, cache: KeyCache, sessionmaker: async_sessionmaker[AsyncSession],
                 *, interval_s: float) -> None:
        self._cache = cache
        self._sessionmaker = sessionmaker
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.check()
        self._task = asyncio.create_task(self._run(), name="auth-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def check(self) -> None:
        async with self._sessionmaker() as session:
            version = await service.auth_version(session)
        if version != self._cache.version:
            self._cache.version = version
            self._cache.clear()

    async def catch_up(self) -> None:
        """After a mutation through this replica: apply it here now, not at the next poll."""
        try:
            await self.check()
        except (SQLAlchemyError, OSError) as exc:  # committed anyway; the next poll applies it
            logger.warning("auth version check failed: %s", type(exc).__name__)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.check()
            except (SQLAlchemyError, OSError) as exc:
                # Keep serving from the cache (availability); revocations wait for the database.
                logger.warning("auth version check failed: %s", type(exc).__name__)
