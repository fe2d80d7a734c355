"""Which deployments can serve what a request asks for, field by field.

Nothing a client sends is dropped silently: each field is honoured by the deployment that
serves the request, forwarded to an upstream that takes it, or refused with a 400 naming the
field and the deployment. Routing keeps only deployments that can serve every field
(`unsupported`), so a fallback never lands where a feature would be lost.

Two kinds of deployment differ here:
- engine-backed (the embedded engine and remote Switchboard workers) honour OpenAI's sampling
  fields, tools, structured outputs and logit_bias, and refuse the rest by name;
- OpenAI-compatible and litellm upstreams receive every OpenAI field as sent, gated only by
  the deployment's declared capabilities (tools, json_schema, images, logit_bias, ...).
Fields outside OpenAI's schema reach an upstream only if its `passthrough_fields` lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.deployments.config import Capabilities, DeploymentConfig
from workers.protocol.requests import (
    AudioPart,
    ChatCompletionRequest,
    FilePart,
    ImagePart,
    InputImagePart,
    OpenAIRequest,
)

ENGINE_PROVIDERS = ("embedded", "worker")
# OpenAI fields our engine does not implement: refused by name on engine-backed deployments.
ENGINE_REFUSED = ("functions", "function_call", "audio", "prediction", "reasoning_effort",
                  "verbosity", "web_search_options", "store", "metadata", "best_of", "suffix")


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why one deployment cannot serve a request: the field (its dotted path) and a reason."""

    param: str
    reason: str


def features(request: OpenAIRequest) -> dict[str, str]:
    """Capability name -> the field that needs it, for the optional features in use (worked
    out once per request, however many deployments are weighed)."""
    if request._features is None:
        request._features = _features(request)
    return request._features


def _features(request: OpenAIRequest) -> dict[str, str]:
    used: dict[str, str] = {}
    if request.wants_logprobs:
        used["logprobs"] = "logprobs"
    if request.logit_bias:
        used["logit_bias"] = "logit_bias"
    if request.response_format is not None and request.response_format.type != "text":
        used["json_schema"] = "response_format"
    if isinstance(request, ChatCompletionRequest):
        if request.tools or request.tool_choice is not None or request.parallel_tool_calls \
                is not None:
            used["tools"] = "tools" if request.tools else (
                "tool_choice" if request.tool_choice is not None else "parallel_tool_calls")
        for i, message in enumerate(request.messages):
            if "tools" not in used and (message.role == "tool" or message.tool_calls):
                used["tools"] = f"messages.{i}" + (".tool_calls" if message.tool_calls else "")
            for j, part in enumerate(message.parts()):
                name = _part_feature(part)
                if name is not None and name not in used:
                    used[name] = f"messages.{i}.content.{j}"
    return used


def _part_feature(part: Any) -> str | None:
    if isinstance(part, ImagePart | InputImagePart):
        return "images"
    if isinstance(part, AudioPart):
        return "audio"
    if isinstance(part, FilePart):
        return "files"
    return None


def unsupported(config: DeploymentConfig, request: OpenAIRequest) -> Refusal | None:
    """The first thing in `request` this deployment cannot serve, or None."""
    caps = config.capabilities
    engine = config.provider in ENGINE_PROVIDERS
    for capability, param in features(request).items():
        if not _has(caps, capability, engine=engine):
            return Refusal(param, _what(capability))
    if engine:
        refused = _engine_refusal(request)
        if refused is not None:
            return refused
    allowed = () if config.provider == "embedded" else config.passthrough_fields
    for name in request.extra_fields():
        if name not in allowed:
            return Refusal(name, "is not a known parameter and the deployment does not list "
                                 "it in passthrough_fields")
    return None


def _has(caps: Capabilities, capability: str, *, engine: bool) -> bool:
    if engine and capability in ("images", "audio", "files"):
        return False  # the engine serves text models only
    return bool(getattr(caps, capability, False))


def _what(capability: str) -> str:
    return {
        "images": "is an image; the model does not support images",
        "audio": "is audio; the model does not support audio input",
        "files": "is a file; the model does not support file inputs",
        "json_schema": "asks for structured output, which the model does not support",
        "tools": "uses tools, which the model does not support",
        "logit_bias": "is not supported by the model",
        "logprobs": "is not supported by the model",
    }[capability]


def _engine_refusal(request: OpenAIRequest) -> Refusal | None:
    for name in ENGINE_REFUSED:
        value = getattr(request, name, None)
        if value is None:
            continue
        if name == "store" and value is False:
            continue
        if name == "best_of" and value == (request.n or 1):
            continue
        return Refusal(name, "is not supported by this model's engine")
    if isinstance(request, ChatCompletionRequest):
        if request.modalities is not None and request.modalities != ["text"]:
            return Refusal("modalities", "may only be ['text'] for this model")
        if request.service_tier not in (None, "auto", "default"):
            return Refusal("service_tier", "may only be 'auto' or 'default' for this model")
        for i, message in enumerate(request.messages):
            if message.role == "function":
                return Refusal(f"messages.{i}.role", "'function' is deprecated; send tool "
                                                     "messages instead")
            if message.function_call is not None:
                return Refusal(f"messages.{i}.function_call",
                               "is deprecated; send tool_calls instead")
            if message.audio is not None:
                return Refusal(f"messages.{i}.audio", "is not supported by this model")
    elif request.echo:
        return Refusal("echo", "is not supported by this model's engine")
    return None
