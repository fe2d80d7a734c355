"""The cached auth snapshots: usability reasons and model/tier/adapter scopes."""

from __future__ import annotations

import dataclasses

import pytest

from tenancy.context import AdminContext, KeyContext, PlanLimits

NOW = 1_700_000_000.0


def make_ctx(**overrides: object) -> KeyContext:
    fields: dict[str, object] = {
        "key_id": "abcdefgh1234",
        "tenant_id": "t1",
        "tenant_name": "acme",
        "secret_hash": "f" * 64,
        "expires_at": None,
        "revoked": False,
        "tenant_active": True,
        "plan": PlanLimits(),
    }
    fields.update(overrides)
    return KeyContext(**fields)  # type: ignore[arg-type]


def test_a_plain_key_is_usable() -> None:
    assert make_ctx().usable(NOW) is None
    assert make_ctx(expires_at=NOW + 1).usable(NOW) is None


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"revoked": True}, "revoked"),
        ({"expires_at": NOW}, "expired"),
        ({"expires_at": NOW - 10}, "expired"),
        ({"tenant_active": False}, "tenant suspended"),
        ({"revoked": True, "tenant_active": False, "expires_at": NOW - 1}, "revoked"),
        ({"tenant_active": False, "expires_at": NOW - 1}, "expired"),
    ],
)
def test_unusable_reasons(overrides: dict[str, object], reason: str) -> None:
    assert make_ctx(**overrides).usable(NOW) == reason


def test_models_must_be_admitted_by_plan_and_key() -> None:
    assert make_ctx().may_use_model("anything")
    plan_only = make_ctx(plan=PlanLimits(allowed_models=frozenset({"a", "b"})))
    assert plan_only.may_use_model("a") and not plan_only.may_use_model("c")
    key_only = make_ctx(allowed_models=frozenset({"b", "c"}))
    assert key_only.may_use_model("c") and not key_only.may_use_model("a")
    both = make_ctx(
        plan=PlanLimits(allowed_models=frozenset({"a", "b"})), allowed_models=frozenset({"b", "c"})
    )
    assert [m for m in "abcd" if both.may_use_model(m)] == ["b"]
    nothing = make_ctx(allowed_models=frozenset())
    assert not nothing.may_use_model("a")


def test_tiers_and_adapters() -> None:
    assert make_ctx().may_use_tier("premium")
    limited = make_ctx(
        plan=PlanLimits(allowed_tiers=frozenset({"economy"})), allowed_adapters=frozenset({"x"})
    )
    assert limited.may_use_tier("economy") and not limited.may_use_tier("premium")
    assert limited.may_use_adapter("x") and not limited.may_use_adapter("y")
    assert make_ctx().may_use_adapter("y")


def test_snapshots_are_immutable_and_hide_hashes_in_repr() -> None:
    ctx = make_ctx()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.revoked = True  # type: ignore[misc]
    assert "f" * 64 not in repr(ctx)
    admin = AdminContext(key_id="k", name="ops", secret_hash="e" * 64, revoked=False)
    assert "e" * 64 not in repr(admin)


def test_cache_settings_default_and_semantic_threshold_precedence() -> None:
    plan = PlanLimits()
    assert (plan.cache_mode, plan.semantic_threshold, plan.cache_ttl_s,
            plan.cache_hit_price_percent) == ("auto", None, None, 0)
    assert make_ctx().tenant_semantic_threshold is None
    assert make_ctx().semantic_threshold(0.92) == 0.92  # neither: the gateway's default
    planned = make_ctx(plan=PlanLimits(cache_mode="semantic", semantic_threshold=0.8))
    assert planned.semantic_threshold(0.92) == 0.8
    both = make_ctx(plan=PlanLimits(semantic_threshold=0.8), tenant_semantic_threshold=0.95)
    assert both.semantic_threshold(0.92) == 0.95
    tenant_only = make_ctx(tenant_semantic_threshold=0.7)
    assert tenant_only.semantic_threshold(0.92) == 0.7


def test_engine_share_defaults() -> None:
    """A plan that says nothing gets an even share and the middle priority."""
    plan = PlanLimits()
    assert (plan.engine_weight, plan.priority) == (1.0, 0)
    assert isinstance(plan.engine_weight, float)
    assert make_ctx().plan.engine_weight == 1.0
    shared = make_ctx(plan=PlanLimits(engine_weight=2.5, priority=-3))
    assert (shared.plan.engine_weight, shared.plan.priority) == (2.5, -3)
