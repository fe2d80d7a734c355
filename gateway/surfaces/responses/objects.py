"""The Response object and its output items, as the body, the stream's last event and the
stored copy give them: made once per request from the folded answer (`from_fold`), with the
ids of its items, its status, usage and error."""

from __future__ import annotations

import time
from typing import Any

from gateway.surfaces.responses.turn import Turn, turn_of
from workers.protocol.events import Failed, Usage
from workers.protocol.render import Fold
from workers.protocol.requests import OpenAIRequest


def status_of(reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """The Response's status and incomplete_details for a chat finish reason."""
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def usage_json(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens,
            # cache writes cost nothing extra here (the engine's prefix cache is automatic)
            "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def error_json(failed: Failed) -> dict[str, Any]:
    code = "rate_limit_exceeded" if failed.status == 429 else "server_error"
    return {"code": code, "message": failed.message}


def response_object(turn: Turn, *, status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None, model: str | None = None,
                    incomplete: dict[str, Any] | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    finished = status in ("completed", "incomplete", "failed")
    if finished and turn.completed_at is None:
        turn.completed_at = int(time.time())
    return {"id": turn.response_id, "object": "response", "created_at": turn.created_at,
            "status": status, "background": False, "error": error,
            "incomplete_details": incomplete, "model": model or turn.model, "output": output,
            "usage": usage, "completed_at": turn.completed_at if status == "completed"
            else None, **turn.echo}


def message_id(turn: Turn, n: int = 0) -> str:
    return f"msg_{turn.hex}" if n == 0 else f"msg_{turn.hex}_{n}"


def call_item_id(turn: Turn, k: int) -> str:
    return f"fc_{turn.hex}_{k}"


def text_content(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [],
            "logprobs": list(logprobs or [])}


def output_of(turn: Turn, fold: Fold) -> tuple[list[dict[str, Any]], str, dict[str, Any] | None]:
    """A folded answer's output items, status and incomplete_details: its message (text, a
    refusal), then its function calls, the last item incomplete where the answer is."""
    response = fold.response()
    choice = (response.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    status, incomplete = status_of(choice.get("finish_reason"))
    items: list[dict[str, Any]] = []
    text, refusal = message.get("content") or "", message.get("refusal")
    calls = message.get("tool_calls") or []
    if text or refusal or not calls:
        content = []
        if text or not refusal:
            logprobs = (choice.get("logprobs") or {}).get("content") if turn.logprobs else None
            content.append(text_content(text, logprobs))
        if refusal:
            content.append({"type": "refusal", "refusal": refusal})
        items.append({"type": "message", "id": message_id(turn), "status": "completed",
                      "role": "assistant", "content": content})
    for k, call in enumerate(calls):
        function = call.get("function") or {}
        items.append({"type": "function_call", "id": call_item_id(turn, k),
                      "call_id": call.get("id") or f"call_{turn.hex}_{k}",
                      "name": function.get("name") or "",
                      "arguments": function.get("arguments") or "", "status": "completed"})
    if status == "incomplete" and items:
        items[-1]["status"] = "incomplete"
    return items, status, incomplete


def from_fold(turn: Turn, fold: Fold) -> dict[str, Any]:
    """A finished answer as the Response object, made once per request (the body, the stream's
    last event and the stored copy are the same object)."""
    if turn.answer is None:
        turn.answer = _from_fold(turn, fold)
    return turn.answer


def _from_fold(turn: Turn, fold: Fold) -> dict[str, Any]:
    items, status, incomplete = output_of(turn, fold)
    model = fold.opened.model if fold.opened is not None else None
    if fold.failed is not None:
        return response_object(turn, status="failed", output=items, model=model,
                               usage=usage_json(fold.usage), error=error_json(fold.failed))
    return response_object(turn, status=status, output=items, usage=usage_json(fold.usage),
                           model=model, incomplete=incomplete)


def whole(request: OpenAIRequest, fold: Fold) -> dict[str, Any]:
    return from_fold(turn_of(request), fold)
