"""The request path's JSON codec reads what the standard library reads and writes what it
writes, compactly, never failing on what json would have escaped."""

from __future__ import annotations

import json
import math

import pytest

from workers.protocol.wire_json import dumps, loads


def test_answers_round_trip_compact_with_non_ascii_as_itself() -> None:
    body = {"id": "x", "choices": [{"text": "naïve 日本 🙂", "logprob": -0.125}], "n": None,
            "big": 2**70, "ok": True}
    raw = dumps(body)
    assert isinstance(raw, bytes) and b", " not in raw and b": " not in raw
    assert "naïve 日本 🙂".encode() in raw  # UTF-8, not \\u escapes
    assert json.loads(raw) == body and loads(raw) == body


def test_a_lone_surrogate_is_escaped_not_lost() -> None:
    raw = dumps({"text": "a\ud800b"})
    assert raw == b'{"text":"a\\ud800b"}'
    assert loads(raw) == {"text": "a\ud800b"}  # pydantic-core refuses it; json reads it


def test_unknown_types_are_written_as_their_str() -> None:
    class Odd:
        def __str__(self) -> str:
            return "odd"

    assert loads(dumps({"v": Odd()})) == {"v": "odd"}


def test_it_reads_what_json_reads() -> None:
    for text in ('{"a": [1, 2.5, "x", null, true]}', "[]", '"\\u00e9"', "1e-05", "NaN"):
        expected, got = json.loads(text), loads(text.encode())
        if isinstance(expected, float) and math.isnan(expected):
            assert math.isnan(got)
        else:
            assert got == expected
    with pytest.raises(ValueError):
        loads(b"{not json")
    with pytest.raises(ValueError):
        loads(b"")
