"""OpenAI request bodies, checked strictly: a wrong type is a 400 naming the field.

Every field of OpenAI's chat and completions requests is modelled here, so none is lost on the
way to a deployment that takes it. Whether a deployment honours a field is decided per
deployment (`gateway.features`): what no candidate can serve is a 400 naming the field, never
a silent drop. Top-level fields outside OpenAI's schema (vendor extras) are kept as sent in
`extra_fields()`; only deployments that list them in `passthrough_fields` may receive them.
Nested objects forbid unknown keys outright.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
MaxTokens = Annotated[int, Field(ge=1, le=1_000_000)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
ShortText = Annotated[str, Field(max_length=1_000)]
Name = Annotated[str, Field(max_length=256)]
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
JsonObject = dict[str, Any]


class FieldError(ValueError):
    """A check across fields that names the field at fault (pydantic would name none)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None


# --- content parts -----------------------------------------------------------------------

class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: Annotated[str, Field(min_length=1)]
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class InputImagePart(_Strict):
    """The Responses API's spelling, which some clients send to chat completions too."""

    type: Literal["input_image"]
    image_url: str | ImageURL | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class InputAudio(_Strict):
    data: str
    format: Literal["wav", "mp3"]


class AudioPart(_Strict):
    type: Literal["input_audio"]
    input_audio: InputAudio


class FileRef(_Strict):
    file_data: str | None = None
    file_id: str | None = None
    filename: str | None = None


class FilePart(_Strict):
    type: Literal["file"]
    file: FileRef


class RefusalPart(_Strict):
    type: Literal["refusal"]
    refusal: str


UserPart = Annotated[TextPart | ImagePart | InputImagePart | AudioPart | FilePart,
                     Field(discriminator="type")]
AssistantPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


# --- tools -------------------------------------------------------------------------------

class FunctionCall(_Strict):
    name: FunctionName
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Strict):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# --- messages ----------------------------------------------------------------------------

class ChatMessage(_Strict):
    """One message of any role; which fields a role may carry is checked after parsing."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[UserPart] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=128)] | None = None
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    refusal: str | None = None
    function_call: FunctionCall | None = None  # deprecated, assistant only
    audio: JsonObject | None = None  # a previous audio answer, by id (assistant only)

    @model_validator(mode="after")
    def _fits_role(self) -> ChatMessage:
        role = self.role
        if role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs 'tool_call_id'")
        if role != "tool" and self.tool_call_id is not None:
            raise ValueError("only tool messages carry 'tool_call_id'")
        if role != "assistant" and (self.tool_calls is not None or self.refusal is not None
                                    or self.function_call is not None or self.audio is not None):
            raise ValueError("only assistant messages carry 'tool_calls', 'function_call', "
                             "'refusal' or 'audio'")
        if self.content is None and not (role == "assistant" and (
                self.tool_calls or self.function_call or self.refusal is not None
                or self.audio is not None)):
            raise ValueError(f"a {role} message needs 'content'")
        if isinstance(self.content, list) and role != "user":
            allowed = ("text", "refusal") if role == "assistant" else ("text",)
            for part in self.content:
                if part.type not in allowed:
                    raise ValueError(f"a {role} message may not hold '{part.type}' parts")
        return self

    def text_chars(self) -> int:
        total = len(self.content) if isinstance(self.content, str) else sum(
            len(p.text) for p in self.content or () if isinstance(p, TextPart))
        for call in self.tool_calls or ():
            total += len(call.function.name) + len(call.function.arguments)
        return total

    def parts(self) -> list[Any]:
        return self.content if isinstance(self.content, list) else []


# --- output shaping ----------------------------------------------------------------------

class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True,
                              serialize_by_alias=True)


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJsonObject(_Strict):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
    Field(discriminator="type")]


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extra: exactly one constraint."""

    json_: JsonObject | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    grammar: str | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True,
                              serialize_by_alias=True)


def _logit_bias_key(key: str) -> bool:
    return key.isdigit() and len(key) <= 9


LogitBias = dict[str, Annotated[float, Field(ge=-100, le=100)]]


# --- requests ----------------------------------------------------------------------------

class _Sampling(BaseModel):
    # Unknown top-level fields are kept (not forwarded by default): see `extra_fields`.
    model_config = ConfigDict(strict=True, extra="allow")

    model: Annotated[str, Field(min_length=1, max_length=512)]
    max_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stop: ShortText | Annotated[list[ShortText], Field(max_length=16)] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[LogitBias, Field(max_length=1024)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    # vLLM-style extras our own engine understands.
    top_k: Annotated[int, Field(ge=-1, le=1_000_000)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=1_000_000)] | None = None
    # proposals per step under the engine's speculative decoding (0: off for this request)
    speculative_tokens: Annotated[int, Field(ge=0, le=16)] | None = None
    # within the caller's tenant, lower runs first: as urgent as the key's plan allows, or
    # less (gateway/request_path.py `engine_share`)
    priority: Annotated[int, Field(ge=-10, le=10)] | None = None
    ignore_eos: bool | None = None
    guided_json: JsonObject | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    _dumped: dict[str, Any] | None = PrivateAttr(default=None)
    _features: dict[str, str] | None = PrivateAttr(default=None)  # gateway.features, once

    @model_validator(mode="after")
    def _check_logit_bias(self) -> _Sampling:
        for key in self.logit_bias or {}:
            if not _logit_bias_key(key):
                raise FieldError("logit_bias", "keys must be token ids as strings, not "
                                               f"{key[:32]!r}")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def extra_fields(self) -> list[str]:
        """Top-level fields outside the schema, as sent (vendor extras)."""
        return sorted(self.model_extra or {})

    def upstream_body(self) -> dict[str, Any]:
        """What is sent on: the fields the caller set, with their own spellings.

        Dumped once per request (the cache key and the deployment both need it); each caller
        gets its own top-level dict to add upstream fields to, and must not edit nested ones.
        Which of these a deployment may receive was settled at routing (`gateway.features`)."""
        if self._dumped is None:
            self._dumped = self.model_dump(exclude_none=True, by_alias=True)
        return dict(self._dumped)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=10_000)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # OpenAI fields that only some deployments honour (gateway.features decides).
    functions: Annotated[list[FunctionDefinition], Field(max_length=128)] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    audio: JsonObject | None = None
    modalities: Annotated[list[Literal["text", "audio"]], Field(max_length=2)] | None = None
    prediction: JsonObject | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    web_search_options: JsonObject | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    store: bool | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    prompt_cache_key: Annotated[str, Field(max_length=1_024)] | None = None
    safety_identifier: Name | None = None

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or ()}
            if choice.function.name not in names:
                raise FieldError("tool_choice", f"names '{choice.function.name}', which is "
                                                "not in 'tools'")
        elif choice == "required" and not self.tools:
            raise FieldError("tool_choice", "'required' needs 'tools'")
        return self

    @model_validator(mode="after")
    def _check_tool_history(self) -> ChatCompletionRequest:
        """Every tool message answers a call of the assistant message just before it (or
        before the tool messages in a row after that assistant message), as OpenAI checks."""
        calls: set[str] | None = None  # the call ids tool messages may answer right now
        for index, message in enumerate(self.messages):
            if message.role != "tool":
                calls = ({c.id for c in message.tool_calls}
                         if message.role == "assistant" and message.tool_calls else None)
                continue
            if calls is None:
                raise FieldError(f"messages.{index}.role",
                                 "a 'tool' message must answer a preceding assistant message "
                                 "with 'tool_calls'")
            if message.tool_call_id not in calls:
                raise FieldError(f"messages.{index}.tool_call_id",
                                 f"'{message.tool_call_id}' is not the id of any of the "
                                 "'tool_calls' of the preceding assistant message")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        values = [v for v in (self.max_tokens, self.max_completion_tokens) if v is not None]
        return max(values) if values else None

    @property
    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def prompt_chars(self) -> int:
        total = sum(m.text_chars() for m in self.messages)
        for tool in self.tools or ():
            total += len(tool.model_dump_json())
        return total


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | Annotated[
        list[str], Field(min_length=1, max_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None
    echo: bool | None = None
    suffix: ShortText | None = None
    response_format: ResponseFormat | None = None  # a vLLM extra for completions

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None  # an int, where 0 still returns logprobs

    def prompt_chars(self) -> int:
        if isinstance(self.prompt, str):
            return len(self.prompt)
        if self.prompt and isinstance(self.prompt[0], str):
            return sum(len(p) for p in self.prompt)  # type: ignore[arg-type]
        return len(self.prompt) * 4  # token ids: about four characters each


OpenAIRequest = ChatCompletionRequest | CompletionRequest


class RequestError(ValueError):
    """A body that is not a valid request, with OpenAI's `param` and `code` for the 400."""

    def __init__(self, message: str, *, param: str | None, code: str) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def parse_request(raw: bytes, *, chat: bool) -> OpenAIRequest:
    """A chat or completions body, checked strictly; RequestError names the field at fault."""
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise request_error(exc) from None


def request_error(exc: ValidationError) -> RequestError:
    """pydantic's first complaint, worded for the client, naming the field."""
    first = exc.errors(include_url=False)[0]
    if first["type"] in ("json_invalid", "json_type"):
        return RequestError("We could not parse the JSON body of your request: "
                            f"{first['msg']}.", param=None, code="invalid_json")
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return RequestError(f"Invalid value for '{cause.param}': {cause}.", param=cause.param,
                            code="invalid_value")
    loc = [str(p) for p in first["loc"] if not _is_type_tag(str(p))]
    param = ".".join(loc[:4])
    if first["type"] == "missing":
        return RequestError(f"Missing required parameter: '{param}'.", param=param,
                            code="missing_required_parameter")
    if first["type"] == "model_type" and not loc:
        return RequestError("The request body must be a JSON object.", param=None,
                            code="invalid_type")
    return RequestError(f"Invalid value for '{param}': {first['msg']}.", param=param or None,
                        code="invalid_value")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_type_tag(part: str) -> bool:
    """pydantic puts union branch names ('str', 'list[int]', ...) in error locations."""
    return part in _TYPE_TAGS or "[" in part or part.startswith(("function-", "constrained-"))
