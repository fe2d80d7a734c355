"""`switchboard usage export|summary` and `switchboard invoices show|close`.

`usage export` streams records with the same exporter as `GET /admin/usage/export`, chunk by
chunk, so memory stays flat for any range; with `--out` the file appears only once complete
and a JSON summary is printed. Other commands print JSON (or CSV when asked) on stdout;
failures print `error: ...` on stderr and return 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from billing import export, invoices, reports
from billing.money import usd
from gateway.settings import Settings
from tenancy import tenants
from tenancy.db import make_engine, make_sessionmaker

Action = Callable[[AsyncSession, argparse.Namespace], Awaitable[int]]


class CommandError(Exception):
    """A user-facing failure: printed as `error: <message>` with exit code 1."""


def register(subparsers: Any) -> None:
    """Add `usage` and `invoices` to a CLI's subparsers."""
    usage = subparsers.add_parser("usage", help="usage records and summaries").add_subparsers(
        dest="action", required=True, metavar="{export,summary}")
    dump = usage.add_parser("export", help="stream usage records as CSV or JSON Lines")
    dump.add_argument("--format", dest="fmt", choices=export.FORMATS, default="csv")
    dump.add_argument("--tenant", help="tenant id or name (default: every tenant)")
    dump.add_argument("--key", help="API key id")
    dump.add_argument("--model", help="model as asked (a model, alias or adapter)")
    dump.add_argument("--status", help="ok, error or aborted")
    dump.add_argument("--cache-hit", help="none, exact or semantic")
    dump.add_argument("--batch", dest="batch_id", help="one batch's lines (its batch_… id)")
    dump.add_argument("--origin", choices=export.ORIGINS,
                      help="live requests only, or batch lines only")
    _add_range(dump, "records created in [since, until)")
    dump.add_argument("--out", type=Path, help="file to write (default: stdout)")
    dump.set_defaults(func=_handler(_export))

    summary = usage.add_parser("summary", help="sums from the daily aggregates")
    summary.add_argument("--tenant", help="tenant id or name (default: every tenant)")
    summary.add_argument("--group-by", type=_group_by, default=("day",),
                         help=f"comma-separated: {', '.join(reports.DIMENSIONS)}")
    _add_range(summary, "whole UTC days covering [since, until)")
    summary.set_defaults(func=_handler(_summary))

    bills = subparsers.add_parser("invoices", help="monthly invoices").add_subparsers(
        dest="action", required=True, metavar="{show,close}")
    show = bills.add_parser("show", help="a month's invoice (open: as of now)")
    close = bills.add_parser("close", help="freeze a finished month's invoice")
    for parser in (show, close):
        parser.add_argument("--tenant", required=True, help="tenant id or name")
        parser.add_argument("--period", required=True, type=_period, help="YYYY-MM (UTC)")
    show.add_argument("--format", dest="fmt", choices=("json", "csv"), default="json")
    show.set_defaults(func=_handler(_invoice_show))
    close.set_defaults(func=_handler(_invoice_close))


# --- argument types -----------------------------------------------------------------------


def _when(value: str) -> datetime:
    """YYYY-MM-DD or an ISO 8601 time; without an offset it is UTC."""
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date or ISO 8601 time: {value!r}") from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed


def _period(value: str) -> str:
    try:
        invoices.parse_period(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _group_by(value: str) -> tuple[str, ...]:
    try:
        return reports.parse_group_by(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_range(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--since", type=_when, help=f"{what}; YYYY-MM-DD or ISO time")
    parser.add_argument("--until", type=_when, help="exclusive")


# --- plumbing -----------------------------------------------------------------------------


def _handler(action: Action) -> Callable[[argparse.Namespace, Settings], int]:
    """An async action as a CLI handler that owns its event loop and engine."""

    def handler(args: argparse.Namespace, settings: Settings) -> int:
        try:
            return asyncio.run(_with_session(action, args, settings))
        except CommandError as exc:
            return _fail(str(exc))
        except SQLAlchemyError as exc:
            detail = str(getattr(exc, "orig", None) or exc).splitlines()[0]
            return _fail(f"database error: {detail} (has `switchboard migrate` been run?)")
        except BrokenPipeError:
            return _fail("the output was closed before the export ended")
        except OSError as exc:
            return _fail(str(exc))

    return handler


async def _with_session(action: Action, args: argparse.Namespace, settings: Settings) -> int:
    engine = make_engine(settings.database_url)
    try:
        async with make_sessionmaker(engine)() as session:
            return await action(session, args)
    finally:
        await engine.dispose()


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def _print_json(data: Any) -> int:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


async def _tenant_id(session: AsyncSession, ref: str) -> str:
    tenant = await tenants.get_tenant(session, tenant_id=ref)
    if tenant is None:
        tenant = await tenants.get_tenant_by_name(session, name=ref)
    if tenant is None:
        raise CommandError(f"no tenant with id or name {ref!r}")
    return tenant.id


# --- usage --------------------------------------------------------------------------------


async def _export(session: AsyncSession, args: argparse.Namespace) -> int:
    filters = export.RecordFilter(
        tenant_id=None if args.tenant is None else await _tenant_id(session, args.tenant),
        key_id=args.key, model=args.model,
        status=args.status, cache_hit=args.cache_hit, since=args.since, until=args.until,
        batch_id=args.batch_id, origin=args.origin)
    stats = export.ExportStats()
    if args.out is None:
        await _write(session, filters, args.fmt, stats, sys.stdout.buffer)
        return 0
    if args.out.exists() and not args.out.is_file():  # /dev/null, a pipe: write straight in
        with args.out.open("wb") as out:
            await _write(session, filters, args.fmt, stats, out)
        return _print_json(_export_summary(args, stats))
    partial = args.out.with_name(f".{args.out.name}.partial")
    try:
        with partial.open("wb") as out:
            await _write(session, filters, args.fmt, stats, out)
        os.replace(partial, args.out)
    finally:
        partial.unlink(missing_ok=True)
    return _print_json(_export_summary(args, stats))


def _export_summary(args: argparse.Namespace, stats: export.ExportStats) -> dict[str, Any]:
    return {"out": str(args.out), "format": args.fmt, "rows": stats.rows, "bytes": stats.bytes,
            "cost_micros": stats.cost_micros, "cost_usd": usd(stats.cost_micros)}


async def _write(session: AsyncSession, filters: export.RecordFilter, fmt: export.ExportFormat,
                 stats: export.ExportStats, out: BinaryIO) -> None:
    async for chunk in export.export(session, filters=filters, fmt=fmt, stats=stats):
        out.write(chunk)
    out.flush()


async def _summary(session: AsyncSession, args: argparse.Namespace) -> int:
    tenant_id = None if args.tenant is None else await _tenant_id(session, args.tenant)
    first, last = reports.day_bounds(args.since, args.until)
    report = await reports.summarize(session, tenant_id=tenant_id, since=first, until=last,
                                     group_by=args.group_by)
    return _print_json({
        "tenant_id": tenant_id,
        "since": None if first is None else first.isoformat(),
        "until": None if last is None else last.isoformat(),
        "group_by": list(report.group_by),
        "data": [{"group": r.group, **reports.metrics_dict(r.metrics)} for r in report.rows],
        "totals": reports.metrics_dict(report.totals),
    })


# --- invoices -----------------------------------------------------------------------------


async def _invoice_show(session: AsyncSession, args: argparse.Namespace) -> int:
    tenant_id = await _tenant_id(session, args.tenant)
    view = await invoices.get_invoice(session, tenant_id=tenant_id, period=args.period)
    if args.fmt == "csv":
        sys.stdout.write(view.csv())
        return 0
    return _print_json(view.document())


async def _invoice_close(session: AsyncSession, args: argparse.Namespace) -> int:
    tenant_id = await _tenant_id(session, args.tenant)
    try:
        view = await invoices.close_invoice(session, tenant_id=tenant_id, period=args.period)
    except invoices.InvoiceError as exc:
        raise CommandError(str(exc)) from None
    return _print_json(view.document())
