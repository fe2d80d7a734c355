"""Which response caches a request may use, and looking up and storing through them.

Every key and scope starts with the tenant id, and the stores partition by tenant too, so no
lookup can return another tenant's answer. Exact answers are reused by default only when the
output is deterministic (temperature 0 or a fixed seed); a plan or the request can opt in to
more (`x-switchboard-cache: exact|semantic|off`). `Cache-Control: no-cache` skips the lookup
(and stores the fresh answer); `no-store` stores nothing.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from caching.embedder import Embedder
from caching.exact import ExactCache
from caching.keys import exact_key, is_deterministic, semantic_scope, semantic_text
from caching.semantic import DEFAULT_THRESHOLD, SemanticCache
from gateway.deployments.native import cache_variant
from tenancy.context import KeyContext
from workers.protocol.requests import OpenAIRequest

logger = logging.getLogger(__name__)
MODES = ("off", "auto", "exact", "semantic")


@dataclass
class CacheUse:
    """One request's use of the caches."""

    tenant_id: str
    lookup: bool
    store: bool
    exact_key: str | None
    scope: str | None = None  # semantic
    text: str | None = None
    threshold: float = DEFAULT_THRESHOLD
    ttl_s: float = 3600.0
    vector: np.ndarray | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class Hit:
    body: dict[str, Any]
    kind: str  # "exact" or "semantic"
    similarity: float | None = None


@dataclass
class ResponseCache:
    exact: ExactCache
    semantic: SemanticCache
    embedder: Embedder
    default_ttl_s: float = 3600.0
    default_threshold: float = DEFAULT_THRESHOLD

    def use(self, headers: Mapping[str, str], key: KeyContext, request: OpenAIRequest, *,
            chat: bool, model_key: str) -> CacheUse | None:
        """None when no cache applies to this request."""
        mode = _mode(key.plan.cache_mode, headers.get("x-switchboard-cache"))
        # Answers with logprobs are not cached: a replayed stream could not carry them.
        if mode == "off" or request.wants_logprobs:
            return None
        directives = _directives(headers.get("cache-control", ""))
        body = request.upstream_body()
        if mode == "auto" and not is_deterministic(body):
            return None
        lookup = "no-cache" not in directives
        store = "no-store" not in directives
        if not (lookup or store):
            return None
        tenant = key.tenant_id
        # Messages' anthropic-version and anthropic-beta, where the client gave them: a beta
        # can change what a native upstream answers, so it is another entry (None: any other
        # request, keyed as it always was).
        variant = cache_variant(request)
        use = CacheUse(tenant, lookup, store,
                       exact_key(tenant_id=tenant, model_key=model_key, chat=chat, body=body,
                                 variant=variant),
                       ttl_s=float(key.plan.cache_ttl_s or self.default_ttl_s))
        if mode == "semantic":
            use.text = semantic_text(chat=chat, body=body)
            if use.text is not None:
                use.scope = semantic_scope(tenant_id=tenant, model_key=model_key, chat=chat,
                                           body=body, variant=variant)
                use.threshold = key.semantic_threshold(self.default_threshold)
        return use

    async def lookup(self, use: CacheUse) -> Hit | None:
        if not use.lookup:
            return None
        if use.exact_key is not None:
            raw = await self.exact.get(use.tenant_id, use.exact_key)
            if raw is not None:
                return _hit(raw, "exact", None)
        if use.scope is None or use.text is None:
            return None
        use.vector = await self.embedder.embed_checked(use.text)
        if use.vector is None:  # longer than the embedder's window: no meaningful match
            use.scope = None
            return None
        found = await self.semantic.lookup(use.tenant_id, use.scope, use.vector,
                                           threshold=use.threshold, text=use.text)
        return None if found is None else _hit(found.value, "semantic", found.similarity)

    async def store(self, use: CacheUse, response: dict[str, Any]) -> None:
        """Keep a finished answer (off the request's path: the caller runs this as a task)."""
        if not use.store:
            return
        raw = json.dumps(response, separators=(",", ":")).encode()
        if use.exact_key is not None:
            await self.exact.put(use.tenant_id, use.exact_key, raw, ttl_s=use.ttl_s)
        if use.scope is not None and use.text is not None:
            vector = use.vector if use.vector is not None else (
                await self.embedder.embed_checked(use.text))
            if vector is None:
                return
            await self.semantic.store(use.tenant_id, use.scope, vector, raw, ttl_s=use.ttl_s,
                                      text=use.text)

    async def close(self) -> None:
        await self.exact.close()
        await self.semantic.close()
        await self.embedder.close()


def fresh(hit: Hit, *, response_id: str, model: str) -> dict[str, Any]:
    """A cached answer with this request's id, time and model name."""
    return {**hit.body, "id": response_id, "created": int(time.time()), "model": model}


# What a cached answer may hold: a replay must give back exactly what was stored, streamed
# or not (workers/protocol/render.py): anything else (refusals, audio, annotations) is not
# cached.
_REPLAYABLE_MESSAGE = frozenset({"role", "content", "tool_calls"})
_REPLAYABLE_CALL = frozenset({"id", "type", "function"})


def cacheable(response: dict[str, Any]) -> bool:
    """Only whole answers that a replay reproduces: every choice finished (stop, the token
    limit, or tool calls), holding text and function calls only."""
    choices = response.get("choices")
    return bool(choices) and all(_replayable(c) for c in choices)


def _replayable(choice: Any) -> bool:
    if not isinstance(choice, dict) or choice.get("finish_reason") not in (
            "stop", "length", "tool_calls"):
        return False
    message = choice.get("message")
    if message is None:
        return isinstance(choice.get("text"), str)  # a text completion
    if not isinstance(message, dict) or not set(message) <= _REPLAYABLE_MESSAGE:
        return False
    calls = message.get("tool_calls") or []
    return isinstance(calls, list) and all(
        isinstance(c, dict) and set(c) <= _REPLAYABLE_CALL and isinstance(c.get("id"), str)
        and isinstance(c.get("function"), dict)
        and isinstance(c["function"].get("name"), str)
        and isinstance(c["function"].get("arguments"), str) for c in calls)


def _hit(raw: bytes, kind: str, similarity: float | None) -> Hit | None:
    try:
        body = json.loads(raw)
    except ValueError:
        logger.warning("dropping an unreadable %s cache entry", kind)
        return None
    return Hit(body, kind, similarity) if isinstance(body, dict) else None


def _mode(plan_mode: str, asked: str | None) -> str:
    """The plan's mode, widened or switched off by the request's header ("off" always wins)."""
    asked = (asked or "").strip().lower()
    if plan_mode == "off" or asked == "off":
        return "off"
    if asked in MODES and MODES.index(asked) > MODES.index(plan_mode):
        return asked
    return plan_mode


def _directives(value: str) -> set[str]:
    return {part.strip().split("=", 1)[0].lower() for part in value.split(",") if part.strip()}

