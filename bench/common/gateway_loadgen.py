"""A closed-loop HTTP/1.1 load generator for the gateway benchmark, run in its own process.

``bench/gateway_overhead.py`` runs it once per measurement (pinned with ``taskset`` when asked),
passing a JSON spec on stdin, and reads one JSON result line from stdout:

    echo '{"url": "http://127.0.0.1:9000/v1/chat/completions", "body": "{...}",
           "headers": {"Authorization": "Bearer x"}, "concurrency": 32,
           "requests": 20000, "duration_s": 10, "warmup_requests": 500, "warmup_s": 2}' \
        | .venv/bin/python bench/common/gateway_loadgen.py

Each of ``concurrency`` keep-alive connections sends the next request as soon as the previous
response is complete (closed loop), so latency is time to last byte, streams included; time to
first byte is recorded too. A phase ends after ``requests`` responses or ``duration_s`` seconds,
whichever comes first, plus at most ``grace_s`` for those in flight. The warmup phase runs on
the same connections and is not counted.

Why not wrk: its closed-loop percentiles carry a coordinated-omission "correction" (synthetic
samples) that inflates the tails of a closed-loop run, and it always runs for its full ``-d``
even when a request count is reached. This client is a raw asyncio protocol on uvloop: it sends
pre-built request bytes and parses only the status line, framing and one optional header, so
it stays a small share of a core (its own CPU time is part of the result).
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

RECONNECTS_PER_CONNECTION = 100


@dataclass
class Spec:
    """One measurement, as read from stdin."""

    url: str
    body: str
    headers: dict[str, str] = field(default_factory=dict)
    concurrency: int = 1
    requests: int = 1000
    duration_s: float = 10.0
    warmup_requests: int = 100
    warmup_s: float = 1.0
    grace_s: float = 30.0
    collect_header: str | None = None


@dataclass
class Phase:
    """Counters and samples of one phase (warmup or measurement)."""

    limit: int
    deadline: float
    issued: int = 0
    latencies: list[float] = field(default_factory=list)
    ttfb: list[float] = field(default_factory=list)
    header_values: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    socket_errors: int = 0

    def may_issue(self, now: float) -> bool:
        return self.issued < self.limit and now < self.deadline


def build_request(spec: Spec) -> tuple[str, int, bytes]:
    """Host, port and the request bytes sent for every request."""
    parts = urlsplit(spec.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = spec.body.encode()
    lines = [f"POST {parts.path or '/'} HTTP/1.1", f"Host: {host}:{port}",
             "Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in spec.headers.items()]
    return host, port, ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class ResponseParser:
    """Incremental HTTP/1.1 response framing: content-length or chunked."""

    def __init__(self, collect: bytes | None) -> None:
        self.collect = collect
        self.reset()

    def reset(self) -> None:
        self.buf = bytearray()
        self.head_done = False
        self.status = 0
        self.header_value: float | None = None
        self.length: int | None = None  # None: chunked
        self.pos = 0  # chunked: offset of the next chunk-size line
        self.close = False

    def feed(self, data: bytes) -> int:
        """Add bytes; returns how many bytes past the end of a complete response, or -1."""
        self.buf += data
        if not self.head_done and not self._parse_head():
            return -1
        if self.length is not None:
            extra = len(self.buf) - self.pos - self.length
            return extra if extra >= 0 else -1
        return self._parse_chunks()

    def _parse_head(self) -> bool:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        head = bytes(self.buf[:end]).lower()
        self.status = int(head[9:12])
        self.head_done = True
        self.pos = end + 4
        self.length = self._header_int(head, b"\r\ncontent-length:")
        if self.length is None and b"\r\ntransfer-encoding: chunked" not in head:
            self.length = 0
        self.close = b"\r\nconnection: close" in head
        if self.collect is not None:
            value = self._header_bytes(head, self.collect)
            self.header_value = float(value) if value else None
        return True

    @staticmethod
    def _header_bytes(head: bytes, name: bytes) -> bytes | None:
        i = head.find(name)
        if i < 0:
            return None
        j = head.find(b"\r\n", i + len(name))
        return head[i + len(name):j if j >= 0 else len(head)].strip()

    def _header_int(self, head: bytes, name: bytes) -> int | None:
        value = self._header_bytes(head, name)
        return int(value) if value else None

    def _parse_chunks(self) -> int:
        buf = self.buf
        for _ in range(len(buf) + 1):  # bounded: each round consumes one chunk
            eol = buf.find(b"\r\n", self.pos)
            if eol < 0:
                return -1
            size = int(bytes(buf[self.pos:eol]).split(b";", 1)[0], 16)
            if size == 0:
                end = buf.find(b"\r\n\r\n", eol)
                return len(buf) - end - 4 if end >= 0 else -1
            if len(buf) < eol + 2 + size + 2:
                return -1
            self.pos = eol + 2 + size + 2
        return -1


class Connection(asyncio.Protocol):
    """One keep-alive connection sending the same request in a closed loop."""

    def __init__(self, gen: LoadGen) -> None:
        self.gen = gen
        self.parser = ResponseParser(gen.collect)
        self.transport: asyncio.Transport | None = None
        self.sent_at = 0.0
        self.first_byte_at = 0.0
        self.busy = False
        self.connected: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self.connected.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if not self.lost.done():
            self.lost.set_result(None)
        if self.busy:
            self.busy = False
            self.gen.on_socket_error(self)

    def send(self) -> None:
        assert self.transport is not None
        self.parser.reset()
        self.busy = True
        self.first_byte_at = 0.0
        self.sent_at = time.perf_counter()
        self.transport.write(self.gen.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if not self.busy:
            return
        if not self.first_byte_at:
            self.first_byte_at = now
        try:
            extra = self.parser.feed(data)
        except ValueError:
            extra = -2
        if extra == -1:
            return
        self.busy = False
        if extra == -2 or extra > 0:  # unparseable or unexpected bytes: drop the connection
            self.gen.on_socket_error(self)
            if self.transport is not None:
                self.transport.close()
            return
        self.gen.on_response(self, now)


class LoadGen:
    """Drives ``concurrency`` connections through a phase."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.host, self.port, self.request = build_request(spec)
        name = spec.collect_header
        self.collect = f"\r\n{name.lower()}:".encode() if name else None
        self.connections: list[Connection] = []
        self.phase = Phase(0, 0.0)
        self.idle: asyncio.Event | None = None
        self.reconnects = 0

    async def connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: Connection(self), self.host, self.port)
        await conn.connected
        return conn

    async def open(self) -> None:
        self.connections = [await self.connect() for _ in range(self.spec.concurrency)]

    def _next(self, conn: Connection, now: float) -> None:
        """Send the next request on ``conn`` if the phase allows; note when all are idle."""
        if conn.transport is not None and self.phase.may_issue(now):
            self.phase.issued += 1
            conn.send()
        elif self.idle is not None and not any(c.busy for c in self.connections):
            self.idle.set()

    def on_response(self, conn: Connection, now: float) -> None:
        phase, parser = self.phase, conn.parser
        phase.latencies.append(now - conn.sent_at)
        phase.ttfb.append(conn.first_byte_at - conn.sent_at)
        phase.statuses[parser.status] = phase.statuses.get(parser.status, 0) + 1
        if parser.header_value is not None:
            phase.header_values.append(parser.header_value)
        if parser.close and conn.transport is not None:
            conn.transport.close()
            asyncio.get_running_loop().create_task(self._replace(conn))
            return
        self._next(conn, now)

    def on_socket_error(self, conn: Connection) -> None:
        self.phase.socket_errors += 1
        asyncio.get_running_loop().create_task(self._replace(conn))

    async def _replace(self, conn: Connection) -> None:
        """Reconnect a dropped connection (bounded) and carry on with the phase."""
        if conn.transport is not None:
            conn.transport.close()
        await conn.lost
        index = self.connections.index(conn)
        self.reconnects += 1
        if self.reconnects <= RECONNECTS_PER_CONNECTION * len(self.connections):
            try:
                fresh = await self.connect()
            except OSError:
                fresh = None
            if fresh is not None:
                self.connections[index] = fresh
                self._next(fresh, time.perf_counter())
                return
        if self.idle is not None and not any(c.busy for c in self.connections):
            self.idle.set()

    async def run_phase(self, requests: int, duration_s: float) -> tuple[Phase, float]:
        """Run one phase; returns it and its wall time."""
        start = time.perf_counter()
        self.phase = Phase(limit=requests, deadline=start + duration_s)
        self.idle = asyncio.Event()
        for conn in list(self.connections):
            self._next(conn, start)
        try:
            await asyncio.wait_for(self.idle.wait(), duration_s + self.spec.grace_s)
        except TimeoutError:
            self.phase.socket_errors += sum(c.busy for c in self.connections)
        return self.phase, time.perf_counter() - start

    def close(self) -> None:
        for conn in self.connections:
            if conn.transport is not None:
                conn.transport.close()


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of already sorted values (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize_ms(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """p50/p90/p99/max/mean of seconds (scale 1000) or milliseconds (scale 1) in ms."""
    ordered = sorted(values)
    out: dict[str, float | None] = {
        f"p{q:g}": (None if (v := percentile(ordered, q)) is None else round(v * scale, 4))
        for q in (50, 90, 99)}
    out["max"] = round(ordered[-1] * scale, 4) if ordered else None
    out["mean"] = round(sum(ordered) / len(ordered) * scale, 4) if ordered else None
    return out


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run(spec: Spec) -> dict[str, Any]:
    """Connect, warm up, measure; the result as a JSON-ready dict."""
    gen = LoadGen(spec)
    await gen.open()
    try:
        warm, warm_wall = await gen.run_phase(spec.warmup_requests, spec.warmup_s)
        gc.collect()
        gc.disable()
        cpu0 = cpu_seconds()
        phase, wall = await gen.run_phase(spec.requests, spec.duration_s)
        cpu = cpu_seconds() - cpu0
        gc.enable()
    finally:
        gen.close()
    ok = sum(n for status, n in phase.statuses.items() if 200 <= status < 300)
    return {
        "completed": len(phase.latencies), "ok": ok, "statuses": phase.statuses,
        "socket_errors": phase.socket_errors, "wall_s": round(wall, 4),
        "rps": round(len(phase.latencies) / wall, 2) if wall > 0 else 0.0,
        "latency_ms": summarize_ms(phase.latencies), "ttfb_ms": summarize_ms(phase.ttfb),
        "header_ms": summarize_ms(phase.header_values, scale=1.0),
        "header_samples": len(phase.header_values),
        "loadgen_cpu_s": round(cpu, 4), "loadgen_cpu_share": round(cpu / wall, 4) if wall else 0,
        "warmup": {"completed": len(warm.latencies), "wall_s": round(warm_wall, 4),
                   "statuses": warm.statuses, "socket_errors": warm.socket_errors},
    }


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def main() -> None:
    spec = Spec(**json.loads(sys.stdin.read()))
    loop = new_loop()
    try:
        result = loop.run_until_complete(run(spec))
    except OSError as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        loop.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
