"""The production limiter: one Lua script per admit and per settle, exact across processes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from tenancy.limits import scripts
from tenancy.limits.decision import ScopeUsage, make_decision, unavailable
from tenancy.limits.keys import KeySpace
from tenancy.limits.memory import DEFAULT_LEASE_S
from tenancy.limits.outage import OutageGuard
from tenancy.limits.types import AdmissionRequest, Budget, Decision
from tenancy.limits.window import WINDOW_S

_BACKEND_ERRORS = (RedisError, OSError, TimeoutError)


def _arg(value: int | None) -> str:
    return "" if value is None else str(value)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _bucket(value: int) -> int | None:
    return None if value < 0 else value


# KEYS[1] budget counter; ARGV ledger micros, ttl seconds. Raise only; keep a live TTL.
_RAISE_TO = """
local current = tonumber(redis.call('GET', KEYS[1]) or '-1')
local ledger = tonumber(ARGV[1])
if current < 0 then
  redis.call('SET', KEYS[1], ledger, 'EX', tonumber(ARGV[2]))
elseif current < ledger then
  redis.call('INCRBY', KEYS[1], ledger - current)
end
return 1
"""


@dataclass(frozen=True)
class _Scripts:
    admit: AsyncScript
    resize: AsyncScript
    settle: AsyncScript


class RedisLimiter:
    """Talks to Redis lazily; a failure or timeout never reaches the caller (fail open/closed)."""

    def __init__(
        self,
        url: str,
        *,
        fail_open: bool,
        timeout_s: float = 0.25,
        namespace: str = "",
        lease_s: float = DEFAULT_LEASE_S,
        outage: OutageGuard | None = None,
        max_connections: int = 64,
    ) -> None:
        parse_url(url)  # a malformed URL fails here, at startup, rather than on every request
        self._url = url
        self._fail_open = fail_open
        self._timeout_s = timeout_s
        self._keys = KeySpace(namespace)
        self._lease_s = lease_s
        self._max_connections = max_connections
        self._outage = outage if outage is not None else OutageGuard()
        self._client: Redis | None = None
        self._scripts: _Scripts | None = None

    def _connect(self) -> tuple[Redis, _Scripts]:
        """Build the client on first use (no I/O here: connections open on demand)."""
        if self._client is None or self._scripts is None:
            pool = BlockingConnectionPool.from_url(
                self._url,
                max_connections=self._max_connections,  # beyond this, callers queue
                timeout=self._timeout_s,
                socket_timeout=self._timeout_s,
                socket_connect_timeout=self._timeout_s,
                retry=Retry(NoBackoff(), 0),  # the caller waits at most timeout_s, no retries
            )
            self._client = Redis.from_pool(pool)
            self._scripts = _Scripts(
                admit=self._client.register_script(scripts.ADMIT),
                resize=self._client.register_script(scripts.RESIZE),
                settle=self._client.register_script(scripts.SETTLE),
            )
        return self._client, self._scripts

    async def admit(self, request: AdmissionRequest) -> Decision:
        return await self._decide("admit", request)

    async def resize(self, request: AdmissionRequest) -> Decision:
        return await self._decide("resize", request)

    async def _decide(self, action: str, request: AdmissionRequest) -> Decision:
        """ADMIT or RESIZE: the same keys, arguments and reply."""
        if self._outage.is_down():
            return unavailable(fail_open=self._fail_open)
        keys, args = self._admit_call(request)
        try:
            async with asyncio.timeout(self._timeout_s):
                script = getattr(self._connect()[1], action)
                reply = await script(keys=keys, args=args)
        except _BACKEND_ERRORS as error:
            self._outage.failed(action, error)
            return unavailable(fail_open=self._fail_open)
        self._outage.recovered()
        return self._decode(request, reply)

    async def settle(self, request: AdmissionRequest, *, tokens: int, cost_micros: int) -> None:
        """Always tried, even during a cool-down, so slots are not held for a whole lease."""
        keys: list[str] = []
        for scope, _ in request.scopes:
            keys += [self._keys.tokens(scope), self._keys.in_flight(scope)]
        keys.append(self._keys.reservation(request.request_id))
        if request.budget is not None:
            keys.append(self._keys.budget(request.budget.scope, request.budget.period))
        args = [len(request.scopes), request.request_id, max(tokens, 0), cost_micros, WINDOW_S]
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._connect()[1].settle(keys=keys, args=args)
        except _BACKEND_ERRORS as error:
            self._outage.failed("settle", error)  # the lease frees the slot later

    async def seed_budget(self, budget: Budget, spent_micros: int) -> None:
        """SET NX: a live counter (other replicas already counting) is left alone."""
        key = self._keys.budget(budget.scope, budget.period)
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._connect()[0].set(key, max(spent_micros, 0), nx=True,
                                             ex=budget.period_ttl_s)
        except _BACKEND_ERRORS as error:
            self._outage.failed("seed_budget", error)

    async def spent_micros(self, budget: Budget) -> int:
        """Reserved plus spent in the period; 0 when Redis cannot be asked (logged)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                value = await self._connect()[0].get(self._keys.budget(budget.scope, budget.period))
        except _BACKEND_ERRORS as error:
            self._outage.failed("spent_micros", error)
            return 0
        return 0 if value is None else int(value)

    async def reconcile_budget(self, budget: Budget, ledger_micros: int) -> None:
        """One script: raise the counter to the ledger's spend, atomically with admissions."""
        key = self._keys.budget(budget.scope, budget.period)
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._connect()[0].eval(
                    _RAISE_TO, 1, key, max(ledger_micros, 0), budget.period_ttl_s)
        except _BACKEND_ERRORS as error:
            self._outage.failed("reconcile_budget", error)

    async def close(self) -> None:
        client, self._client = self._client, None
        self._scripts = None
        if client is not None:
            await client.aclose()

    def _admit_call(self, request: AdmissionRequest) -> tuple[list[str], list[str | int | float]]:
        keys: list[str] = []
        args: list[str | int | float] = [
            len(request.scopes),
            request.request_id,
            max(request.tokens, 0),
            request.cost_micros,
            self._lease_s,
            WINDOW_S,
            "" if request.budget is None else request.budget.cap_micros,
            0 if request.budget is None else request.budget.period_ttl_s,
        ]
        for scope, limits in request.scopes:
            keys += [
                self._keys.requests(scope),
                self._keys.tokens(scope),
                self._keys.in_flight(scope),
            ]
            args += [_arg(limits.rpm), _arg(limits.tpm), _arg(limits.max_concurrent)]
        args.append("1" if request.hold else "0")
        keys.append(self._keys.reservation(request.request_id))
        if request.budget is not None:
            keys.append(self._keys.budget(request.budget.scope, request.budget.period))
        return keys, args

    @staticmethod
    def _decode(request: AdmissionRequest, reply: Sequence[int | bytes]) -> Decision:
        admitted, reason, refused, retry, now = reply[:5]
        flat = reply[5:]
        usage = [
            ScopeUsage(
                int(flat[i]), _bucket(int(flat[i + 1])), int(flat[i + 2]), _bucket(int(flat[i + 3]))
            )
            for i in range(0, len(flat), 4)
        ]
        reason_text = None if admitted else _text(reason)  # type: ignore[arg-type]
        refused_scope = None
        if reason_text == "budget" and request.budget is not None:
            refused_scope = request.budget.scope
        elif reason_text:
            refused_scope = request.scopes[int(refused) - 1][0]
        return make_decision(
            scopes=request.scopes,
            usage=usage,
            now=float(_text(now)),  # type: ignore[arg-type]
            reason=reason_text,
            refused_scope=refused_scope,
            retry_after_s=float(_text(retry)),  # type: ignore[arg-type]
        )
