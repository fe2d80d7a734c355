"""Map OpenAI request bodies onto engine SamplingParams, and errors onto OpenAI's shape."""

from __future__ import annotations

from typing import Any

from workers.engine.sampling_params import InvalidRequestError, SamplingParams
from workers.engine.structured import StructuredOutputs

_NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "min_p")
_INTS = ("n", "seed", "top_k", "max_tokens", "min_tokens", "speculative_tokens")
# vLLM's extras, each a whole constraint; `structured_outputs` holds one of the same keys
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")


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
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = _logit_bias(body["logit_bias"])
    structured = _structured(body)
    if structured is not None:
        kwargs["structured"] = structured
    kwargs.setdefault("max_tokens", None)
    return SamplingParams(**kwargs)


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's shape: token ids as strings -> numbers in [-100, 100]."""
    if not isinstance(value, dict):
        raise InvalidRequestError("'logit_bias' must map token ids to numbers",
                                  param="logit_bias")
    bias: dict[int, float] = {}
    for key, number in value.items():
        if not isinstance(key, str) or not key.isdigit() or len(key) > 9:
            raise InvalidRequestError(f"'logit_bias' keys must be token ids as strings, not "
                                      f"{key!r}", param="logit_bias")
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise InvalidRequestError("'logit_bias' values must be numbers in [-100, 100]",
                                      param="logit_bias")
        bias[int(key)] = float(number)
    return bias  # the range is checked by SamplingParams, the vocabulary by the engine


def _structured(body: dict[str, Any]) -> StructuredOutputs | None:
    """At most one constraint, from response_format, a guided_* extra or structured_outputs.
    Errors name the field as sent (`response_format.json_schema.schema`, `guided_regex`)."""
    found: list[StructuredOutputs] = []
    response_format = body.get("response_format")
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            found.append(spec)
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append(StructuredOutputs(**{kind: body[name]}, param=name))
    if body.get("structured_outputs") is not None:
        found.append(_structured_outputs(body["structured_outputs"]))
    if len(found) > 1:
        raise InvalidRequestError(
            "give one of response_format (json_object/json_schema), guided_json, guided_regex, "
            "guided_choice, guided_grammar, structured_outputs", param=found[1].param)
    return found[0] if found else None


def _response_format(value: Any) -> StructuredOutputs | None:
    if not isinstance(value, dict):
        raise InvalidRequestError("'response_format' must be an object", param="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True, param="response_format")
    if kind != "json_schema":
        raise InvalidRequestError("'response_format.type' must be text, json_object or "
                                  "json_schema", param="response_format.type")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("'response_format.json_schema' must be an object",
                                  param="response_format.json_schema")
    if not isinstance(spec.get("strict", False), bool):
        raise InvalidRequestError("'response_format.json_schema.strict' must be a boolean",
                                  param="response_format.json_schema.strict")
    schema = spec.get("schema")
    if not isinstance(schema, dict):  # strict or not, the output follows the schema
        raise InvalidRequestError("'response_format.json_schema.schema' must be a JSON schema "
                                  "object", param="response_format.json_schema.schema")
    return StructuredOutputs(json=schema, param="response_format.json_schema.schema")


def _structured_outputs(value: Any) -> StructuredOutputs:
    if not isinstance(value, dict):
        raise InvalidRequestError("'structured_outputs' must be an object",
                                  param="structured_outputs")
    unknown = sorted(set(value) - set(_STRUCTURED_KEYS))
    if unknown:
        raise InvalidRequestError(f"'structured_outputs' does not support {', '.join(unknown)}",
                                  param=f"structured_outputs.{unknown[0]}")
    given = [key for key in _STRUCTURED_KEYS if value.get(key) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequestError("'structured_outputs' needs exactly one of "
                                  + ", ".join(_STRUCTURED_KEYS), param="structured_outputs")
    key = given[0]
    if key == "json_object" and value[key] is not True:
        raise InvalidRequestError("'structured_outputs.json_object' must be true",
                                  param="structured_outputs.json_object")
    return StructuredOutputs(**{key: value[key]}, param=f"structured_outputs.{key}")


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
