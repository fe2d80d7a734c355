"""The admin web console at /console: server-rendered pages (Jinja2 + htmx) over the same
service functions the admin API calls. See docs/console.md."""

from fastapi import APIRouter

from gateway.console.routes import (
    adapters,
    batches,
    deployments,
    keys,
    login,
    static,
    tenants,
    usage,
)

router = APIRouter(prefix="/console", include_in_schema=False)
for module in (login, static, tenants, keys, adapters, deployments, batches, usage):
    router.include_router(module.router)

__all__ = ["router"]
