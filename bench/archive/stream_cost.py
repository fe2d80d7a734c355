"""Gateway CPU per request against the number of SSE chunks it relays (docs/scaling.md).

The gateway (SQLite, in-process limiter) is pinned to its own cores, the mock upstream and
the load generator to the others; the mock answers a 512-word reply cut at `max_tokens`.

    .venv/bin/python bench/archive/stream_cost.py [--chunk-delay-ms 2] [--concurrency 64] [--plain]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import gateway_overhead as go  # noqa: E402
from bench.common.gateway_procs import Pinning, ServerProcess, free_port, python  # noqa: E402

REPLY = " ".join(f"w{i}" for i in range(512))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-delay-ms", type=float, default=0.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--plain", action="store_true", help="also measure non-streamed")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8, 64, 256])
    args = parser.parse_args(argv)
    pin = Pinning.plan(True)
    settings = go.Settings(requests=3000, duration_s=6.0, warmup_requests=100, warmup_s=1.0)
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        port = free_port()
        argv_mock = [python(), "-m", "bench.common.mock_upstream", "--host", "127.0.0.1",
                     "--port", str(port), "--reply", REPLY]
        if args.chunk_delay_ms:
            argv_mock += ["--chunk-delay-ms", str(args.chunk_delay_ms)]
        mock = ServerProcess("mock", pin.wrap(pin.mock, argv_mock), port, tmp / "mock.log",
                             cwd=ROOT).start()
        try:
            mock.wait_ready("/health", 30)
            target = go.start_gateway(tmp, mock, pin)
            try:
                for stream in ((False, True) if args.plain else (True,)):
                    for n in args.tokens:
                        body = {"model": go.MODEL, "messages": go.MESSAGES, "max_tokens": n}
                        if stream:
                            body.update(stream=True, stream_options={"include_usage": True})
                        before = target.server.cpu_seconds()
                        res = go.loadgen(target.base_url + "/v1/chat/completions", body,
                                         {"Authorization": f"Bearer {target.api_key}"},
                                         args.concurrency, settings, pin, collect=None)
                        spent = target.server.cpu_seconds() - before
                        served = res["completed"] + res["warmup"]["completed"]
                        row = {"stream": stream, "tokens": n, "rps": res["rps"],
                               "cpu_ms_per_request": round(spent * 1000 / served, 3),
                               "p50_ms": res["latency_ms"]["p50"]}
                        print(json.dumps(row), flush=True)
                        rows.append(row)
            finally:
                target.server.stop()
        finally:
            mock.stop()
    print(json.dumps({"pinning": pin.describe(), "chunk_delay_ms": args.chunk_delay_ms,
                      "concurrency": args.concurrency, "rows": rows}))


if __name__ == "__main__":
    main()
