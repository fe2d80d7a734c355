"""The body of `POST /v1/responses` as pydantic models: the request itself (strict: an unknown
field is a 400 naming it) and the items, content parts and tools inside it, each checked where
the translation meets it (`translate`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from workers.protocol.requests import FunctionName, Name

PATH = "/v1/responses"
# What `include` may name: output text logprobs are given; the rest concern items (built-in
# tool calls, reasoning) this gateway never produces, so there is nothing to add for them.
INCLUDABLE = ("file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "message.input_image.image_url",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs",
              "reasoning.encrypted_content", "message.output_text.logprobs")
LOGPROBS = "message.output_text.logprobs"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class _Loose(BaseModel):
    """Items and parts may carry fields this surface ignores (`status`, `phase`, ...)."""

    model_config = ConfigDict(strict=True, extra="allow")


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # nothing is obfuscated here


class ResponsesRequest(_Strict):
    """The body of POST /v1/responses."""

    model: Annotated[str, Field(min_length=1, max_length=512)]
    input: str | Annotated[list[dict[str, Any]], Field(max_length=10_000)] | None = None
    instructions: str | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    parallel_tool_calls: bool | None = None
    user: Name | None = None
    safety_identifier: Name | None = None
    prompt_cache_key: Annotated[str, Field(max_length=1_024)] | None = None
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)],
                             Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    include: Annotated[list[str], Field(max_length=16)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    background: bool | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None  # bounds built-in tools: none
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # a hint, unused
    # Accepted, and refused by name when set.
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None


class FunctionTool(_Loose):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class MessageItem(_Loose):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[dict[str, Any]], Field(max_length=10_000)]


class TextPart(_Loose):
    type: Literal["input_text", "output_text"]
    text: str


class RefusalPart(_Loose):
    type: Literal["refusal"]
    refusal: str


class ImagePart(_Loose):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class FunctionCallItem(_Loose):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: FunctionName
    arguments: str


class FunctionCallOutputItem(_Loose):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: str | list[dict[str, Any]]
