"""Signing in and out of the console: admin keys only, cookie flags, revocation, redirects."""

from __future__ import annotations

from tenancy import service
from tenancy.db import make_engine, make_sessionmaker
from tests.gateway.console.support import console, csrf_token
from tests.gateway.support import seed_tenant

PAGES = ["/console/tenants", "/console/deployments", "/console/usage", "/console/workers",
         "/console/workers/panel"]


def set_cookie(response, name: str = "sb_console") -> str:
    cookies = [v for k, v in response.headers.multi_items() if k == "set-cookie"]
    found = [c for c in cookies if c.startswith(f"{name}=")]
    assert found, cookies
    return found[0]


async def test_admin_key_signs_in_with_a_strict_httponly_cookie(sqlite_url, tmp_path):
    async with console(sqlite_url, tmp_path, login=False) as c:
        form = await c.client.get("/console/login")
        assert form.status_code == 200 and 'name="key"' in form.text
        r = await c.client.post("/console/login", data={
            "key": c.admin, "csrf_token": csrf_token(form.text), "next": "/console/usage"})
        assert r.status_code == 303 and r.headers["location"] == "/console/usage"
        cookie = set_cookie(r).lower()
        assert "httponly" in cookie and "samesite=strict" in cookie and "path=/console" in cookie
        assert "secure" not in cookie  # plain http: a Secure cookie would never come back
        assert c.admin.rsplit("-", 1)[1] not in cookie  # the cookie is not the key
        assert (await c.client.get("/console/tenants")).status_code == 200


async def test_cookie_is_secure_behind_tls(sqlite_url, tmp_path):
    async with console(sqlite_url, tmp_path, login=False) as c:
        form = await c.client.get("/console/login")
        r = await c.client.post("/console/login", headers={"x-forwarded-proto": "https"},
                                data={"key": c.admin, "csrf_token": csrf_token(form.text)})
        assert r.status_code == 303
        assert "secure" in set_cookie(r).lower().split("; ")
    async with console(sqlite_url, tmp_path, base_url="https://gateway", login=False) as c:
        r = await c.login()
        assert r.status_code == 303 and "secure" in set_cookie(r).lower().split("; ")
        assert (await c.client.get("/console/tenants")).status_code == 200


async def test_tenant_key_cannot_sign_in(sqlite_url, tmp_path):
    seeded = await seed_tenant(sqlite_url, tmp_path, name="acme")
    async with console(sqlite_url, tmp_path, login=False) as c:
        r = await c.login(seeded.key)
        assert r.status_code == 403
        assert "Tenant API keys cannot sign in" in r.text
        assert not [v for k, v in r.headers.multi_items()
                    if k == "set-cookie" and v.startswith("sb_console=")]
        assert (await c.client.get("/console/tenants")).status_code == 303
        # A tenant key as a bearer header is no way in either.
        r = await c.client.get("/console/tenants",
                               headers={"authorization": f"Bearer {seeded.key}"})
        assert r.status_code == 303 and r.headers["location"].startswith("/console/login")


async def test_bad_keys_and_forged_sign_in_forms_are_refused(sqlite_url, tmp_path):
    async with console(sqlite_url, tmp_path, login=False) as c:
        r = await c.login("sk-sb-admin-aaaaaaaaaaaa-" + "0" * 40)
        assert r.status_code == 401 and "not valid" in r.text
        r = await c.login("")
        assert r.status_code == 400 and "Enter an admin key" in r.text
        # No token from the form (a cross-site post): refused before the key is looked at.
        r = await c.client.post("/console/login", data={"key": c.admin})
        assert r.status_code == 403 and "expired" in r.text
        r = await c.client.post("/console/login", data={"key": c.admin, "csrf_token": "x"})
        assert r.status_code == 403


async def test_pages_need_a_session(sqlite_url, tmp_path):
    async with console(sqlite_url, tmp_path, login=False) as c:
        for page in PAGES:
            r = await c.client.get(page)
            assert r.status_code == 303, page
            assert r.headers["location"].startswith("/console/login?next=%2Fconsole%2F")
            r = await c.client.get(page, headers={"hx-request": "true"})
            assert r.headers["hx-redirect"] == "/console/login"
        r = await c.client.get("/console")
        assert r.status_code in (303, 307)
        r = await c.client.post("/console/tenants", data={"name": "x", "plan_id": "__new__"})
        assert r.status_code == 303 and r.headers["location"] == "/console/login"


async def test_signed_in_pages_render(sqlite_url, tmp_path):
    async with console(sqlite_url, tmp_path) as c:
        for page in PAGES:
            r = await c.client.get(page)
            assert r.status_code == 200, (page, r.text)
            assert r.headers["cache-control"] == "no-store"
            assert "script-src 'self'" in r.headers["content-security-policy"]
        r = await c.client.get("/console/login?next=/console/usage")
        assert r.status_code == 303 and r.headers["location"] == "/console/usage"
        r = await c.client.get("/console/login?next=//evil.example/")
        assert r.headers["location"] == "/console/tenants"


async def test_logout_deletes_the_session(sqlite_url, tmp_path):
    async with console(sqlite_url, tmp_path) as c:
        session_cookie = c.client.cookies.get("sb_console")
        r = await c.post("/console/logout")
        assert r.status_code == 303 and r.headers["location"] == "/console/login"
        assert "sb_console=" in set_cookie(r)
        assert (await c.client.get("/console/tenants")).status_code == 303
        # The old cookie value is dead server-side, not just forgotten by the browser.
        c.client.cookies.set("sb_console", session_cookie)
        assert (await c.client.get("/console/tenants")).status_code == 303


async def test_revoking_the_admin_key_ends_its_sessions(sqlite_url, tmp_path):
    async with console(sqlite_url, tmp_path) as c:
        assert (await c.client.get("/console/tenants")).status_code == 200
        key_id = c.admin.split("-")[3]
        engine = make_engine(sqlite_url)
        try:
            async with make_sessionmaker(engine)() as session:
                assert await service.revoke_admin_key(session, key_id=key_id) is not None
        finally:
            await engine.dispose()
        r = await c.client.get("/console/tenants")
        assert r.status_code == 303 and r.headers["location"].startswith("/console/login")
        r = await c.login()
        assert r.status_code == 401


async def test_static_assets_are_served_with_long_cache(sqlite_url, tmp_path):
    async with console(sqlite_url, tmp_path) as c:
        page = (await c.client.get("/console/usage")).text
        for name in ("vendor/htmx.min.js", "vendor/chart.umd.min.js", "console.css",
                     "console.js"):
            assert f"/console/static/{name}?v=" in page
            r = await c.client.get(f"/console/static/{name}")
            assert r.status_code == 200 and "immutable" in r.headers["cache-control"]
        assert (await c.client.get("/console/static/../render.py")).status_code == 404
        assert (await c.client.get("/console/static/%2e%2e/render.py")).status_code == 404
        assert (await c.client.get("/console/static/nope.js")).status_code == 404
