"""The console's own CSS and JS and the vendored htmx and Chart.js, served from the package
(no CDN). URLs carry a content hash (`render.static_url`), so they are cached for a year."""

from __future__ import annotations

from fastapi import Request
from starlette.responses import FileResponse, Response

from gateway.console.render import STATIC_DIR
from gateway.console.routing import console_router

router = console_router()
CACHE_CONTROL = "public, max-age=31536000, immutable"
MEDIA_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
               ".md": "text/plain; charset=utf-8", ".LICENSE": "text/plain; charset=utf-8"}


@router.get("/static/{name:path}")
async def static_file(name: str, request: Request) -> Response:
    target = (STATIC_DIR / name).resolve()
    media_type = MEDIA_TYPES.get(target.suffix)
    if media_type is None or not target.is_relative_to(STATIC_DIR) or not target.is_file():
        return Response("Not found", status_code=404, media_type="text/plain")
    return FileResponse(target, media_type=media_type, headers={
        "cache-control": CACHE_CONTROL, "x-content-type-options": "nosniff"})
