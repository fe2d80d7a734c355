"""One line of a batch's input file, checked like a live request, and a whole file scanned.

A line is `{"custom_id": ..., "method": "POST", "url": <the batch's endpoint>, "body": {...}}`.
Its body goes through the parser of the endpoint's live route, so it is refused for exactly
what a live request would be refused for, in the same words.

What a line can be:
- `Valid`: it will be answered;
- `Invalid`: it has a `custom_id` but would be refused (a wrong method or url, a body the
  parser refuses, `stream: true`); it goes to the batch's error file under its `custom_id`
  with the status and error body a live request would have got, and the rest of the batch
  runs;
- `Broken`: there is no `custom_id` to report it under (not JSON, not an object, no string
  `custom_id`) or the `custom_id` was used by an earlier line: the batch fails validation
  (status `failed`, the problems in its `errors` with their line numbers), as OpenAI's does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.batches.endpoints import Endpoint
from gateway.errors import APIError, bad_request, too_large

LINE_FIELDS = frozenset({"custom_id", "method", "url", "body"})
MAX_CUSTOM_ID_CHARS = 512
MAX_ERRORS = 100  # problems listed on a batch that failed validation


@dataclass(frozen=True)
class Valid:
    custom_id: str
    body: Any  # what the endpoint's parser made of it
    model: str | None
    raw_body: bytes  # for an endpoint that reads the body with the key (`Endpoint.read`)


@dataclass(frozen=True)
class Invalid:
    custom_id: str
    status: int
    error: dict[str, Any]  # {"error": {message, type, param, code}}


@dataclass(frozen=True)
class Broken:
    code: str
    message: str
    param: str | None = None


def check_line(raw: bytes, endpoint: Endpoint, *, max_body_bytes: int
               ) -> Valid | Invalid | Broken:
    """One line (without its newline) against the batch's endpoint."""
    try:
        line = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return Broken("invalid_json_line", "This line is not valid JSON.")
    if not isinstance(line, dict):
        return Broken("invalid_json_line", "Each line must be a JSON object.")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Broken("missing_custom_id", "Each line needs a non-empty string 'custom_id'.",
                      "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return Broken("invalid_custom_id",
                      f"'custom_id' is longer than {MAX_CUSTOM_ID_CHARS} characters.",
                      "custom_id")

    def refused(error: APIError) -> Invalid:
        return Invalid(custom_id, error.status, error.body())

    unknown = sorted(set(line) - LINE_FIELDS)
    if unknown:
        return refused(bad_request(f"Unknown field '{unknown[0]}' in a batch line: a line "
                                   "has custom_id, method, url and body.", param=unknown[0],
                                   code="unknown_parameter"))
    if line.get("method") != "POST":
        return refused(bad_request("A batch line's 'method' must be \"POST\".",
                                   param="method", code="invalid_value"))
    if line.get("url") != endpoint.url:
        return refused(bad_request(f"A batch line's 'url' must be this batch's endpoint, "
                                   f"'{endpoint.url}'.", param="url", code="invalid_value"))
    body = line.get("body")
    if not isinstance(body, dict):
        return refused(bad_request("A batch line's 'body' must be a JSON object: the request.",
                                   param="body", code="invalid_value"))
    if body.get("stream"):
        return refused(bad_request("A batch line cannot stream: leave out 'stream' or set it "
                                   "to false.", param="stream", code="invalid_value"))
    raw_body = json.dumps(body, separators=(",", ":")).encode()
    if len(raw_body) > max_body_bytes:
        return refused(too_large(max_body_bytes))
    try:
        parsed = endpoint.parse(raw_body)
    except APIError as exc:
        return refused(exc)
    model = getattr(parsed, "model", None)
    return Valid(custom_id, parsed, model if isinstance(model, str) else None, raw_body)


@dataclass(frozen=True)
class Entry:
    """A line of the input file: where it is, its id, and why it is refused (if it is)."""

    number: int  # 1-based, as editors count
    offset: int
    length: int
    custom_id: str
    invalid: Invalid | None = None


@dataclass
class Scan:
    entries: list[Entry] = field(default_factory=list)
    problems: list[dict[str, Any]] = field(default_factory=list)  # Broken lines: fails it
    model: str | None = None  # the first valid line's

    @property
    def total(self) -> int:
        return len(self.entries)


def scan(path: Path, endpoint: Endpoint, *, max_lines: int, max_body_bytes: int) -> Scan:
    """Every line of an input file checked (blank lines skipped). Blocking: run it in a
    thread."""
    result = Scan()
    seen: set[str] = set()

    def problem(number: int | None, code: str, message: str, param: str | None = None) -> None:
        if len(result.problems) < MAX_ERRORS:
            result.problems.append({"code": code, "message": message, "param": param,
                                    "line": number})

    count = 0
    for number, offset, raw in read_lines(path):
        count += 1
        if count > max_lines:
            problem(None, "too_many_requests",
                    f"The input file has more than {max_lines} requests; split it into "
                    "several batches.")
            break
        checked = check_line(raw, endpoint, max_body_bytes=max_body_bytes)
        if isinstance(checked, Broken):
            problem(number, checked.code, checked.message, checked.param)
            continue
        if checked.custom_id in seen:
            problem(number, "duplicate_custom_id",
                    f"The custom_id '{checked.custom_id}' is used by an earlier line; each "
                    "line needs its own.", "custom_id")
            continue
        seen.add(checked.custom_id)
        if isinstance(checked, Valid) and result.model is None:
            result.model = checked.model
        result.entries.append(Entry(number, offset, len(raw), checked.custom_id,
                                    checked if isinstance(checked, Invalid) else None))
    if count == 0:
        problem(None, "empty_file", "The input file has no requests.")
    return result


def read_lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, the line without its end) of each non-blank line."""
    offset = 0
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            stripped = raw.rstrip(b"\r\n")
            if stripped.strip():
                yield number, offset, stripped
            offset += len(raw)
