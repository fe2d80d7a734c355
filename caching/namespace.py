"""Redis key names: one namespace per tenant that no other tenant's name can reach into.

A tenant id is used as is when it is plain ([A-Za-z0-9_.-]); anything else is replaced by a
digest marked with "~", a character plain ids cannot contain, so two tenants never share a
prefix ("a:b" + key "c" cannot become "a" + key "b:c"). The tenant part is a Redis Cluster hash
tag ({...}), so a tenant's keys live in one slot and its Lua scripts stay single-slot.
"""

from __future__ import annotations

import hashlib
import re

_PLAIN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def tenant_tag(tenant_id: str) -> str:
    """The tenant's part of a key, unambiguous and free of ':' and braces."""
    if _PLAIN.fullmatch(tenant_id):
        return tenant_id
    return "~" + hashlib.sha256(tenant_id.encode()).hexdigest()[:40]


def tenant_prefix(prefix: str, kind: str, tenant_id: str) -> str:
    """e.g. "sb:cache:x:{tenant}:" -- every key of one tenant and one cache kind starts so."""
    return f"{prefix}:{kind}:{{{tenant_tag(tenant_id)}}}:"
