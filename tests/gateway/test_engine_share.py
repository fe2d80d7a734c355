"""The engine share a request runs under: the key's tenant and plan, and a priority the
request may only make less urgent."""

from __future__ import annotations

import pytest

from gateway.deployments.base import EngineShare
from gateway.errors import APIError
from gateway.request_path import engine_share
from tenancy.context import PlanLimits

PLAN = PlanLimits(engine_weight=2.5, priority=-2)


def test_the_plan_decides_unless_the_request_asks_a_later_priority():
    assert engine_share("t1", PLAN, None) == EngineShare("t1", 2.5, -2)
    assert engine_share("t1", PLAN, -2) == EngineShare("t1", 2.5, -2)
    assert engine_share("t1", PLAN, 7) == EngineShare("t1", 2.5, 7)


def test_more_urgent_than_the_plan_is_refused_by_name():
    with pytest.raises(APIError) as caught:
        engine_share("t1", PLAN, -3)
    assert caught.value.status == 400 and caught.value.body()["error"]["param"] == "priority"
