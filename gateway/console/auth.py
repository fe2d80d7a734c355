"""Who is signed in to the console, and the CSRF check on every change.

A request is signed in when its `sb_console` cookie names a live session AND the admin key
that opened it is still unrevoked (one primary-key read per request, so a revocation made
on any replica ends the session at once). Every method but GET/HEAD/OPTIONS must also send
the session's CSRF token, as the `x-csrf-token` header (htmx) or the `csrf_token` form field.

Sessions live in this process, or in Redis when `SWITCHBOARD_REDIS_URL` is set, so a sign-in
on one replica holds on every replica; when Redis does not answer, nobody is signed in.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from starlette.responses import Response

from gateway.console.sessions import ConsoleSession, ConsoleSessions
from gateway.deps import StateDep
from tenancy.admin_keys import load_admin_context

PREFIX = "/console"
COOKIE = "sb_console"
LOGIN_COOKIE = "sb_console_login"  # the sign-in form's own CSRF token (double submit)
LOGIN_PATH = f"{PREFIX}/login"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


class LoginRequired(Exception):
    """No live session: the console answers with the sign-in page (a redirect)."""


class CsrfRejected(Exception):
    """A change without the session's CSRF token: the console answers 403."""


@dataclass(frozen=True, slots=True)
class SignedIn:
    session_id: str
    session: ConsoleSession

    @property
    def csrf_token(self) -> str:
        return self.session.csrf_token


def sessions(request: Request) -> ConsoleSessions:
    """This app's session store (in process, or in Redis shared by every replica), built and
    closed with the rest of the gateway's state."""
    return request.app.state.gateway.console_sessions


def is_https(request: Request) -> bool:
    """Served over TLS, directly or behind a proxy that terminates it."""
    forwarded = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    return request.url.scheme == "https" or forwarded == "https"


def set_cookie(response: Response, request: Request, name: str, value: str, *, path: str,
               max_age: int) -> None:
    response.set_cookie(name, value, max_age=max_age, path=path, httponly=True,
                        samesite="strict", secure=is_https(request))


def clear_cookie(response: Response, request: Request, name: str, *, path: str) -> None:
    response.delete_cookie(name, path=path, httponly=True, samesite="strict",
                           secure=is_https(request))


def same_token(sent: object, expected: str) -> bool:
    """Constant-time comparison; anything but a string is a mismatch."""
    return isinstance(sent, str) and hmac.compare_digest(sent.encode(), expected.encode())


async def sent_csrf_token(request: Request) -> object:
    """The token from the htmx header, else from the form body (parsed once and cached)."""
    header = request.headers.get(CSRF_HEADER)
    if header is not None:
        return header
    if request.headers.get("content-type", "").startswith(_FORM_TYPES):
        return (await request.form()).get(CSRF_FIELD)
    return None


async def signed_in(request: Request, state: StateDep) -> SignedIn:
    """The dependency of every console route but sign-in."""
    store = sessions(request)
    session_id = request.cookies.get(COOKIE, "")
    session = await store.get(session_id)
    if session is None:
        raise LoginRequired
    async with state.sessionmaker() as db:
        admin = await load_admin_context(db, key_id=session.admin_key_id)
    if admin is None or admin.revoked:
        await store.end_admin(session.admin_key_id)
        raise LoginRequired
    if request.method not in SAFE_METHODS and not same_token(
            await sent_csrf_token(request), session.csrf_token):
        raise CsrfRejected
    return SignedIn(session_id, session)


AdminSession = Annotated[SignedIn, Depends(signed_in)]
