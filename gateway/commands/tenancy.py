"""`switchboard migrate|plans|tenants|keys|admin-keys ...`: manage tenancy from a shell.

Every command prints JSON on stdout. Failures print `error: ...` on stderr and return 1;
full keys are printed once, by the `create` commands, and never logged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from datetime import timedelta
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.schemas.admin import AdminKeyOut, KeyOut, PlanOut, TenantOut
from gateway.settings import Settings
from tenancy import service
from tenancy.db import make_engine, make_sessionmaker
from tenancy.keys import load_or_create_pepper
from tenancy.models import CACHE_MODES, AdminKey, ApiKey, Plan, Tenant, utcnow

Handler = Callable[[argparse.Namespace, Settings], int]
Action = Callable[[AsyncSession, argparse.Namespace, Settings], Awaitable[Any]]

MICROS_PER_USD = 1_000_000


class CommandError(Exception):
    """A user-facing failure: printed as `error: <message>` with exit code 1."""


# --- argument types -----------------------------------------------------------------------


def _name_list(value: str) -> list[str]:
    """`a,b` -> ["a", "b"]; an empty string means "none allowed"."""
    return [part.strip() for part in value.split(",") if part.strip()]


def _non_negative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {value!r}")
    return number


def _positive_int(value: str) -> int:
    number = _non_negative_int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {value!r}")
    return number


def _percent(value: str) -> int:
    number = _non_negative_int(value)
    if number > 100:
        raise argparse.ArgumentTypeError(f"must be in [0, 100]: {value!r}")
    return number


def _above_zero_up_to(high: float) -> Callable[[str], float]:
    """A number in (0, high] (NaN fails the test too)."""
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
        if not 0 < number <= high:
            raise argparse.ArgumentTypeError(f"must be in (0, {high:g}]: {value!r}")
        return number
    return parse


_threshold = _above_zero_up_to(1)  # a cosine similarity
_engine_weight = _above_zero_up_to(100)  # a share of engine tokens, relative to others'


def _priority(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if not -10 <= number <= 10:
        raise argparse.ArgumentTypeError(f"must be in [-10, 10]: {value!r}")
    return number


def _usd_to_micros(value: str) -> int:
    try:
        usd = Decimal(value)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not an amount in USD: {value!r}") from None
    if not usd.is_finite() or usd < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative amount: {value!r}")
    return int((usd * MICROS_PER_USD).to_integral_value(rounding=ROUND_HALF_UP))


def _positive_days(value: str) -> float:
    try:
        days = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of days: {value!r}") from None
    if not days > 0 or days > 365_000:
        raise argparse.ArgumentTypeError(f"must be a positive number of days: {value!r}")
    return days


# --- JSON views (never include secret hashes) ---------------------------------------------


def plan_json(plan: Plan) -> dict[str, Any]:
    """A plan as printed by the CLI: the admin API's view, plus the budget in USD."""
    data = PlanOut.model_validate(plan).model_dump(mode="json")
    data["budget_usd"] = None if plan.budget_micros is None else plan.budget_micros / MICROS_PER_USD
    return data


def tenant_json(tenant: Tenant) -> dict[str, Any]:
    return TenantOut.model_validate(tenant).model_dump(mode="json")


def api_key_json(key: ApiKey) -> dict[str, Any]:
    """A tenant key's metadata (no secret, no hash), as the admin API shows it."""
    return KeyOut.model_validate(key).model_dump(mode="json")


def admin_key_json(key: AdminKey) -> dict[str, Any]:
    return AdminKeyOut.model_validate(key).model_dump(mode="json")


# --- plumbing -----------------------------------------------------------------------------


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1


def _emit(result: Any) -> int:
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


async def _run_with_session(action: Action, args: argparse.Namespace, settings: Settings) -> Any:
    engine = make_engine(settings.database_url)
    try:
        async with make_sessionmaker(engine)() as session:
            return await action(session, args, settings)
    finally:
        await engine.dispose()


def _handler(action: Action) -> Handler:
    """Wrap an async action into a CLI handler that owns its event loop and engine."""

    def handler(args: argparse.Namespace, settings: Settings) -> int:
        try:
            result = asyncio.run(_run_with_session(action, args, settings))
        except (CommandError, service.ServiceError) as exc:
            return _fail(str(exc))
        except SQLAlchemyError as exc:
            detail = str(getattr(exc, "orig", None) or exc).splitlines()[0]
            return _fail(f"database error: {detail} (has `switchboard migrate` been run?)")
        except OSError as exc:
            return _fail(f"cannot reach the database: {exc}")
        return _emit(result)

    return handler


def _pepper(settings: Settings) -> bytes:
    return load_or_create_pepper(secret_key=settings.secret_key, secret_file=settings.secret_file)


async def _resolve_tenant(session: AsyncSession, ref: str) -> Tenant:
    tenant = await service.get_tenant(session, tenant_id=ref)
    if tenant is None:
        tenant = await service.get_tenant_by_name(session, name=ref)
    if tenant is None:
        raise CommandError(f"no tenant with id or name {ref!r}")
    return tenant


# --- migrate ------------------------------------------------------------------------------


def _migrate(args: argparse.Namespace, settings: Settings) -> int:
    from tenancy.migrate import upgrade  # alembic is only needed by this command

    safe_url = make_url(settings.database_url).render_as_string(hide_password=True)
    try:
        upgrade(settings.database_url, args.revision)
    except (SQLAlchemyError, OSError) as exc:
        return _fail(f"migration failed on {safe_url}: {str(exc).splitlines()[0]}")
    return _emit({"database": safe_url, "revision": args.revision, "migrated": True})


# --- plans --------------------------------------------------------------------------------


async def _plans_create(session: AsyncSession, args: argparse.Namespace, _: Settings) -> Any:
    plan = await service.create_plan(
        session,
        name=args.name,
        rpm=args.rpm,
        tpm=args.tpm,
        max_concurrent=args.max_concurrent,
        budget_micros=args.budget_usd,
        budget_period=args.budget_period,
        allowed_models=args.models,
        allowed_tiers=args.tiers,
        cache_mode=args.cache_mode,
        semantic_threshold=args.semantic_threshold,
        cache_ttl_s=args.cache_ttl_s,
        cache_hit_price_percent=args.cache_hit_price_percent,
        engine_weight=args.engine_weight,
        priority=args.priority,
        embedding_max_request_tokens=args.embedding_max_request_tokens,
        batch_price_percent=args.batch_price_percent,
    )
    return plan_json(plan)


async def _plans_list(session: AsyncSession, _args: argparse.Namespace, _: Settings) -> Any:
    return [plan_json(plan) for plan in await service.list_plans(session)]


# --- tenants ------------------------------------------------------------------------------


async def _tenants_create(session: AsyncSession, args: argparse.Namespace, _: Settings) -> Any:
    plan = await service.get_plan_by_name(session, name=args.plan)
    if plan is None:
        plan = await service.get_plan(session, plan_id=args.plan)
    if plan is None:
        raise CommandError(f"no plan named {args.plan!r} (see `switchboard plans list`)")
    tenant = await service.create_tenant(
        session, name=args.name, plan_id=plan.id, semantic_threshold=args.semantic_threshold
    )
    return tenant_json(tenant)


async def _tenants_list(session: AsyncSession, _args: argparse.Namespace, _: Settings) -> Any:
    return [tenant_json(tenant) for tenant in await service.list_tenants(session)]


def _set_status(status: str) -> Action:
    async def action(session: AsyncSession, args: argparse.Namespace, _: Settings) -> Any:
        tenant = await _resolve_tenant(session, args.tenant)
        updated = await service.update_tenant(session, tenant_id=tenant.id, status=status)
        if updated is None:  # deleted between the two statements
            raise CommandError(f"no tenant with id {tenant.id!r}")
        return tenant_json(updated)

    return action


# --- tenant keys --------------------------------------------------------------------------


async def _keys_create(session: AsyncSession, args: argparse.Namespace, settings: Settings) -> Any:
    tenant = await _resolve_tenant(session, args.tenant)
    expires_at = None
    if args.expires_in_days is not None:
        expires_at = utcnow() + timedelta(days=args.expires_in_days)
    record, full_key = await service.create_api_key(
        session,
        tenant_id=tenant.id,
        pepper=_pepper(settings),
        name=args.name,
        expires_at=expires_at,
        rpm=args.rpm,
        tpm=args.tpm,
        max_concurrent=args.max_concurrent,
        allowed_models=args.models,
        allowed_adapters=args.adapters,
    )
    print("Store this key now: it is shown only once.", file=sys.stderr)
    return {**api_key_json(record), "key": full_key}


async def _keys_list(session: AsyncSession, args: argparse.Namespace, _: Settings) -> Any:
    tenant = await _resolve_tenant(session, args.tenant)
    return [api_key_json(key) for key in await service.list_api_keys(session, tenant_id=tenant.id)]


async def _keys_revoke(session: AsyncSession, args: argparse.Namespace, _: Settings) -> Any:
    key = await service.revoke_api_key(session, key_id=args.key_id)
    if key is None:
        raise CommandError(f"no key with id {args.key_id!r}")
    return api_key_json(key)


# --- admin keys ---------------------------------------------------------------------------


async def _admin_create(session: AsyncSession, args: argparse.Namespace, settings: Settings) -> Any:
    record, full_key = await service.create_admin_key(
        session, pepper=_pepper(settings), name=args.name
    )
    print("Store this key now: it is shown only once.", file=sys.stderr)
    return {**admin_key_json(record), "key": full_key}


async def _admin_list(session: AsyncSession, _args: argparse.Namespace, _: Settings) -> Any:
    return [admin_key_json(key) for key in await service.list_admin_keys(session)]


async def _admin_revoke(session: AsyncSession, args: argparse.Namespace, _: Settings) -> Any:
    key = await service.revoke_admin_key(session, key_id=args.key_id)
    if key is None:
        raise CommandError(f"no admin key with id {args.key_id!r}")
    return admin_key_json(key)


# --- parser -------------------------------------------------------------------------------


def _add_limits(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rpm", type=_non_negative_int, help="requests per minute")
    parser.add_argument("--tpm", type=_non_negative_int, help="tokens per minute")
    parser.add_argument("--max-concurrent", type=_non_negative_int, help="requests in flight")
    parser.add_argument("--models", type=_name_list, help="allowed models, comma-separated")


def register(subparsers: Any) -> None:
    """Add `migrate`, `plans`, `tenants`, `keys` and `admin-keys` to a CLI's subparsers."""
    migrate = subparsers.add_parser("migrate", help="create or upgrade the database schema")
    migrate.add_argument("--revision", default="head", help=argparse.SUPPRESS)
    migrate.set_defaults(func=_migrate)

    plans = subparsers.add_parser("plans", help="manage plans").add_subparsers(
        dest="action", required=True, metavar="{create,list}"
    )
    create = plans.add_parser("create", help="create a plan")
    create.add_argument("--name", required=True)
    _add_limits(create)
    create.add_argument("--budget-usd", type=_usd_to_micros, help="spend cap per period, USD")
    create.add_argument("--budget-period", choices=("month", "day"), default="month")
    create.add_argument("--tiers", type=_name_list, help="allowed cost tiers, comma-separated")
    create.add_argument("--cache-mode", choices=CACHE_MODES, default="auto",
                        help="response cache: off, auto (deterministic requests only), exact, "
                             "semantic (exact plus similar prompts)")
    create.add_argument("--semantic-threshold", type=_threshold,
                        help="cosine similarity in (0, 1] (default: the gateway's)")
    create.add_argument("--cache-ttl-s", type=_positive_int,
                        help="seconds a cached answer lives (default: the gateway's)")
    create.add_argument("--cache-hit-price-percent", type=_percent, default=0,
                        help="share of the normal price charged for a cached answer, 0-100")
    create.add_argument("--batch-price-percent", type=_percent, default=50,
                        help="share of the normal price charged for a line of a batch (the "
                             "Batch API), 0-100 (default 50)")
    create.add_argument("--engine-weight", type=_engine_weight, default=1.0,
                        help="share of engine tokens relative to other tenants' weights, "
                             "in (0, 100] (default 1)")
    create.add_argument("--priority", type=_priority, default=0,
                        help="order within the tenant, -10 to 10, lower first; also the most "
                             "urgent a request may ask for (default 0)")
    create.add_argument("--embedding-max-request-tokens", type=_positive_int,
                        help="the most input tokens one embeddings request may embed; lowers "
                             "a deployment's bound, never raises it (default: the "
                             "deployment's)")
    create.set_defaults(func=_handler(_plans_create))
    plans.add_parser("list", help="list plans").set_defaults(func=_handler(_plans_list))

    tenants = subparsers.add_parser("tenants", help="manage tenants").add_subparsers(
        dest="action", required=True, metavar="{create,list,suspend,activate}"
    )
    create = tenants.add_parser("create", help="create a tenant")
    create.add_argument("--name", required=True)
    create.add_argument("--plan", required=True, help="plan name")
    create.add_argument("--semantic-threshold", type=_threshold,
                        help="overrides the plan's semantic-cache threshold, in (0, 1]")
    create.set_defaults(func=_handler(_tenants_create))
    tenants.add_parser("list", help="list tenants").set_defaults(func=_handler(_tenants_list))
    for action, status in (("suspend", "suspended"), ("activate", "active")):
        parser = tenants.add_parser(action, help=f"mark a tenant {status}")
        parser.add_argument("tenant", metavar="TENANT_ID")
        parser.set_defaults(func=_handler(_set_status(status)))

    keys = subparsers.add_parser("keys", help="manage tenant API keys").add_subparsers(
        dest="action", required=True, metavar="{create,list,revoke}"
    )
    create = keys.add_parser("create", help="create a key (printed once)")
    create.add_argument("--tenant", required=True, metavar="TENANT_ID")
    create.add_argument("--name", default="")
    create.add_argument("--expires-in-days", type=_positive_days)
    _add_limits(create)
    create.add_argument("--adapters", type=_name_list, help="allowed adapters, comma-separated")
    create.set_defaults(func=_handler(_keys_create))
    listing = keys.add_parser("list", help="list a tenant's keys")
    listing.add_argument("--tenant", required=True, metavar="TENANT_ID")
    listing.set_defaults(func=_handler(_keys_list))
    revoke = keys.add_parser("revoke", help="revoke a key")
    revoke.add_argument("key_id", metavar="KEY_ID")
    revoke.set_defaults(func=_handler(_keys_revoke))

    admin = subparsers.add_parser("admin-keys", help="manage admin keys").add_subparsers(
        dest="action", required=True, metavar="{create,list,revoke}"
    )
    create = admin.add_parser("create", help="create an admin key (printed once)")
    create.add_argument("--name", required=True)
    create.set_defaults(func=_handler(_admin_create))
    admin.add_parser("list", help="list admin keys").set_defaults(func=_handler(_admin_list))
    revoke = admin.add_parser("revoke", help="revoke an admin key")
    revoke.add_argument("key_id", metavar="KEY_ID")
    revoke.set_defaults(func=_handler(_admin_revoke))
