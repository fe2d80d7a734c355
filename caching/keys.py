"""Canonical cache keys and semantic scopes from an OpenAI request body.

A key must change whenever the answer could change, and must not change for fields that only
affect delivery (stream, user, the public model name). Everything is hashed from canonical
JSON so that key order, whitespace and equivalent spellings (a str `stop` or a list of one,
string content or a list of text parts) give the same key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

# Sampling parameters that change what the model produces.
OUTPUT_PARAMS: tuple[str, ...] = (
    "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed", "max_tokens",
    "max_completion_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "min_tokens", "ignore_eos", "logprobs", "top_logprobs",
)
# Fields that only affect delivery or bookkeeping, never the answer. Every other field shapes
# it (tools, response_format, logit_bias, guided_*, vendor extras, ...): leaving one out would
# let a request with tools or a JSON schema be answered from a plain one.
DELIVERY_FIELDS = frozenset({
    "model", "messages", "prompt", "stream", "stream_options", "user", "metadata", "store",
    "safety_identifier", "prompt_cache_key", "service_tier",
})
# Longer texts are not embedded: the embedder reads at most 256 word pieces, so two long
# prompts that differ only after that would look identical to it.
MAX_SEMANTIC_CHARS = 1000
_PROMPT_ROLES = ("system", "developer")


def exact_key(*, tenant_id: str, model_key: str, chat: bool, body: Mapping[str, Any],
              variant: Mapping[str, Any] | None = None) -> str:
    """sha256 hex of everything that determines the answer, tenant and model first.

    `variant`: what the client asked outside the body that may change the answer (Messages'
    `anthropic-version` and `anthropic-beta`); None or empty leaves the key as without it."""
    doc = _header("exact", tenant_id, model_key, chat, body, variant)
    if chat:
        doc["messages"] = [_message(m) for m in _messages(body)]
    else:
        doc["prompt"] = _plain(body.get("prompt"))
    return _digest(doc)


def is_deterministic(body: Mapping[str, Any]) -> bool:
    """Whether asking again gives the same answer: greedy sampling or a fixed seed."""
    temperature = body.get("temperature")
    greedy = (isinstance(temperature, int | float) and not isinstance(temperature, bool)
              and temperature == 0)
    return greedy or body.get("seed") is not None


def semantic_scope(*, tenant_id: str, model_key: str, chat: bool,
                   body: Mapping[str, Any], variant: Mapping[str, Any] | None = None) -> str:
    """Hash of everything but the question: only requests in one scope may match semantically.

    That is the tenant, model, system/developer prompts, the conversation before (and after)
    the last user message, every output-changing parameter, and the `variant` (as in
    `exact_key`).
    """
    doc = _header("semantic", tenant_id, model_key, chat, body, variant)
    if chat:
        messages = [_message(m) for m in _messages(body)]
        last = _last_user_index(messages)
        if last is not None:
            messages[last] = {"role": "user", "content": None}  # the question's place
        doc["system"] = [m.get("content") for m in messages if m.get("role") in _PROMPT_ROLES]
        doc["messages"] = messages
    return _digest(doc)


def semantic_text(*, chat: bool, body: Mapping[str, Any]) -> str | None:
    """The question to embed, or None when there is none that can be compared by meaning."""
    if chat:
        messages = [_message(m) for m in _messages(body)]
        last = _last_user_index(messages)
        content = None if last is None else messages[last].get("content")
        text = content if isinstance(content, str) else None  # None: images and other parts
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        text = prompt if isinstance(prompt, str) else None  # token ids and batches: no
    if text is None:
        return None
    text = text.strip()
    return text if 0 < len(text) <= MAX_SEMANTIC_CHARS else None


def _header(kind: str, tenant_id: str, model_key: str, chat: bool,
            body: Mapping[str, Any], variant: Mapping[str, Any] | None) -> dict[str, Any]:
    params = {name: _param(name, body.get(name)) for name in OUTPUT_PARAMS}
    shaping = {name: _plain(value) for name, value in body.items()
               if value is not None and name not in DELIVERY_FIELDS
               and name not in OUTPUT_PARAMS}
    doc = {"v": 1, "kind": kind, "tenant": tenant_id, "model": model_key, "chat": bool(chat),
           "params": params, "shaping": shaping}
    if variant:  # only then: every other request's key is as it always was
        doc["variant"] = _plain(variant)
    return doc


def _param(name: str, value: Any) -> Any:
    if name == "stop" and isinstance(value, str):
        return [value]
    if name == "stop" and value == []:
        return None
    return _plain(value)


def _messages(body: Mapping[str, Any]) -> list[Any]:
    messages = body.get("messages")
    return list(messages) if isinstance(messages, list | tuple) else []


def _message(message: Any) -> dict[str, Any]:
    """A message with its content in one spelling: text parts joined into one string."""
    if not isinstance(message, Mapping):
        return {"raw": _plain(message)}
    out = {str(k): _plain(v) for k, v in message.items() if v is not None}
    content = message.get("content")
    if isinstance(content, list | tuple) and all(_is_text_part(p) for p in content):
        out["content"] = "".join(p["text"] for p in content)
    return out


def _is_text_part(part: Any) -> bool:
    return (isinstance(part, Mapping) and part.get("type") == "text"
            and isinstance(part.get("text"), str))


def _last_user_index(messages: list[dict[str, Any]]) -> int | None:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            return i
    return None


def _plain(value: Any) -> Any:
    """JSON-ready and canonical: integral floats as ints (0.0 and 0 are the same setting)."""
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def _digest(doc: Mapping[str, Any]) -> str:
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(raw.encode()).hexdigest()
