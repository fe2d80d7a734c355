"""Console sessions in Redis, shared by every gateway replica.

Keys (`prefix` is `sb:console` unless a test gives its own):

- `<prefix>:s:<sha256 of the session id>`: the session as JSON (admin key id and name, CSRF
  token, expiry), with a Redis TTL of the session lifetime. The id itself is never stored.
- `<prefix>:a:<admin key id>`: a sorted set of that key's session digests scored by expiry,
  so revoking the key ends its sessions on every replica (`end_admin`), and one admin key
  holds at most `max_sessions` (the oldest go first). It lives as long as its newest session.

Every call is bounded by `timeout_s` (`SWITCHBOARD_REDIS_TIMEOUT_S`). Unlike the rate limiter
(`SWITCHBOARD_REDIS_FAIL_OPEN`), the console always fails closed: when Redis does not answer,
nobody is signed in and a sign-in is refused with a 503 page, never waved through.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.console.sessions import (
    ConsoleSession,
    SessionStoreUnavailable,
    digest,
    new_session,
)

log = logging.getLogger(__name__)
_ERRORS = (RedisError, OSError, TimeoutError)
WARN_EVERY_S = 5.0


def _encode(session: ConsoleSession) -> str:
    return json.dumps({"k": session.admin_key_id, "n": session.admin_name,
                       "c": session.csrf_token, "e": session.expires_at})


def _decode(raw: str) -> ConsoleSession | None:
    try:
        data = json.loads(raw)
        return ConsoleSession(admin_key_id=str(data["k"]), admin_name=str(data["n"]),
                              csrf_token=str(data["c"]), expires_at=float(data["e"]))
    except (ValueError, KeyError, TypeError):
        return None


class RedisSessionStore:
    def __init__(self, url: str, *, ttl_s: float, max_sessions: int = 10_000,
                 timeout_s: float = 1.0, prefix: str = "sb:console",
                 max_connections: int = 16) -> None:
        parse_url(url)  # a malformed URL fails at startup, not on the first sign-in
        self.ttl_s = ttl_s
        self.max_sessions = max(1, max_sessions)
        self.timeout_s = timeout_s
        self.prefix = prefix
        self._url = url
        self._max_connections = max_connections
        self._client: Redis | None = None
        self._next_warning = float("-inf")
        self._unreported = 0

    # -- keys

    def session_key(self, session_digest: str) -> str:
        return f"{self.prefix}:s:{session_digest}"

    def admin_key(self, admin_key_id: str) -> str:
        return f"{self.prefix}:a:{admin_key_id}"

    # -- the store

    async def create(self, *, admin_key_id: str, admin_name: str
                     ) -> tuple[str, ConsoleSession]:
        session_id, session = new_session(admin_key_id=admin_key_id, admin_name=admin_name,
                                          ttl_s=self.ttl_s)
        hashed = digest(session_id)
        index = self.admin_key(admin_key_id)
        ttl_ms = max(1, int(self.ttl_s * 1000))
        try:
            async with asyncio.timeout(self.timeout_s):
                redis = self._redis()
                async with redis.pipeline(transaction=True) as pipe:
                    pipe.set(self.session_key(hashed), _encode(session), px=ttl_ms)
                    pipe.zremrangebyscore(index, "-inf", time.time())  # expired members
                    pipe.zadd(index, {hashed: session.expires_at})
                    pipe.pexpire(index, ttl_ms)  # outlives every member: the newest is last
                    pipe.zcard(index)
                    count = (await pipe.execute())[-1]
                if count > self.max_sessions:
                    oldest = await redis.zpopmin(index, count - self.max_sessions)
                    if oldest:
                        await redis.delete(*(self.session_key(m) for m, _ in oldest))
        except _ERRORS as error:
            self._failed("create", error)
            raise SessionStoreUnavailable from None
        return session_id, session

    async def get(self, session_id: str | None) -> ConsoleSession | None:
        if not session_id:
            return None
        try:
            async with asyncio.timeout(self.timeout_s):
                raw = await self._redis().get(self.session_key(digest(session_id)))
        except _ERRORS as error:
            self._failed("get", error)
            return None  # fail closed: not signed in
        session = None if raw is None else _decode(raw)
        if session is None or session.expires_at <= time.time():
            return None
        return session

    async def delete(self, session_id: str | None) -> None:
        if not session_id:
            return
        hashed = digest(session_id)
        try:
            async with asyncio.timeout(self.timeout_s):
                redis = self._redis()
                raw = await redis.get(self.session_key(hashed))
                session = None if raw is None else _decode(raw)
                async with redis.pipeline(transaction=True) as pipe:
                    pipe.delete(self.session_key(hashed))
                    if session is not None:
                        pipe.zrem(self.admin_key(session.admin_key_id), hashed)
                    await pipe.execute()
        except _ERRORS as error:
            self._failed("delete", error)

    async def end_admin(self, admin_key_id: str) -> int:
        """Every replica's sessions of this key; 0 when Redis does not answer (the console
        still re-reads the key's row on every request, so a revoked key signs nobody in)."""
        index = self.admin_key(admin_key_id)
        try:
            async with asyncio.timeout(self.timeout_s):
                redis = self._redis()
                members = await redis.zrange(index, 0, -1)
                async with redis.pipeline(transaction=True) as pipe:
                    if members:
                        pipe.delete(*(self.session_key(m) for m in members))
                    pipe.delete(index)
                    results = await pipe.execute()
        except _ERRORS as error:
            self._failed("end_admin", error)
            return 0
        return int(results[0]) if members else 0

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    # -- plumbing

    def _redis(self) -> Redis:
        """The client, built on first use (connections open on demand)."""
        if self._client is None:
            pool = BlockingConnectionPool.from_url(
                self._url, max_connections=self._max_connections, timeout=self.timeout_s,
                socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                retry=Retry(NoBackoff(), 0), decode_responses=True)
            self._client = Redis.from_pool(pool)
        return self._client

    def _failed(self, action: str, error: BaseException) -> None:
        """A warning at most every WARN_EVERY_S; the error type only (messages name hosts)."""
        self._unreported += 1
        now = time.monotonic()
        if now < self._next_warning:
            return
        self._next_warning = now + WARN_EVERY_S
        log.warning("console session store unavailable (%s during %s); %d failure(s) since "
                    "last warning; nobody is signed in meanwhile", type(error).__name__,
                    action, self._unreported)
        self._unreported = 0
