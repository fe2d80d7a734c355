"""JSON on the request path: requests to upstreams, their answers and stream chunks, and the
answers and events clients get. pydantic-core's codec (pydantic's own, already installed)
is several times the standard library's speed where a streamed answer passes once per token:
a chat chunk parsed in 0.6 against 2.2 us, a 1.2 kB Response object written in 2.2 against
8.1 us (Zen 5, Python 3.11).

It reads what `json.loads` reads. What it writes is compact JSON in UTF-8: non-ASCII
characters as themselves, not `\\u` escapes (both are valid JSON; every client reads either).
A string with a lone surrogate (not UTF-8) is written with the standard library's escapes
instead, and a value of a type JSON has no word for as its `str`: an answer is never lost to
its encoding.
"""

from __future__ import annotations

import json
from typing import Any

import pydantic_core

_fallback = json.JSONEncoder(separators=(",", ":"), default=str).encode


def dumps(obj: Any) -> bytes:
    """`obj` as compact UTF-8 JSON."""
    try:
        return pydantic_core.to_json(obj, fallback=str)
    except (pydantic_core.PydanticSerializationError, ValueError):
        return _fallback(obj).encode()


def loads(raw: bytes | str) -> Any:
    """The value of a JSON document; ValueError where it is not one (as `json.loads`). A
    document pydantic-core refuses is read again by the standard library, which also takes
    what it does not (a lone surrogate's escape), so both read the same documents."""
    try:
        return pydantic_core.from_json(raw)
    except ValueError:
        return json.loads(raw)
