#!/usr/bin/env python3
"""Container probes and lifecycle hooks, installed in the image as `switchboard-probe`.

    switchboard-probe http URL [--timeout S] [--bearer-env VAR]
        GET URL; exit 0 on a 2xx answer, 1 otherwise (healthchecks: the slim image has no curl).
    switchboard-probe drain BASE_URL [--wait S]
        POST BASE_URL/admin/drain with `Authorization: Bearer $SWITCHBOARD_WORKER_SECRET`, then
        repeat it (it is idempotent and answers {"draining", "in_flight"}) until nothing is in
        flight or S seconds pass: a worker's preStop hook, so a scale-down or rollout lets
        running generations finish. Always exits 0 (a failing hook must not block the stop).
    switchboard-probe schema [--timeout S]
        Wait until the database at $SWITCHBOARD_DATABASE_URL is at the migrations' head (what
        `switchboard migrate` leaves): a gateway initContainer, so replicas never start on an
        old schema while the migrate Job runs.

The http and drain modes use the standard library only: a probe every few seconds must not
import torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request


def http_ok(url: str, *, timeout_s: float, bearer: str = "", method: str = "GET",
            body: bytes | None = None) -> tuple[bool, dict | None]:
    """(2xx?, the JSON body when there is one)."""
    headers = {"content-type": "application/json"} if body is not None else {}
    if bearer:
        headers["authorization"] = f"Bearer {bearer}"
    request = urllib.request.Request(url, data=body, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    except (OSError, ValueError):
        return False, None
    try:
        data = json.loads(raw) if raw else None
    except ValueError:
        data = None
    return 200 <= status < 300, data if isinstance(data, dict) else None


def cmd_http(args: argparse.Namespace) -> int:
    bearer = os.environ.get(args.bearer_env, "") if args.bearer_env else ""
    ok, _ = http_ok(args.url, timeout_s=args.timeout, bearer=bearer)
    return 0 if ok else 1


def cmd_drain(args: argparse.Namespace) -> int:
    url = args.base_url.rstrip("/") + "/admin/drain"
    secret = os.environ.get("SWITCHBOARD_WORKER_SECRET", "")
    deadline = time.monotonic() + args.wait
    while True:
        ok, data = http_ok(url, timeout_s=5, bearer=secret, method="POST",
                           body=b'{"drain": true}')
        in_flight = (data or {}).get("in_flight")
        if not ok:
            print(f"drain: {url} did not accept the drain", file=sys.stderr)
            return 0
        if not in_flight or time.monotonic() >= deadline:
            print(f"drain: {in_flight or 0} request(s) still in flight", file=sys.stderr)
            return 0
        time.sleep(args.interval)


def schema_at_head(url: str) -> bool:
    """Whether the database's alembic revision is the migrations' head (False if unreachable
    or not migrated yet)."""
    import asyncio

    from alembic.script import ScriptDirectory
    from sqlalchemy import text

    from tenancy.db import make_engine
    from tenancy.migrate import alembic_config

    heads = set(ScriptDirectory.from_config(alembic_config(url)).get_heads())

    async def current() -> set[str]:
        engine = make_engine(url)
        try:
            async with engine.connect() as connection:
                rows = await connection.execute(text("SELECT version_num FROM alembic_version"))
                return {row[0] for row in rows}
        finally:
            await engine.dispose()

    try:
        return asyncio.run(current()) == heads
    except Exception as error:  # unreachable, or no table yet: not at head
        print(f"schema: not ready ({type(error).__name__})", file=sys.stderr)
        return False


def cmd_schema(args: argparse.Namespace) -> int:
    from gateway.settings import Settings

    url = Settings().database_url
    deadline = time.monotonic() + args.timeout
    while not schema_at_head(url):
        if time.monotonic() >= deadline:
            print("schema: not at head; has `switchboard migrate` run?", file=sys.stderr)
            return 1
        time.sleep(args.interval)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="switchboard-probe", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    http = sub.add_parser("http", help="GET a URL; 0 on 2xx")
    http.add_argument("url")
    http.add_argument("--timeout", type=float, default=3.0)
    http.add_argument("--bearer-env", default="", help="send this variable as a bearer token")
    http.set_defaults(func=cmd_http)
    drain = sub.add_parser("drain", help="drain a worker and wait for its requests")
    drain.add_argument("base_url")
    drain.add_argument("--wait", type=float, default=110.0)
    drain.add_argument("--interval", type=float, default=1.0)
    drain.set_defaults(func=cmd_drain)
    schema = sub.add_parser("schema", help="wait until the database is migrated to head")
    schema.add_argument("--timeout", type=float, default=600.0)
    schema.add_argument("--interval", type=float, default=2.0)
    schema.set_defaults(func=cmd_schema)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
