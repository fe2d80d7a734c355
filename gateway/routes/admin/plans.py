"""Plans: limits, allowed models and tiers, budget."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from fastapi import APIRouter

from gateway.deps import SessionDep, StateDep
from gateway.errors import not_found
from gateway.schemas.admin import Id, PlanCreate, PlanOut, PlanUpdate
from tenancy import plans
from tenancy.fields import usd_to_micros

router = APIRouter(prefix="/plans", tags=["admin"])


def _micros(usd: Decimal | None) -> int | None:
    return None if usd is None else usd_to_micros(usd)


@router.post("", status_code=201)
async def create_plan(body: PlanCreate, session: SessionDep) -> PlanOut:
    fields: dict[str, Any] = body.model_dump(exclude={"budget_usd"})
    plan = await plans.create_plan(session, budget_micros=_micros(body.budget_usd), **fields)
    return PlanOut.model_validate(plan)


@router.get("")
async def list_plans(session: SessionDep) -> list[PlanOut]:
    return [PlanOut.model_validate(p) for p in await plans.list_plans(session)]


@router.get("/{plan_id}")
async def get_plan(plan_id: Id, session: SessionDep) -> PlanOut:
    plan = await plans.get_plan(session, plan_id=plan_id)
    if plan is None:
        raise not_found(f"No plan with id '{plan_id}'.")
    return PlanOut.model_validate(plan)


@router.patch("/{plan_id}")
async def update_plan(
    plan_id: Id, body: PlanUpdate, session: SessionDep, state: StateDep
) -> PlanOut:
    fields = body.model_dump(exclude_unset=True)
    if "budget_usd" in fields:
        fields["budget_micros"] = _micros(fields.pop("budget_usd"))
    plan = await plans.update_plan(session, plan_id=plan_id, **fields)
    if plan is None:
        raise not_found(f"No plan with id '{plan_id}'.")
    await state.watcher.catch_up()
    return PlanOut.model_validate(plan)
