"""An RPM refusal is remembered briefly per key or tenant; nothing else is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.recent_refusals import RecentRefusals
from tenancy.limits import Decision


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def rpm(scope: str, retry: float = 30.0) -> Decision:
    return Decision(admitted=False, reason="rpm", scope=scope, retry_after_s=retry,
                    limit_requests=3, remaining_requests=0, reset_requests_s=retry)


KEY = SimpleNamespace(key_id="k1", tenant_id="t1")
SIBLING = SimpleNamespace(key_id="k2", tenant_id="t1")  # another key of the same tenant
STRANGER = SimpleNamespace(key_id="k3", tenant_id="t2")


def test_a_key_refused_for_rpm_is_held_with_its_waits_shortened():
    clock = Clock()
    memory = RecentRefusals(hold_s=1.0, clock=clock)
    memory.remember(rpm("key:k1"))
    clock.now += 0.4
    held = memory.refusal(KEY)
    assert held is not None and held.hold_left_s == pytest.approx(0.6)
    decision = held.decision
    assert decision.reason == "rpm" and decision.scope == "key:k1"
    assert decision.retry_after_s == pytest.approx(29.6)
    assert decision.reset_requests_s == pytest.approx(29.6)
    assert memory.refusal(SIBLING) is None  # a key scope holds only that key
    assert memory.refusal(STRANGER) is None
    clock.now += 0.6  # the hold is over: the limiter decides again
    assert memory.refusal(KEY) is None


def test_a_tenant_scope_holds_every_key_of_that_tenant():
    memory = RecentRefusals(hold_s=1.0, clock=Clock())
    memory.remember(rpm("tenant:t1"))
    assert memory.refusal(KEY) is not None and memory.refusal(SIBLING) is not None
    assert memory.refusal(STRANGER) is None


def test_the_hold_ends_with_the_retry_after_when_that_is_sooner():
    clock = Clock()
    memory = RecentRefusals(hold_s=5.0, clock=clock)
    memory.remember(rpm("key:k1", retry=0.2))
    clock.now += 0.19
    held = memory.refusal(KEY)
    assert held is not None and held.hold_left_s == pytest.approx(0.01)
    clock.now += 0.02
    assert memory.refusal(KEY) is None


@pytest.mark.parametrize("decision", [
    Decision(admitted=False, reason="tpm", scope="key:k1", retry_after_s=5.0),
    Decision(admitted=False, reason="concurrency", scope="key:k1", retry_after_s=1.0),
    Decision(admitted=False, reason="budget", scope="tenant:t1", retry_after_s=86400.0),
    Decision(admitted=False, reason="unavailable"),
    Decision(admitted=True, scope="key:k1"),
])
def test_only_rpm_refusals_are_remembered(decision):
    """A smaller request may pass TPM, a finished one frees concurrency, an admin may raise
    a budget: the limiter has to see those requests."""
    memory = RecentRefusals(hold_s=1.0, clock=Clock())
    memory.remember(decision)
    assert memory.refusal(KEY) is None


def test_off_and_bounded():
    memory = RecentRefusals(hold_s=0.0, clock=Clock())
    memory.remember(rpm("key:k1"))
    assert memory.refusal(KEY) is None
    memory = RecentRefusals(hold_s=1.0, max_scopes=2, clock=Clock())
    for scope in ("key:k1", "key:k2", "key:k3"):
        memory.remember(rpm(scope))
    assert memory.refusal(KEY) is None  # the oldest went first
    assert memory.refusal(SIBLING) is not None and memory.refusal(STRANGER) is not None
