"""What a deployment's answer is made of, as typed events (one choice each, by `index`).

Every deployment is opened as an iterator of these: the engine's output processor emits them
from sampled text, and upstreams' JSON or SSE is parsed into them once. OpenAI JSON and SSE
are rendered from them (`workers.protocol.render`), a non-streamed answer is their fold, and
the cache and the meter observe them instead of re-parsing bytes.

Beyond the five kinds every answer needs (text, tool calls, finish, usage, failure), `Opened`
heads the answer (the first event: the upstream is answering) and `OtherDelta` carries what an
upstream sent that has no type here (a refusal, audio, reasoning text), as sent, so nothing an
upstream answers is dropped on the way through.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Opened:
    """The answer has begun. `extra`: top-level fields an upstream added (system_fingerprint,
    service_tier), given back as sent."""

    id: str
    created: int
    model: str
    extra: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class TextDelta:
    """New text of a choice; `logprobs` in OpenAI's shape for this piece, where asked."""

    index: int
    text: str
    logprobs: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A tool call's first delta carries its id and name; later ones only argument text."""

    index: int  # the choice
    call_index: int  # the call within the choice
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True, slots=True)
class OtherDelta:
    """Delta fields of a chat choice that have no type here, as the upstream sent them."""

    index: int
    fields: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Finished:
    """A choice ended; `stop_sequence`: the stop string that ended it, where one did (the
    engine knows; OpenAI's shape has no place for it, Anthropic's has)."""

    index: int
    reason: str | None
    stop_sequence: str | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """The answer's token counts; `extra`: an upstream's other usage fields, as sent."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    extra: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    """The answer broke after it had begun (before, a deployment raises instead)."""

    status: int
    message: str
    code: str


Delta = TextDelta | ToolCallDelta
Event = Opened | TextDelta | ToolCallDelta | OtherDelta | Finished | Usage | Failed


async def started(events: AsyncIterator[Event]) -> AsyncIterator[Event] | None:
    """`events` once its first event is in hand (None if it ended without one).

    A deployment fails before its first event by raising, so awaiting this is where a caller
    still may answer with an HTTP error or try elsewhere; closing what it returns closes
    `events`."""
    try:
        first = await anext(events)
    except StopAsyncIteration:
        return None
    except BaseException:
        await aclose(events)
        raise
    return prepend(first, events)


async def prepend(first: Event, rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    try:
        yield first
        async for event in rest:
            yield event
    finally:
        await aclose(rest)


async def aclose(events: AsyncIterator[Any]) -> None:
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()
