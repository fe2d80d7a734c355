"""What a Responses request carries beside its chat request (`Turn`: the response's id, what its
Response object echoes, the items it keeps), and the chat request that carries it through the
one request path (`ResponsesChat`): made in `translate`, read by `objects`, `stream` and
`store`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import PrivateAttr

from gateway.deployments.native import NativeChat
from workers.protocol.requests import OpenAIRequest


@dataclass
class Turn:
    """What a Responses request carries beside its chat request: the response's id and
    creation time, the parameters its Response object echoes, and the items it keeps."""

    response_id: str
    created_at: int
    model: str
    echo: dict[str, Any]
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]] = field(default_factory=list)
    previous_response_id: str | None = None
    store: bool = True
    logprobs: bool = False
    completed_at: int | None = None
    answer: dict[str, Any] | None = None  # the finished Response, once made (whole, kept)

    @property
    def hex(self) -> str:
        return self.response_id.removeprefix("resp_")


class ResponsesChat(NativeChat):
    """The canonical chat request of a Responses request, carrying its `Turn` (and its native
    body)."""

    _turn: Turn | None = PrivateAttr(default=None)


def turn_of(request: OpenAIRequest) -> Turn:
    turn = getattr(request, "_turn", None)
    if turn is None:
        raise TypeError("not a Responses request")
    return turn
