"""One pooled HTTP client for every upstream, opened at startup and shared by all deployments."""

from __future__ import annotations

import aiohttp


class HttpPool:
    def __init__(self, *, max_connections: int) -> None:
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("HttpPool.open() has not been awaited")
        return self._session

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self._max_connections, limit_per_host=self._max_connections,
            ttl_dns_cache=300, enable_cleanup_closed=True,
        )
        # Per-call timeouts come from each deployment; the session itself never times out.
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=True, trust_env=False,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
