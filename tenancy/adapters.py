"""Data functions for tenant-owned LoRA adapters (rows only; engines and files are the
gateway's business).

Same contract as `tenancy.service`: session first, keyword-only arguments after it, and every
mutation bumps the auth version in its own transaction, so replicas drop their cached adapter
lookups within one poll.
"""

from __future__ import annotations

import re
from pathlib import PurePath

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from tenancy.auth_state import commit_mutation
from tenancy.context import AdapterContext
from tenancy.errors import ConflictError, InvalidError, NotFoundError
from tenancy.fields import NAME_MAX, check_name
from tenancy.models import Adapter, Tenant

# Names and aliases appear in URL paths and in model ids ("<base>:<name>"), so on top of the
# usual name rules they are plain tokens: no ':' (the separator), no '/', no spaces.
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_TOKEN_RULE = "letters, digits, '.', '_' and '-', starting with a letter or digit"
MAX_PATH_LENGTH = 4096


def is_adapter_token(value: str) -> bool:
    """Whether `value` could be an adapter name or alias (callers skip lookups otherwise)."""
    return len(value) <= NAME_MAX and _TOKEN.fullmatch(value) is not None


def check_adapter_name(name: str, what: str = "adapter") -> str:
    name = check_name(name, what)
    if not _TOKEN.fullmatch(name):
        raise InvalidError(f"{what} name may contain only {_TOKEN_RULE}")
    return name


def check_alias(alias: str | None) -> str | None:
    if alias is None:
        return None
    if not isinstance(alias, str) or not is_adapter_token(alias.strip()):
        raise InvalidError(f"adapter alias may contain only {_TOKEN_RULE} (no ':'), "
                           f"at most {NAME_MAX} characters")
    return alias.strip()


def check_base_model(base_model: str) -> str:
    """Adapters are addressed as "<base>:<name>", split on the first ':'."""
    if not isinstance(base_model, str) or not base_model or len(base_model) > 512:
        raise InvalidError("base_model must be a model name of 1 to 512 characters")
    if ":" in base_model or "\x00" in base_model:
        raise InvalidError("base_model must not contain ':'")
    return base_model


def check_path(path: str) -> str:
    """Absolute, so that every replica (whatever its working directory) reads the same files."""
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_LENGTH or "\x00" in path:
        raise InvalidError(f"path must be a folder path of 1 to {MAX_PATH_LENGTH} characters")
    if not PurePath(path).is_absolute():
        raise InvalidError("path must be absolute")
    return path


async def create_adapter(
    session: AsyncSession,
    *,
    tenant_id: str,
    name: str,
    base_model: str,
    path: str,
    alias: str | None = None,
    pinned: bool = False,
    uploaded: bool = False,
    adapter_id: str | None = None,
) -> Adapter:
    """Record an adapter; ConflictError if the tenant already has the name or alias.

    `adapter_id` lets the caller name the row before it exists (the gateway loads the files
    into its engine under that id first, and only then commits)."""
    adapter = Adapter(
        tenant_id=tenant_id, name=check_adapter_name(name), base_model=check_base_model(
            base_model), path=check_path(path), alias=check_alias(alias), pinned=bool(pinned),
        uploaded=bool(uploaded),
    )
    if adapter_id is not None:
        adapter.id = adapter_id
    if await session.get(Tenant, tenant_id) is None:
        raise NotFoundError(f"no tenant with id {tenant_id!r}")
    await check_adapter_free(session, tenant_id=tenant_id, name=adapter.name, alias=adapter.alias)
    session.add(adapter)
    await commit_mutation(session, f"adapter {adapter.name!r}")
    return adapter


async def check_adapter_free(
    session: AsyncSession, *, tenant_id: str, name: str, alias: str | None = None
) -> None:
    """ConflictError if the tenant already uses this name or alias (checked before loading)."""
    if await get_adapter(session, tenant_id=tenant_id, name=name) is not None:
        raise ConflictError(f"an adapter named {name!r} already exists")
    if alias is not None and await get_adapter_by_alias(
            session, tenant_id=tenant_id, alias=alias) is not None:
        raise ConflictError(f"an adapter with alias {alias!r} already exists")


async def list_adapters(session: AsyncSession, *, tenant_id: str) -> list[Adapter]:
    """The tenant's adapters, by name."""
    rows = await session.scalars(
        select(Adapter).where(Adapter.tenant_id == tenant_id).order_by(Adapter.name))
    return list(rows)


async def count_adapters(session: AsyncSession, *, tenant_id: str) -> int:
    count = await session.scalar(
        select(func.count()).select_from(Adapter).where(Adapter.tenant_id == tenant_id))
    return int(count or 0)


async def get_adapter(session: AsyncSession, *, tenant_id: str, name: str) -> Adapter | None:
    """The tenant's adapter of this name; another tenant's is None, like a missing one."""
    return await session.scalar(
        select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name))


async def get_adapter_by_alias(
    session: AsyncSession, *, tenant_id: str, alias: str
) -> Adapter | None:
    """The tenant's adapter with this alias, or None."""
    return await session.scalar(
        select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.alias == alias))


async def set_adapter_pinned(
    session: AsyncSession, *, tenant_id: str, name: str, pinned: bool
) -> Adapter | None:
    """Change whether the engine keeps the adapter in a device slot; None if not found."""
    adapter = await get_adapter(session, tenant_id=tenant_id, name=name)
    if adapter is None or adapter.pinned == pinned:
        return adapter
    adapter.pinned = pinned
    await commit_mutation(session, f"adapter {name!r}")
    return adapter


async def delete_adapter(session: AsyncSession, *, tenant_id: str, name: str) -> Adapter | None:
    """Delete the row (files are the caller's to remove); the deleted adapter, or None."""
    adapter = await get_adapter(session, tenant_id=tenant_id, name=name)
    if adapter is None:
        return None
    await session.delete(adapter)
    await commit_mutation(session, f"adapter {name!r}")
    return adapter


def adapter_context(adapter: Adapter) -> AdapterContext:
    """The immutable view the hot path caches."""
    return AdapterContext(
        id=adapter.id, tenant_id=adapter.tenant_id, name=adapter.name,
        base_model=adapter.base_model, path=adapter.path, alias=adapter.alias,
        pinned=adapter.pinned,
    )
