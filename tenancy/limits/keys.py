"""Where the Redis backend keeps each counter: ``sb:rl[:<namespace>]:<kind>:...``."""

from __future__ import annotations


class KeySpace:
    """Key names for one namespace; namespaces keep parallel deployments or tests apart."""

    __slots__ = ("prefix",)

    def __init__(self, namespace: str = "") -> None:
        self.prefix = f"sb:rl:{namespace}:" if namespace else "sb:rl:"

    def requests(self, scope: str) -> str:
        return f"{self.prefix}req:{scope}"

    def tokens(self, scope: str) -> str:
        return f"{self.prefix}tok:{scope}"

    def in_flight(self, scope: str) -> str:
        return f"{self.prefix}run:{scope}"

    def reservation(self, request_id: str) -> str:
        return f"{self.prefix}res:{request_id}"

    def budget(self, scope: str, period: str) -> str:
        return f"{self.prefix}bud:{period}:{scope}"
