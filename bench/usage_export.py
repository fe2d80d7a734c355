"""Usage exports stay flat in memory however many rows they stream.

Run from the repository root:

    .venv/bin/python bench/usage_export.py                 # SQLite, 100k then 1M rows
    .venv/bin/python bench/usage_export.py --postgres      # PostgreSQL as well
    .venv/bin/python bench/usage_export.py --rows 200000 --small 20000 --no-http   # quick

It fills a fresh database with synthetic usage records (bulk inserts in chunks; the daily
aggregates are left empty, exports never read them), first `--small` rows, then up to
`--rows`. At each size it measures:

- ``cli``: `switchboard usage export --format csv|jsonl --out /dev/null`, run in a fresh
  process by the CLI's own `main`: time in `main`, the process's RSS before it, and its
  high-water mark (VmHWM) after. The same command with a filter matching no row gives the
  peak of an export that streams nothing (lazy imports, engine, query); `growth_mb` is the
  full export's peak minus that.
- ``http``: `GET /admin/usage/export` from a fresh `uvicorn` gateway process, streamed by
  this process: wall time to the last byte, and the server's RSS before the request and its
  high-water mark (VmHWM) after it.

Bounded memory means `growth_mb` stays about the same at `--small` and at `--rows`.
Writes ``bench/results/usage_export.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import shlex
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_model  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "usage_export.json"
SECRET = "bench-usage-export-secret"
POSTGRES_URL = os.environ.get("SWITCHBOARD_TEST_POSTGRES_URL",
                              "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
CHUNK = 50_000
T0 = datetime(2025, 3, 1, tzinfo=UTC)
SPAN_S = 30 * 86_400  # the rows spread over a month
COLUMNS = ("request_id", "tenant_id", "key_id", "model", "deployment", "adapter", "tier",
           "status", "cache_hit", "prompt_tokens", "completion_tokens", "cached_tokens",
           "input_cost_micros", "output_cost_micros", "cached_cost_micros", "cost_micros",
           "price_id", "queue_ms", "ttft_ms", "total_ms", "started_at", "created_at")


# --- synthetic records --------------------------------------------------------------------


def synthetic(start: int, count: int, total: int) -> Iterator[tuple[Any, ...]]:
    """Rows `start` .. `start + count`, spread evenly over a month of `total` rows."""
    models = ("smollm2-135m-instruct", "gpt-4o-mini", "chat", "auto", "acme-lora")
    for i in range(start, start + count):
        prompt, completion = 50 + i % 700, 10 + i % 300
        cached = (i % 4) * prompt // 8
        parts = (2 * (prompt - cached), 4 * completion, cached)
        created = T0 + timedelta(seconds=SPAN_S * i / total)
        yield (f"req-{i:012d}", f"tenant-{i % 50:03d}", f"key{i % 200:09d}", models[i % 5],
               f"deployment-{i % 3}", "acme-lora" if i % 5 == 4 else "", ("economy", "premium")[
                   i % 2], "ok" if i % 50 else "error", "none" if i % 20 else "exact", prompt,
               completion, cached, *parts, sum(parts), f"price{i % 3}", 0.25 * (i % 8),
               12.5 + i % 100, 40.0 + i % 900, created - timedelta(milliseconds=40), created)


def fill_sqlite(path: Path, start: int, count: int, total: int) -> float:
    """Bulk insert with sqlite3 itself (what SQLAlchemy's DateTime stores on SQLite)."""
    began = time.perf_counter()
    db = sqlite3.connect(path)
    try:
        db.execute("PRAGMA synchronous=OFF")
        sql = (f"INSERT INTO usage_records ({', '.join(COLUMNS)}) "
               f"VALUES ({', '.join('?' * len(COLUMNS))})")
        for offset in range(start, start + count, CHUNK):
            n = min(CHUNK, start + count - offset)
            db.executemany(sql, (_sqlite_row(r) for r in synthetic(offset, n, total)))
            db.commit()
    finally:
        db.close()
    return time.perf_counter() - began


def _sqlite_row(row: tuple[Any, ...]) -> tuple[Any, ...]:
    return (*row[:-2], *(t.strftime("%Y-%m-%d %H:%M:%S.%f") for t in row[-2:]))


async def fill_postgres(url: str, start: int, count: int, total: int) -> float:
    import asyncpg
    from sqlalchemy.engine import make_url

    target = make_url(url)
    began = time.perf_counter()
    conn = await asyncpg.connect(host=target.host, port=target.port, user=target.username,
                                 password=target.password, database=target.database)
    try:
        for offset in range(start, start + count, CHUNK):
            n = min(CHUNK, start + count - offset)
            await conn.copy_records_to_table("usage_records", columns=list(COLUMNS),
                                             records=list(synthetic(offset, n, total)))
        await conn.execute("ANALYZE usage_records")
    finally:
        await conn.close()
    return time.perf_counter() - began


# --- databases ----------------------------------------------------------------------------


async def create_postgres() -> str:
    import asyncpg
    from sqlalchemy.engine import make_url

    base = make_url(POSTGRES_URL)
    name = f"sb_bench_{secrets.token_hex(6)}"
    conn = await asyncpg.connect(host=base.host, port=base.port, user=base.username,
                                 password=base.password, database=base.database)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return base.set(database=name).render_as_string(hide_password=False)


async def drop_postgres(url: str) -> None:
    import asyncpg
    from sqlalchemy.engine import make_url

    base, name = make_url(POSTGRES_URL), make_url(url).database
    assert name and name.startswith("sb_bench_")
    conn = await asyncpg.connect(host=base.host, port=base.port, user=base.username,
                                 password=base.password, database=base.database)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def create_admin_key(url: str, tmp: Path) -> str:
    from tenancy import service
    from tenancy.db import make_engine, make_sessionmaker
    from tenancy.keys import load_or_create_pepper

    engine = make_engine(url)
    try:
        async with make_sessionmaker(engine)() as session:
            pepper = load_or_create_pepper(secret_key=SECRET, secret_file=tmp / "secret")
            _, key = await service.create_admin_key(session, pepper=pepper, name="bench")
            return key
    finally:
        await engine.dispose()


# --- measurements -------------------------------------------------------------------------


def env_for(url: str, tmp: Path) -> dict[str, str]:
    return {**os.environ, "SWITCHBOARD_DATABASE_URL": url, "SWITCHBOARD_SECRET_KEY": SECRET,
            "SWITCHBOARD_SECRET_FILE": str(tmp / "secret"), "SWITCHBOARD_EMBEDDED__MODEL": "none",
            "SWITCHBOARD_USAGE_OUTBOX_DIR": str(tmp / "outbox"),
            "SWITCHBOARD_LOG_LEVEL": "warning", "PYTHONPATH": str(ROOT)}


def run_cli(url: str, tmp: Path, fmt: str, *extra: str) -> dict[str, Any]:
    """`switchboard usage export` in its own process (see `child`): rows, time, memory."""
    report = tmp / "child.json"
    args = [sys.executable, str(Path(__file__).resolve()), "--child", str(report), "usage",
            "export", "--format", fmt, "--out", os.devnull, *extra]
    done = subprocess.run(args, cwd=ROOT, env=env_for(url, tmp), capture_output=True,
                          check=False, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"export failed ({done.returncode}): {done.stderr[-2000:]!r}")
    measured = json.loads(report.read_text())
    summary = json.loads(done.stdout)
    return {"rows": summary["rows"], "bytes": summary["bytes"], **measured}


def child(report: Path, argv: list[str]) -> int:
    """Run the CLI in this process; record its time and this process's RSS before and at
    its high-water mark (VmHWM)."""
    from gateway import cli

    baseline = proc_status_mb(os.getpid(), "VmRSS")
    began = time.perf_counter()
    try:
        cli.main(argv)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    wall = time.perf_counter() - began
    report.write_text(json.dumps({"wall_s": round(wall, 3), "baseline_rss_mb": baseline,
                                  "peak_rss_mb": proc_status_mb(os.getpid(), "VmHWM")}))
    return code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024, 1)
    raise KeyError(field)


def run_http(url: str, tmp: Path, fmt: str, admin_key: str) -> dict[str, Any]:
    """A fresh gateway process; one streamed export through it."""
    import httpx

    port = free_port()
    code = ("import uvicorn; from gateway.app import create_app; "
            f"uvicorn.run(create_app(), host='127.0.0.1', port={port}, log_level='warning', "
            "access_log=False)")
    server = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env_for(url, tmp))
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.2)
        baseline = proc_status_mb(server.pid, "VmRSS")
        rows = size = 0
        began = time.perf_counter()
        with httpx.stream("GET", base + "/admin/usage/export", params={"format": fmt},
                          headers={"authorization": f"Bearer {admin_key}"},
                          timeout=600) as response:
            response.raise_for_status()
            for chunk in response.iter_bytes():
                size += len(chunk)
                rows += chunk.count(b"\n")
        wall = time.perf_counter() - began
        return {"rows": rows - (fmt == "csv"), "bytes": size, "wall_s": round(wall, 3),
                "rows_per_s": round((rows - (fmt == "csv")) / wall),
                "baseline_rss_mb": baseline, "peak_rss_mb": proc_status_mb(server.pid, "VmHWM")}
    finally:
        server.terminate()
        server.wait(timeout=30)


def measure(backend: str, url: str, tmp: Path, size: int, admin_key: str | None
            ) -> list[dict[str, Any]]:
    rows = []
    for fmt in ("csv", "jsonl"):
        empty = run_cli(url, tmp, fmt, "--model", "no-such-model")
        full = run_cli(url, tmp, fmt)
        assert full["rows"] == size, (full, size)
        rows.append({"backend": backend, "path": "cli", "format": fmt, "rows": size,
                     "bytes": full["bytes"], "wall_s": full["wall_s"],
                     "rows_per_s": round(size / full["wall_s"]),
                     "baseline_rss_mb": full["baseline_rss_mb"],
                     "empty_export_peak_rss_mb": empty["peak_rss_mb"],
                     "peak_rss_mb": full["peak_rss_mb"],
                     "growth_mb": round(full["peak_rss_mb"] - empty["peak_rss_mb"], 1)})
        print(json.dumps(rows[-1]), flush=True)
        if admin_key is not None:
            http = run_http(url, tmp, fmt, admin_key)
            assert http["rows"] == size, (http, size)
            rows.append({"backend": backend, "path": "http", "format": fmt, **http,
                         "growth_mb": round(http["peak_rss_mb"] - http["baseline_rss_mb"], 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def run_backend(backend: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from tenancy.migrate import upgrade

    url = (f"sqlite+aiosqlite:///{tmp / 'bench.db'}" if backend == "sqlite"
           else asyncio.run(create_postgres()))
    try:
        upgrade(url)
        admin_key = None if args.no_http else asyncio.run(create_admin_key(url, tmp))
        fills, results, done = {}, [], 0
        for size in (args.small, args.rows):
            if backend == "sqlite":
                fills[size] = fill_sqlite(tmp / "bench.db", done, size - done, args.rows)
            else:
                fills[size] = asyncio.run(fill_postgres(url, done, size - done, args.rows))
            done = size
            print(f"{backend}: {size} rows in the database ({fills[size]:.1f} s to add)",
                  flush=True)
            results += measure(backend, url, tmp, size, admin_key)
        return {"fill_s": {str(k): round(v, 1) for k, v in fills.items()}, "results": results}
    finally:
        if backend == "postgres":
            asyncio.run(drop_postgres(url))


def table(results: list[dict[str, Any]]) -> str:
    head = ("backend", "path", "format", "rows", "rows_per_s", "baseline_rss_mb",
            "peak_rss_mb", "growth_mb")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    lines += [" | ".join(str(r[h]) for h in head) for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        sys.exit(child(Path(argv[1]), argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=100_000)
    parser.add_argument("--postgres", action="store_true", help="PostgreSQL as well")
    parser.add_argument("--no-http", action="store_true", help="skip the gateway route")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import psutil

    result: dict[str, Any] = {
        "benchmark": "usage_export",
        "command": shlex.join(["bench/usage_export.py", *argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(),
                    "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
                    "platform": platform.platform(), "python": platform.python_version()},
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "backends": {},
    }
    with tempfile.TemporaryDirectory(prefix="sb-usage-export-") as tmp:
        for backend in ("sqlite", *(("postgres",) if args.postgres else ())):
            result["backends"][backend] = run_backend(backend, args, Path(tmp))
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table([r for b in result["backends"].values() for r in b["results"]]))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
