"""Console sign-in sessions: in this process (the embedded default) or in Redis (replicas).

The browser holds a random session id; a store keeps only its SHA-256, so a memory dump, a
Redis dump or a log of the store never yields a usable cookie. A session remembers which
admin key signed in (its id, never the key), so revoking that key ends every session it opened.

Both stores have the same async interface (`ConsoleSessions`); `make_session_store` picks one
from the settings: Redis when `SWITCHBOARD_REDIS_URL` is set, so a console user signed in on
one replica is signed in on all of them (`redis_sessions.py`).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

SESSION_ID_BYTES = 32


def digest(token: str) -> str:
    """What a store keys a session by: never the session id itself."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ConsoleSession:
    admin_key_id: str
    admin_name: str
    csrf_token: str  # sent back in forms and htmx headers; compared in constant time
    expires_at: float  # time.time()


class SessionStoreUnavailable(Exception):
    """The store could not record a new session (Redis down or slow): nobody is signed in."""


class ConsoleSessions(Protocol):
    """What the console needs of a session store."""

    ttl_s: float

    async def create(self, *, admin_key_id: str, admin_name: str
                     ) -> tuple[str, ConsoleSession]:
        """A new session; returns the id for the cookie (shown only here) and the session.
        Raises SessionStoreUnavailable when it cannot be stored."""
        ...

    async def get(self, session_id: str | None) -> ConsoleSession | None:
        """The live session for a cookie value, or None: unknown, expired, or the store did
        not answer (a console fails closed)."""
        ...

    async def delete(self, session_id: str | None) -> None: ...

    async def end_admin(self, admin_key_id: str) -> int:
        """Drop every session of one admin key (it was revoked); returns how many."""
        ...

    async def close(self) -> None: ...


def new_session(*, admin_key_id: str, admin_name: str, ttl_s: float
                ) -> tuple[str, ConsoleSession]:
    session_id = secrets.token_urlsafe(SESSION_ID_BYTES)
    return session_id, ConsoleSession(admin_key_id=admin_key_id, admin_name=admin_name,
                                      csrf_token=secrets.token_urlsafe(SESSION_ID_BYTES),
                                      expires_at=time.time() + ttl_s)


class SessionStore:
    """Sessions in this process by the hash of their id, with an absolute lifetime and a size
    cap (the oldest goes first), so a flood of sign-ins cannot grow memory without bound."""

    def __init__(self, *, ttl_s: float, max_sessions: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, ConsoleSession] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    async def create(self, *, admin_key_id: str, admin_name: str
                     ) -> tuple[str, ConsoleSession]:
        self._prune()
        session_id, session = new_session(admin_key_id=admin_key_id, admin_name=admin_name,
                                          ttl_s=self.ttl_s)
        self._sessions[digest(session_id)] = session
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return session_id, session

    async def get(self, session_id: str | None) -> ConsoleSession | None:
        if not session_id:
            return None
        key = digest(session_id)
        session = self._sessions.get(key)
        if session is not None and session.expires_at <= time.time():
            del self._sessions[key]
            return None
        return session

    async def delete(self, session_id: str | None) -> None:
        if session_id:
            self._sessions.pop(digest(session_id), None)

    async def end_admin(self, admin_key_id: str) -> int:
        doomed = [k for k, s in self._sessions.items() if s.admin_key_id == admin_key_id]
        for key in doomed:
            del self._sessions[key]
        return len(doomed)

    async def close(self) -> None:
        self._sessions.clear()

    def _prune(self) -> None:
        now = time.time()
        while self._sessions:
            key, oldest = next(iter(self._sessions.items()))
            if oldest.expires_at > now:  # insertion order is expiry order (one ttl)
                return
            del self._sessions[key]


def make_session_store(*, redis_url: str, ttl_s: float, max_sessions: int,
                       timeout_s: float) -> ConsoleSessions:
    """Redis when a URL is set (shared by every replica), else this process's memory. No I/O:
    Redis connects on first use."""
    if not redis_url:
        return SessionStore(ttl_s=ttl_s, max_sessions=max_sessions)
    from gateway.console.redis_sessions import RedisSessionStore

    return RedisSessionStore(redis_url, ttl_s=ttl_s, max_sessions=max_sessions,
                             timeout_s=timeout_s)
