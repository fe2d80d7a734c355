"""OpenAI chat messages and tools -> the model's prompt, through its chat template.

Tools are rendered by the model's own template (transformers `apply_chat_template(tools=...)`)
when it knows them; a ChatML template without tool support gets `CHATML_TOOLS_TEMPLATE`; any
other template cannot show tools, and a request with tools is refused rather than sent on
without them.
"""

from __future__ import annotations

import json
from typing import Any

from workers.engine.sampling_params import InvalidRequestError
from workers.tools.template import CHATML_TOOLS_TEMPLATE

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def render_chat(tokenizer: Any, messages: Any, *, tools: list[dict[str, Any]] | None) -> str:
    """The prompt text for `messages` (OpenAI's shape) and the tools the model may call."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("'messages' must be a non-empty list", param="messages")
    rendered = [_message(m, i) for i, m in enumerate(messages)]
    uses_tools = bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in rendered)
    template = _template_for(tokenizer, uses_tools)
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
    if tools:
        kwargs["tools"] = tools
    if template is not None:
        kwargs["chat_template"] = template
    return tokenizer.apply_chat_template(rendered, **kwargs)


def _template_for(tokenizer: Any, uses_tools: bool) -> str | None:
    """None: the model's own template serves; else the template to use instead."""
    own = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    if not uses_tools or "tool" in own:
        return None
    if "<|im_start|>" in own:
        return CHATML_TOOLS_TEMPLATE
    raise InvalidRequestError("This model's chat template cannot show tools or tool messages.",
                              param="tools", code="unsupported_parameter")


def _message(message: Any, index: int) -> dict[str, Any]:
    """One message as chat templates want it: text content, tool calls with parsed args."""
    param = f"messages.{index}"
    if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
        raise InvalidRequestError(
            f"{param} must be an object with role one of {', '.join(CHAT_ROLES)}", param=param)
    role = "system" if message["role"] == "developer" else message["role"]
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"), param)}
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise InvalidRequestError(f"{param}.tool_calls: only assistant messages carry a "
                                      "list of tool calls", param=f"{param}.tool_calls")
        out["tool_calls"] = [_call(c, f"{param}.tool_calls.{i}") for i, c in enumerate(calls)]
    elif out["content"] is None:
        raise InvalidRequestError(f"{param}.content must be a string", param=f"{param}.content")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise InvalidRequestError(f"{param}: a tool message needs 'tool_call_id'",
                                      param=f"{param}.tool_call_id")
        out["tool_call_id"] = call_id
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _text(content: Any, param: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else None
                what = "images" if kind in ("image_url", "input_image") else "non-text parts"
                raise InvalidRequestError(f"{param}.content: the model does not support {what}",
                                          param=f"{param}.content",
                                          code="unsupported_parameter")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequestError(f"{param}.content must be a string", param=f"{param}.content")


def _call(call: Any, param: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)):
        raise InvalidRequestError(f"{param} must hold function.name and function.arguments",
                                  param=param)
    try:
        arguments: Any = json.loads(function["arguments"])
    except ValueError:
        arguments = function["arguments"]  # shown as the model wrote it
    return {"id": call.get("id"), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}
