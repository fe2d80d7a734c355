"""The admin API under /admin: every route needs an admin key."""

from fastapi import APIRouter, Depends

from gateway.deps import get_admin
from gateway.routes.admin import (
    adapters,
    admin_keys,
    aliases,
    deployments,
    invoices,
    keys,
    plans,
    tenants,
    usage,
)

router = APIRouter(prefix="/admin", dependencies=[Depends(get_admin)])
for module in (plans, tenants, keys, adapters, admin_keys, deployments, aliases, usage,
               invoices):
    router.include_router(module.router)
