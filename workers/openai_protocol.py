"""Map OpenAI request bodies onto engine SamplingParams, and errors onto OpenAI's shape."""

from __future__ import annotations

from typing import Any

from workers.engine.sampling_params import InvalidRequestError, SamplingParams

_NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "min_p")
_INTS = ("n", "seed", "top_k", "max_tokens", "min_tokens")


def error_body(message: str, type_: str, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sampling_params(body: dict[str, Any], *, chat: bool) -> SamplingParams:
    """Read OpenAI's names (and vLLM's extras) with strict types; raise InvalidRequestError."""
    kwargs: dict[str, Any] = {}
    for name in _NUMBERS:
        if body.get(name) is not None:
            kwargs[name] = _number(body, name)
    for name in _INTS:
        if body.get(name) is not None:
            kwargs[name] = _int(body, name)
    if chat and body.get("max_completion_tokens") is not None:
        kwargs["max_tokens"] = _int(body, "max_completion_tokens")
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequestError("'stop' must be a string or a list of strings")
        kwargs["stop"] = stop
    if body.get("ignore_eos") is not None:
        kwargs["ignore_eos"] = bool(body["ignore_eos"])
    if chat:
        if body.get("logprobs"):
            kwargs["logprobs"] = _int(body, "top_logprobs") if body.get("top_logprobs") else 0
    elif body.get("logprobs") is not None:
        kwargs["logprobs"] = _int(body, "logprobs")
    kwargs.setdefault("max_tokens", None)
    return SamplingParams(**kwargs)


def _number(body: dict[str, Any], name: str) -> float:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"'{name}' must be a number")
    return float(value)


def _int(body: dict[str, Any], name: str) -> int:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"'{name}' must be an integer")
    return value
