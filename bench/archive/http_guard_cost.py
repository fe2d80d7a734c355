"""CPU cost per request of `gateway.http_guard` (header-read timeout, head size limit,
connection cap) over uvicorn's plain httptools protocol, and of `gateway.body_guard`.

The end-to-end benchmark (`bench/gateway_overhead.py`) on a shared 2-core machine varies by
more than the guards could cost, so this measures them alone: one keep-alive connection on a
fake transport, a typical chat request (8 headers, a 300-byte JSON body) fed to the protocol,
a trivial ASGI app that reads the body and answers; rounds alternate between the two
protocols and the best round of each is kept.

    .venv/bin/python bench/archive/http_guard_cost.py            # ~10 s
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from uvicorn.config import Config  # noqa: E402
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # noqa: E402
from uvicorn.server import ServerState  # noqa: E402

from gateway.body_guard import BodyGuard  # noqa: E402
from gateway.http_guard import ConnectionLimits, guarded_protocol  # noqa: E402

BODY = (b'{"model":"mock-model","messages":[{"role":"system","content":"You are a helpful '
        b'assistant."},{"role":"user","content":"Say hello in one short sentence."}],'
        b'"max_tokens":16,"stream":false' + b' ' * 150 + b'}')
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:8000\r\n"
           b"user-agent: bench/1.0\r\naccept: */*\r\naccept-encoding: gzip\r\n"
           b"authorization: Bearer sk-sb-0123456789ab-" + b"f" * 64 + b"\r\n"
           b"content-type: application/json\r\nx-request-source: bench\r\n"
           b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY))


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = 0
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(
            name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += 1

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def make_app(body_guard: bool) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if body_guard:
            receive = BodyGuard(receive, 4 << 20, 30.0)
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


async def round_us(protocol_class: type[HttpToolsProtocol], body_guard: bool,
                   requests: int) -> float:
    """Microseconds of CPU per request over one connection."""
    config = Config(make_app(body_guard), http=protocol_class, lifespan="off",
                    log_config=None, access_log=False)
    config.load()
    protocol = config.http_protocol_class(config=config, server_state=ServerState(),
                                          app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    started = time.process_time()
    for _ in range(requests):
        protocol.data_received(REQUEST)
        while protocol.cycle is None or not protocol.cycle.response_complete:
            await asyncio.sleep(0)
    spent = time.process_time() - started
    protocol.connection_lost(None)
    if transport.written < requests:
        raise RuntimeError("requests were not answered")
    return spent / requests * 1e6


async def main_async(rounds: int, requests: int) -> dict[str, float]:
    guarded = guarded_protocol(ConnectionLimits(max_header_bytes=32 << 10,
                                                header_read_timeout_s=10, max_connections=1000))
    variants = {"uvicorn httptools": (HttpToolsProtocol, False),
                "+ http_guard": (guarded, False),
                "+ http_guard + body_guard": (guarded, True)}
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(rounds):
        for name, (cls, body) in variants.items():
            best[name] = min(best[name], await round_us(cls, body, requests))
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--requests", type=int, default=3000)
    args = p.parse_args(argv)
    best = asyncio.run(main_async(args.rounds, args.requests))
    base = best["uvicorn httptools"]
    for name, us in best.items():
        print(f"{name:28} {us:7.1f} us/request  (+{us - base:.1f})")


if __name__ == "__main__":
    main()
