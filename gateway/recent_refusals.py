"""Keys whose requests-per-minute limit refused a request a moment ago: refused again before
their body is parsed.

A request's body is read, parsed and estimated before the limiter sees it (the estimate needs
the prompt). For a key already over its RPM that is wasted work: within its retry-after no
request of it can be admitted, whatever it carries (the window only fills). A tenant flooding
the gateway from a 3-RPM key was making the loop parse a 3.5 MB body per refusal. So an RPM
refusal is remembered, per scope, for `hold_s` (or its retry-after, if sooner), and requests
of that key or tenant are refused from the memory right after authentication, their body
received and dropped unparsed (`gateway.admission.refuse_if_held`). Only
`rpm` is remembered: a TPM, concurrency or budget refusal depends on the request or on others'
finishing, so a later request may pass.

The answer waits out what is left of the hold before it is sent. A client that retries at once
then sends one request per connection and hold, not hundreds a second: a flood of 429s at 680
a second from four connections had made the loop itself the bottleneck (/health/live up to
272 ms). Waiting costs an idle coroutine, and the client had to wait anyway (its retry-after
is longer than the hold).

The hold is short (1 s by default) because the memory is this replica's alone and a slot can
come free early (an admission that never ran gives its reservation back, an admin raises a
limit); within the hold the client gets the same 429 it would have got a moment before.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

from tenancy.context import KeyContext
from tenancy.limits import Decision


@dataclass(frozen=True)
class Refusal:
    """A held refusal as it stands now: the decision to answer with, and how much longer
    the hold lasts (the answer waits that out)."""

    decision: Decision
    hold_left_s: float


@dataclass(frozen=True)
class _Held:
    until: float
    at: float
    decision: Decision


class RecentRefusals:
    """Per-scope memory of RPM refusals, bounded to `max_scopes` (the oldest go first)."""

    def __init__(self, *, hold_s: float = 1.0, max_scopes: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self.max_scopes = max_scopes
        self._clock = clock
        self._held: OrderedDict[str, _Held] = OrderedDict()

    def remember(self, decision: Decision) -> None:
        """Keep an RPM refusal of a scope ("key:<id>" or "tenant:<id>"); others are ignored."""
        if self.hold_s <= 0 or decision.admitted or decision.reason != "rpm":
            return
        if not decision.scope or decision.retry_after_s <= 0:
            return
        now = self._clock()
        until = now + min(self.hold_s, decision.retry_after_s)
        self._held[decision.scope] = _Held(until, now, decision)
        self._held.move_to_end(decision.scope)
        while len(self._held) > self.max_scopes:
            self._held.popitem(last=False)

    def refusal(self, key: KeyContext) -> Refusal | None:
        """The refusal still in force for this key or its tenant, its waits shortened by the
        time since, and how long it is still held; None when neither is held."""
        if not self._held:
            return None
        now = self._clock()
        for scope in (f"key:{key.key_id}", f"tenant:{key.tenant_id}"):
            held = self._held.get(scope)
            if held is None:
                continue
            if now >= held.until:
                del self._held[scope]
                continue
            gone = now - held.at
            d = held.decision
            return Refusal(replace(d, retry_after_s=max(0.0, d.retry_after_s - gone),
                                   reset_requests_s=None if d.reset_requests_s is None
                                   else max(0.0, d.reset_requests_s - gone)),
                           held.until - now)
        return None
