"""Semantic response caches: answers to earlier questions that mean the same, per tenant.

The protocol, hit type and default threshold live in `semantic_base`; the two backends in
`semantic_memory` (in-process) and `semantic_redis` (shared by replicas). This module is the
one place callers import them from.
"""

from caching.semantic_base import (
    CANDIDATES,
    DEFAULT_THRESHOLD,
    SemanticCache,
    SemanticHit,
    passes_guard,
)
from caching.semantic_memory import MemorySemanticCache
from caching.semantic_redis import RedisSemanticCache

__all__ = [
    "CANDIDATES",
    "DEFAULT_THRESHOLD",
    "MemorySemanticCache",
    "RedisSemanticCache",
    "SemanticCache",
    "SemanticHit",
    "passes_guard",
]
