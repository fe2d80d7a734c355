"""What each surface's own work costs in one process, and what a stored response's write costs
(docs/benchmarks.md, "Surfaces"; issue 39's Responses-against-chat ratio).

    .venv/bin/python bench/archive/surface_costs.py [--rounds 20000]

1. Parsing the body of `bench/surfaces_overhead.py`'s question on each surface (chat,
   Messages, Responses), and rendering a 16-token answer whole (written with the gateway's
   JSON codec) and as its stream, and for Messages and Responses the parse with the native
   body a deployment serving that API is sent (the rest are never sent it): mean
   microseconds of wall time (one thread, nothing else running).
2. `tenancy.stored_responses.Keeper` on a fresh SQLite file: process CPU per stored response
   when a flush holds 4, 16 or 64 rows (a flush's fixed cost against the cost of a row).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import surfaces_overhead as so  # noqa: E402
from gateway.deployments.native import native_of  # noqa: E402
from gateway.surfaces import CHAT, MESSAGES, RESPONSES, Surface  # noqa: E402
from tenancy import service, stored_responses  # noqa: E402
from tenancy.db import Base, make_engine, make_sessionmaker  # noqa: E402
from workers.protocol.events import Event, Finished, Opened, TextDelta, Usage  # noqa: E402
from workers.protocol.render import Fold  # noqa: E402
from workers.protocol.wire_json import dumps  # noqa: E402

WORDS = ["Hello", " there", ",", " how", " can", " I", " help", " you", " today", "?", " I",
         " am", " a", " mock", " model", "."]
SURFACES: dict[str, Surface] = {"chat": CHAT, "messages": MESSAGES, "responses": RESPONSES}
NATIVE = {"messages": "messages", "responses": "responses"}  # surface -> its native API


def events() -> Iterator[Event]:
    yield Opened("x", 1, "m")
    for word in WORDS:
        yield TextDelta(0, word)
    yield Finished(0, "length")
    yield Usage(20, 16)


def mean_us(fn: Callable[[], Any], rounds: int) -> float:
    for _ in range(min(rounds, 500)):
        fn()
    started = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - started) / rounds * 1e6


def surface_costs(rounds: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, surface in SURFACES.items():
        plain = json.dumps(so.body(name, False)).encode()
        streamed = json.dumps(so.body(name, True)).encode()

        def whole(surface: Surface = surface, raw: bytes = plain) -> bytes:
            req = surface.parse(raw)
            fold = Fold(chat=surface.chat)
            for event in events():
                fold.add(event)
            body = surface.whole(req, fold) if surface.whole else fold.response()
            return dumps(body)  # the gateway's codec, as it writes the answer

        def stream(surface: Surface = surface, raw: bytes = streamed) -> bytes:
            req = surface.parse(raw)
            assert surface.stream is not None
            renderer = surface.stream(req, 20)
            return b"".join(renderer.render(e) for e in events()) + renderer.done()

        out[name] = {"parse_us": round(mean_us(lambda s=surface, r=streamed: s.parse(r),
                                                  rounds), 2),
                     "parse_and_whole_us": round(mean_us(whole, rounds), 2),
                     "parse_and_stream_us": round(mean_us(stream, rounds), 2)}
        if name in NATIVE:  # the body a deployment serving the API is sent (made only there)
            out[name]["parse_and_native_body_us"] = round(mean_us(
                lambda s=surface, r=plain, api=NATIVE[name]: native_of(s.parse(r), {api}),
                rounds), 2)
    return out


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def keeper_costs(rows_per_flush: list[int], flushes: int) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="surface-costs-"))
    engine = make_engine(f"sqlite+aiosqlite:///{tmp / 'x.db'}")
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    maker = make_sessionmaker(engine)
    async with maker() as session:
        plan = await service.create_plan(session, name="p")
        tenant = await service.create_tenant(session, name="t", plan_id=plan.id)
    tasks: set[asyncio.Task[None]] = set()

    def spawn(work: Any) -> None:
        task = asyncio.ensure_future(work)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    keeper = stored_responses.Keeper(maker, spawn)
    fold = Fold(chat=True)
    for event in events():
        fold.add(event)
    request = RESPONSES.parse(json.dumps(so.body("responses", False)).encode())
    body = RESPONSES.whole(request, fold)
    pause = stored_responses.GROUP_S * 1.05  # one flush per batch of rows
    out = {}
    try:
        for rows in rows_per_flush:
            idle_start = cpu_s()
            for _ in range(flushes):
                await asyncio.sleep(pause)
            idle = cpu_s() - idle_start
            started = cpu_s()
            for _ in range(flushes):
                for _ in range(rows):
                    keeper.keep(response_id=stored_responses.new_response_id(),
                                tenant_id=tenant.id, status="completed",
                                previous_response_id=None, body=body,
                                input_items=[{"type": "message", "role": "user",
                                              "content": "hi"}], history=[])
                await asyncio.sleep(pause)
            while tasks:
                await asyncio.sleep(0.01)
            out[f"{rows}_rows_us_per_response"] = round(
                (cpu_s() - started - idle) / (rows * flushes) * 1e6, 1)
    finally:
        await engine.dispose()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20_000)
    parser.add_argument("--flushes", type=int, default=40)
    args = parser.parse_args(argv)
    result = {"surfaces": surface_costs(args.rounds),
              "stored_response_write": asyncio.run(keeper_costs([4, 16, 64], args.flushes))}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
