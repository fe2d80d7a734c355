"""OpenAI's Responses API as a surface: its body parsed into the canonical chat request, the
answer's events rendered as its Response object (whole) or its typed server-sent events, and
the answer kept for the tenant (`store`, the default) so `previous_response_id`, `GET` and
`DELETE /v1/responses/{id}` find it (`tenancy.stored_responses`).

Nothing else differs from chat completions: the same admission, cache, routing, dispatch and
settlement serve both (`gateway.request_path`). An upstream that serves Responses is sent the
request natively; every other deployment gets it translated to chat (`translate` says how,
and what is refused by name).

    schema     the request body as pydantic models (and what `include` may name)
    turn       what a Responses request carries beside its chat request (`Turn`)
    translate  the body checked and turned into the chat request (or a native body)
    objects    the Response object and its output items, from the folded answer
    stream     the answer as the Responses stream of typed events (`StreamRenderer`)
    store      the answer kept for the tenant, and found again (`kept`, `keep`)

docs/gateway.md, "OpenAI Responses", says what a client sees.
"""

from gateway.surfaces.responses.objects import (
    call_item_id,
    error_json,
    from_fold,
    message_id,
    output_of,
    response_object,
    status_of,
    usage_json,
    whole,
)
from gateway.surfaces.responses.schema import (
    INCLUDABLE,
    LOGPROBS,
    PATH,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    ImagePart,
    MessageItem,
    Reasoning,
    RefusalPart,
    ResponsesRequest,
    StreamOptions,
    TextConfig,
    TextFormat,
    TextPart,
)
from gateway.surfaces.responses.store import keep, kept, missing
from gateway.surfaces.responses.stream import StreamRenderer
from gateway.surfaces.responses.translate import (
    NATIVE_FIELDS,
    as_api_error,
    build,
    chat_messages,
    input_items,
    native_body,
    parse,
    read,
    validate,
)
from gateway.surfaces.responses.turn import ResponsesChat, Turn, turn_of

__all__ = [
    "INCLUDABLE",
    "LOGPROBS",
    "NATIVE_FIELDS",
    "PATH",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "ImagePart",
    "MessageItem",
    "Reasoning",
    "RefusalPart",
    "ResponsesChat",
    "ResponsesRequest",
    "StreamOptions",
    "StreamRenderer",
    "TextConfig",
    "TextFormat",
    "TextPart",
    "Turn",
    "as_api_error",
    "build",
    "call_item_id",
    "chat_messages",
    "error_json",
    "from_fold",
    "input_items",
    "keep",
    "kept",
    "message_id",
    "missing",
    "native_body",
    "output_of",
    "parse",
    "read",
    "response_object",
    "status_of",
    "turn_of",
    "usage_json",
    "validate",
    "whole",
]
