"""Console sign-in sessions, held server-side in this process.

The browser holds a random session id; the store keeps only its SHA-256, so a memory dump or
a log of the store never yields a usable cookie. A session remembers which admin key signed
in (its id, never the key), so revoking that key ends every session it opened.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

SESSION_ID_BYTES = 32


def digest(token: str) -> str:
    """What the store keys a session by: never the session id itself."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ConsoleSession:
    admin_key_id: str
    admin_name: str
    csrf_token: str  # sent back in forms and htmx headers; compared in constant time
    expires_at: float  # time.time()


class SessionStore:
    """Sessions by the hash of their id, with an absolute lifetime and a size cap (the oldest
    goes first), so a flood of sign-ins cannot grow memory without bound."""

    def __init__(self, *, ttl_s: float, max_sessions: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, ConsoleSession] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self, *, admin_key_id: str, admin_name: str) -> tuple[str, ConsoleSession]:
        """A new session; returns the id for the cookie (shown only here) and the session."""
        self._prune()
        session_id = secrets.token_urlsafe(SESSION_ID_BYTES)
        session = ConsoleSession(admin_key_id=admin_key_id, admin_name=admin_name,
                                 csrf_token=secrets.token_urlsafe(SESSION_ID_BYTES),
                                 expires_at=time.time() + self.ttl_s)
        self._sessions[digest(session_id)] = session
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return session_id, session

    def get(self, session_id: str | None) -> ConsoleSession | None:
        """The live session for a cookie value, or None (unknown or expired)."""
        if not session_id:
            return None
        key = digest(session_id)
        session = self._sessions.get(key)
        if session is not None and session.expires_at <= time.time():
            del self._sessions[key]
            return None
        return session

    def delete(self, session_id: str | None) -> None:
        if session_id:
            self._sessions.pop(digest(session_id), None)

    def end_admin(self, admin_key_id: str) -> int:
        """Drop every session of one admin key (it was revoked); returns how many."""
        doomed = [k for k, s in self._sessions.items() if s.admin_key_id == admin_key_id]
        for key in doomed:
            del self._sessions[key]
        return len(doomed)

    def _prune(self) -> None:
        now = time.time()
        while self._sessions:
            key, oldest = next(iter(self._sessions.items()))
            if oldest.expires_at > now:  # insertion order is expiry order (one ttl)
                return
            del self._sessions[key]
