"""Signing in with an admin key, and out.

The sign-in form has no session yet, so it carries its own CSRF token as a double submit: a
random value in an HttpOnly, SameSite=Strict cookie scoped to the form's path and in a
hidden field; another site can neither read the cookie nor make the browser send it.
"""

from __future__ import annotations

import secrets

from fastapi import Request
from starlette.responses import RedirectResponse, Response

from gateway.console import auth
from gateway.console.render import page
from gateway.console.routing import console_router, safe_next
from gateway.console.sessions import SessionStoreUnavailable
from gateway.deps import StateDep
from gateway.errors import APIError
from tenancy.admin_keys import load_admin_context

router = console_router()
LOGIN_TOKEN_MAX_AGE = 3600
TENANT_KEY_MESSAGE = ("Tenant API keys cannot sign in to the console. "
                      "Sign in with an admin key (sk-sb-admin-…).")
BAD_KEY_MESSAGE = "That admin key is not valid, or it has been revoked."
UNAVAILABLE_MESSAGE = ("Signing in is unavailable right now (the session store did not "
                       "answer). Please try again shortly.")


@router.get("/")  # /console redirects here (trailing slash)
async def index() -> Response:
    return RedirectResponse(f"{auth.PREFIX}/tenants", status_code=303)


@router.get("/login")
async def login_form(request: Request, next: str | None = None) -> Response:
    if await auth.sessions(request).get(request.cookies.get(auth.COOKIE)) is not None:
        return RedirectResponse(safe_next(next), status_code=303)
    return _login_page(request, next=safe_next(next), error=None)


@router.post("/login")
async def login(request: Request, state: StateDep) -> Response:
    form = await request.form(max_files=0, max_fields=16)  # no file is ever spooled here
    target = safe_next(str(form.get("next") or ""))
    if not auth.same_token(form.get(auth.CSRF_FIELD), request.cookies.get(auth.LOGIN_COOKIE)
                           or secrets.token_urlsafe(16)):
        return _login_page(request, next=target, status_code=403,
                           error="The sign-in form expired. Please try again.")
    key = str(form.get("key") or "").strip()
    if not key:
        return _login_page(request, next=target, status_code=400, error="Enter an admin key.")
    try:
        admin = await state.keys.admin(f"Bearer {key}")
    except APIError as exc:
        tenant_key = exc.status == 403
        return _login_page(request, next=target, status_code=exc.status,
                           error=TENANT_KEY_MESSAGE if tenant_key else BAD_KEY_MESSAGE)
    async with state.sessionmaker() as db:  # the key cache may lag a revocation by a poll
        current = await load_admin_context(db, key_id=admin.key_id)
    if current is None or current.revoked:
        return _login_page(request, next=target, status_code=401, error=BAD_KEY_MESSAGE)
    try:
        session_id, _ = await auth.sessions(request).create(admin_key_id=admin.key_id,
                                                            admin_name=admin.name)
    except SessionStoreUnavailable:
        return _login_page(request, next=target, status_code=503, error=UNAVAILABLE_MESSAGE)
    response = RedirectResponse(target, status_code=303)
    auth.set_cookie(response, request, auth.COOKIE, session_id, path=auth.PREFIX,
                    max_age=int(state.settings.console_session_ttl_s))
    auth.clear_cookie(response, request, auth.LOGIN_COOKIE, path=auth.LOGIN_PATH)
    return response


@router.post("/logout")
async def logout(request: Request, admin: auth.AdminSession) -> Response:
    await auth.sessions(request).delete(admin.session_id)
    response = RedirectResponse(auth.LOGIN_PATH, status_code=303)
    auth.clear_cookie(response, request, auth.COOKIE, path=auth.PREFIX)
    return response


def _login_page(request: Request, *, next: str, error: str | None, status_code: int = 200
                ) -> Response:
    token = secrets.token_urlsafe(32)
    response = page(request, "login.html", {"next": next, "error": error, "login_token": token,
                                            "title": "Sign in"}, status_code=status_code)
    auth.set_cookie(response, request, auth.LOGIN_COOKIE, token, path=auth.LOGIN_PATH,
                    max_age=LOGIN_TOKEN_MAX_AGE)
    return response
