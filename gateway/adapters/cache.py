"""A tenant's adapters by name and by alias, cached per replica (no query per request).

Keys always include the caller's tenant id, so one tenant's lookups can never find another's
adapter, and misses are cached as well. The auth watcher clears the cache whenever the auth
version moves, which every adapter change bumps.
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.lookup import LookupCache
from tenancy import adapters as adapter_rows
from tenancy.context import AdapterContext


class AdapterCache:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], *,
                 negative_size: int = 10_000) -> None:
        self._sessionmaker = sessionmaker
        self._entries: LookupCache[tuple[str, str, str], AdapterContext] = LookupCache(
            negative_size)

    def clear(self) -> None:
        self._entries.clear()

    async def find(self, tenant_id: str, model: str) -> AdapterContext | None:
        """The tenant's adapter that `model` names: "<base>:<name>" or an alias; else None."""
        base, sep, name = model.partition(":")
        if not sep:
            return await self._get(tenant_id, "alias", model)
        adapter = await self._get(tenant_id, "name", name)
        return adapter if adapter is not None and adapter.base_model == base else None

    async def _get(self, tenant_id: str, kind: str, value: str) -> AdapterContext | None:
        if not adapter_rows.is_adapter_token(value):
            return None  # could not have been registered: no query (and no NUL sent to SQL)

        async def query() -> AdapterContext | None:
            async with self._sessionmaker() as session:
                if kind == "name":
                    row = await adapter_rows.get_adapter(session, tenant_id=tenant_id, name=value)
                else:
                    row = await adapter_rows.get_adapter_by_alias(
                        session, tenant_id=tenant_id, alias=value)
            return None if row is None else adapter_rows.adapter_context(row)

        return await self._entries.get((tenant_id, kind, value), query)
