"""Prefix-aware routing: how much of a request's prompt each worker already holds as KV.

Workers report a Bloom summary of their prefix cache's block names (`/stats` "prefix"). For
a pool configured with `prefix_tokenizer`, the gateway renders and tokenizes the request as
the workers will (`workers.client.prompt_token_ids`), names its full blocks with the same
chain hash, block size and salt (the tenant, unless the deployment shares its prefix cache),
and counts the leading blocks each worker's summary holds. Another tenant's identical prompt
names different blocks (its salt differs), so it gets no affinity.

Tokenizing runs in a thread, and only when some candidate reports a summary: the event loop
never tokenizes. Adapter requests are left to adapter residency (an adapter's engine id,
part of the block name, differs between workers).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.deployments.base import Deployment
from workers.engine.prefix_hash import PrefixSummary, chain_hashes
from workers.engine.sampling_params import InvalidRequestError
from workers.protocol.requests import ChatCompletionRequest, OpenAIRequest

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def load_tokenizer(name: str) -> Any:
    """One tokenizer per configured name, loaded on first use (never at import)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def _token_ids(tokenizer_name: str, request: OpenAIRequest) -> list[int]:
    from workers.client import prompt_token_ids

    chat = isinstance(request, ChatCompletionRequest)
    return prompt_token_ids(request.upstream_body(), chat=chat,
                            tokenizer=load_tokenizer(tokenizer_name))


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What prefix-aware routing knows of a request: its prompt's length in tokens (0 when
    it was not tokenized) and, per deployment name, the leading tokens its cache holds."""

    cached: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0


async def cached_tokens(chain: Sequence[Deployment], request: OpenAIRequest | None, *,
                        tenant_id: str) -> PrefixMatch:
    """The prompt tokens each deployment's prefix cache (probably) holds, for those that
    report a summary and are configured with a tokenizer; empty when none is."""
    if request is None:
        return PrefixMatch()
    todo: list[tuple[Deployment, PrefixSummary]] = []
    for d in chain:
        summary = d.prefix_summary() if d.config.prefix_tokenizer else None
        if summary is not None:
            todo.append((d, summary))
    if not todo:
        return PrefixMatch()
    ids: dict[str, list[int]] = {}
    names: dict[tuple[str, int, str | None], list[int]] = {}
    found: dict[str, int] = {}
    for d, summary in todo:
        tokenizer = d.config.prefix_tokenizer
        assert tokenizer is not None
        if tokenizer not in ids:
            try:
                ids[tokenizer] = await asyncio.to_thread(_token_ids, tokenizer, request)
            except (InvalidRequestError, ValueError, TypeError, OSError) as exc:
                # the deployment's own prepare tells the client; routing goes on without
                logger.debug("no prefix affinity for this request: %s", exc)
                return PrefixMatch()
        salt = None if d.config.shared_prefix_cache else tenant_id
        key = (tokenizer, summary.block_size, salt)
        if key not in names:
            names[key] = chain_hashes(ids[tokenizer], summary.block_size, salt)
        found[d.name] = summary.cached_blocks(names[key]) * summary.block_size
    return PrefixMatch(found, max(len(t) for t in ids.values()))
