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
from tenancy import admin_keys, api_keys, fields, plans, tenants
from tenancy.db import make_engine, make_sessionmaker
from tenancy.errors import ServiceError
from tenancy.fields import Choice, Names, Number
from tenancy.keys import load_or_create_pepper
from tenancy.models import AdminKey, ApiKey, Plan, Tenant, utcnow

Handler = Callable[[argparse.Namespace, Settings], int]
Action = Callable[[AsyncSession, argparse.Namespace, Settings], Awaitable[Any]]


class CommandError(Exception):
    """A user-facing failure: printed as `error: <message>` with exit code 1."""


# --- flags from tenancy.fields ------------------------------------------------------------


def _name_list(value: str) -> list[str]:
    """`a,b` -> ["a", "b"]; an empty string means "none allowed"."""
    return [part.strip() for part in value.split(",") if part.strip()]


def _number(field: Number) -> Callable[[str], Any]:
    def parse(value: str) -> Any:
        try:
            return field.parse(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _usd_to_micros(value: str) -> int:
    try:
        usd = Decimal(value)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not an amount in USD: {value!r}") from None
    if not usd.is_finite() or not 0 <= usd <= fields.BUDGET_USD_MAX:
        raise argparse.ArgumentTypeError(
            f"must be an amount from 0 to {fields.BUDGET_USD_MAX}: {value!r}")
    return fields.usd_to_micros(usd, rounding=ROUND_HALF_UP)


def _positive_days(value: str) -> float:
    try:
        days = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of days: {value!r}") from None
    if not days > 0 or days > 365_000:
        raise argparse.ArgumentTypeError(f"must be a positive number of days: {value!r}")
    return days


# The allow-lists' flags are shorter than their fields' names.
_FLAGS = {"allowed_models": "--models", "allowed_tiers": "--tiers",
          "allowed_adapters": "--adapters"}


def _add_setting(parser: argparse.ArgumentParser, field: Number | Choice | Names, *,
                 help: str = "") -> None:
    """A plan's, tenant's or key's setting as a flag: its type, bounds, default and help are
    the field's declaration; the value lands in `args.<field name>`."""
    flag = _FLAGS.get(field.name) or "--" + field.name.replace("_", "-")
    text = help or field.help
    if isinstance(field, Number):
        default = f"default: {field.unset}" if field.nullable else f"default {field.default:g}"
        parser.add_argument(flag, dest=field.name, type=_number(field), default=field.default,
                            help=f"{text}, in {field.interval} ({default})".replace("%", "%%"))
    elif isinstance(field, Choice):
        parser.add_argument(flag, dest=field.name, choices=field.options,
                            default=field.default, help=text)
    else:
        parser.add_argument(flag, dest=field.name, type=_name_list, metavar="NAMES",
                            help=f"{text}, comma-separated")


# --- JSON views (never include secret hashes) ---------------------------------------------


def plan_json(plan: Plan) -> dict[str, Any]:
    """A plan as printed by the CLI: the admin API's view, plus the budget in USD."""
    data = PlanOut.model_validate(plan).model_dump(mode="json")
    micros = plan.budget_micros
    data["budget_usd"] = None if micros is None else micros / fields.MICROS_PER_USD
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
        except (CommandError, ServiceError) as exc:
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
    tenant = await tenants.get_tenant(session, tenant_id=ref)
    if tenant is None:
        tenant = await tenants.get_tenant_by_name(session, name=ref)
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
    settings = {name: getattr(args, name) for name in fields.PLAN_SETTINGS}
    plan = await plans.create_plan(session, name=args.name, **settings)
    return plan_json(plan)


async def _plans_list(session: AsyncSession, _args: argparse.Namespace, _: Settings) -> Any:
    return [plan_json(plan) for plan in await plans.list_plans(session)]


# --- tenants ------------------------------------------------------------------------------


async def _tenants_create(session: AsyncSession, args: argparse.Namespace, _: Settings) -> Any:
    plan = await plans.get_plan_by_name(session, name=args.plan)
    if plan is None:
        plan = await plans.get_plan(session, plan_id=args.plan)
    if plan is None:
        raise CommandError(f"no plan named {args.plan!r} (see `switchboard plans list`)")
    tenant = await tenants.create_tenant(
        session, name=args.name, plan_id=plan.id, semantic_threshold=args.semantic_threshold
    )
    return tenant_json(tenant)


async def _tenants_list(session: AsyncSession, _args: argparse.Namespace, _: Settings) -> Any:
    return [tenant_json(tenant) for tenant in await tenants.list_tenants(session)]


def _set_status(status: str) -> Action:
    async def action(session: AsyncSession, args: argparse.Namespace, _: Settings) -> Any:
        tenant = await _resolve_tenant(session, args.tenant)
        updated = await tenants.update_tenant(session, tenant_id=tenant.id, status=status)
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
    limits = {field.name: getattr(args, field.name) for field in fields.KEY_LIMITS}
    record, full_key = await api_keys.create_api_key(
        session,
        tenant_id=tenant.id,
        pepper=_pepper(settings),
        name=args.name,
        expires_at=expires_at,
        allowed_models=args.allowed_models,
        allowed_adapters=args.allowed_adapters,
        **limits,
    )
    print("Store this key now: it is shown only once.", file=sys.stderr)
    return {**api_key_json(record), "key": full_key}


async def _keys_list(session: AsyncSession, args: argparse.Namespace, _: Settings) -> Any:
    tenant = await _resolve_tenant(session, args.tenant)
    return [api_key_json(key) for key in await api_keys.list_api_keys(session, tenant_id=tenant.id)]


async def _keys_revoke(session: AsyncSession, args: argparse.Namespace, _: Settings) -> Any:
    key = await api_keys.revoke_api_key(session, key_id=args.key_id)
    if key is None:
        raise CommandError(f"no key with id {args.key_id!r}")
    return api_key_json(key)


# --- admin keys ---------------------------------------------------------------------------


async def _admin_create(session: AsyncSession, args: argparse.Namespace, settings: Settings) -> Any:
    record, full_key = await admin_keys.create_admin_key(
        session, pepper=_pepper(settings), name=args.name
    )
    print("Store this key now: it is shown only once.", file=sys.stderr)
    return {**admin_key_json(record), "key": full_key}


async def _admin_list(session: AsyncSession, _args: argparse.Namespace, _: Settings) -> Any:
    return [admin_key_json(key) for key in await admin_keys.list_admin_keys(session)]


async def _admin_revoke(session: AsyncSession, args: argparse.Namespace, _: Settings) -> Any:
    key = await admin_keys.revoke_admin_key(session, key_id=args.key_id)
    if key is None:
        raise CommandError(f"no admin key with id {args.key_id!r}")
    return admin_key_json(key)


# --- parser -------------------------------------------------------------------------------


def register(subparsers: Any) -> None:
    """Add `migrate`, `plans`, `tenants`, `keys` and `admin-keys` to a CLI's subparsers."""
    migrate = subparsers.add_parser("migrate", help="create or upgrade the database schema")
    migrate.add_argument("--revision", default="head", help=argparse.SUPPRESS)
    migrate.set_defaults(func=_migrate)

    plan_actions = subparsers.add_parser("plans", help="manage plans").add_subparsers(
        dest="action", required=True, metavar="{create,list}"
    )
    create = plan_actions.add_parser("create", help="create a plan")
    create.add_argument("--name", required=True)
    for field in fields.PLAN_SETTINGS.values():
        if field is fields.BUDGET_MICROS:  # typed in USD
            create.add_argument("--budget-usd", dest=field.name, type=_usd_to_micros,
                                metavar="USD", help="spend cap per period, USD, from 0 to "
                                f"{fields.BUDGET_USD_MAX} (default: unlimited)")
        else:
            _add_setting(create, field)
    create.set_defaults(func=_handler(_plans_create))
    plan_actions.add_parser("list", help="list plans").set_defaults(func=_handler(_plans_list))

    tenant_actions = subparsers.add_parser("tenants", help="manage tenants").add_subparsers(
        dest="action", required=True, metavar="{create,list,suspend,activate}"
    )
    create = tenant_actions.add_parser("create", help="create a tenant")
    create.add_argument("--name", required=True)
    create.add_argument("--plan", required=True, help="plan name")
    _add_setting(create, fields.SEMANTIC_THRESHOLD,
                 help="overrides the plan's semantic-cache threshold")
    create.set_defaults(func=_handler(_tenants_create))
    tenant_actions.add_parser("list", help="list tenants").set_defaults(
        func=_handler(_tenants_list))
    for action, status in (("suspend", "suspended"), ("activate", "active")):
        parser = tenant_actions.add_parser(action, help=f"mark a tenant {status}")
        parser.add_argument("tenant", metavar="TENANT_ID")
        parser.set_defaults(func=_handler(_set_status(status)))

    key_actions = subparsers.add_parser("keys", help="manage tenant API keys").add_subparsers(
        dest="action", required=True, metavar="{create,list,revoke}"
    )
    create = key_actions.add_parser("create", help="create a key (printed once)")
    create.add_argument("--tenant", required=True, metavar="TENANT_ID")
    create.add_argument("--name", default="")
    create.add_argument("--expires-in-days", type=_positive_days)
    for field in (*fields.KEY_LIMITS, fields.ALLOWED_MODELS, fields.ALLOWED_ADAPTERS):
        _add_setting(create, field)
    create.set_defaults(func=_handler(_keys_create))
    listing = key_actions.add_parser("list", help="list a tenant's keys")
    listing.add_argument("--tenant", required=True, metavar="TENANT_ID")
    listing.set_defaults(func=_handler(_keys_list))
    revoke = key_actions.add_parser("revoke", help="revoke a key")
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
