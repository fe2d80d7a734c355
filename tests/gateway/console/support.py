"""A signed-in console client over the in-process app, and what the tests share."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from gateway.app import create_app
from tests.gateway.support import admin_key, in_process, settings
from workers.async_engine import AsyncLLMEngine

_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def csrf_token(html: str) -> str:
    match = _CSRF.search(html)
    assert match, "no CSRF token on the page"
    return match.group(1)


class Console:
    """An httpx client that signs in through the form, as a browser does."""

    def __init__(self, app: FastAPI, client: httpx.AsyncClient, admin: str) -> None:
        self.app = app
        self.client = client
        self.admin = admin
        self.csrf = ""

    async def login(self, key: str | None = None) -> httpx.Response:
        form = await self.client.get("/console/login")
        response = await self.client.post("/console/login", data={
            "key": self.admin if key is None else key, "csrf_token": csrf_token(form.text),
            "next": "/console/tenants"})
        if response.status_code == 303:
            page = await self.client.get("/console/tenants")
            self.csrf = csrf_token(page.text)
        return response

    async def post(self, path: str, data: dict[str, Any] | None = None, *,
                   htmx: bool = False, **kwargs: Any) -> httpx.Response:
        headers = {"hx-request": "true"} if htmx else {}
        return await self.client.post(path, data={"csrf_token": self.csrf, **(data or {})},
                                      headers=headers, **kwargs)


@asynccontextmanager
async def console(db_url: str, tmp_path: Path, *, base_url: str = "http://gateway",
                  login: bool = True, engine: AsyncLLMEngine | None = None,
                  **overrides: Any) -> AsyncIterator[Console]:
    key = await admin_key(db_url, tmp_path)
    app = create_app(settings(db_url, tmp_path, **overrides), engine=engine)
    async with in_process(app) as client:
        client.base_url = httpx.URL(base_url)
        c = Console(app, client, key)
        if login:
            response = await c.login()
            assert response.status_code == 303, response.text
        yield c
