"""One batch as this process runs it (`Run`): where its lines still to answer are, its counts
so far, and its partial output and error files (`Partial`), in the line shape both hold
(`record`). The worker (`gateway.batches.worker`) drives it.

Durability. Each answered line is appended (and flushed) to the batch's partial output or
error file before it counts, so a restart (or another process, once the lease lapses) resumes
from the lines not yet written: it rescans the input and skips every custom_id already in
the partial files. A line in flight when the process stopped runs again (its first run was
billed for the work it did, as any request cut short is).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from gateway.batches.endpoints import Endpoint
from gateway.batches.objects import Progress


@dataclass(frozen=True)
class Pending:
    """A line still to answer: where it is in the input file."""

    number: int
    offset: int
    length: int
    custom_id: str



def record(custom_id: str, request_id: str, status: int | None, body: Any,
           error: dict[str, Any] | None = None) -> dict[str, Any]:
    """One line of an output or error file, in OpenAI's shape."""
    response = None if status is None else {"status_code": status, "request_id": request_id,
                                            "body": body}
    return {"id": request_id, "custom_id": custom_id, "response": response, "error": error}


def usage_of(entry: dict[str, Any]) -> tuple[int, int, int]:
    """(input, cached, output) tokens of an answered line, whatever the endpoint's words."""
    response = entry.get("response") or {}
    body = response.get("body")
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return 0, 0, 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    output = usage.get("completion_tokens", usage.get("output_tokens"))
    return (_int(prompt), _int(cached), _int(output))


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class Partial:
    """A batch's partial output or error file: one JSON line per answered line, appended and
    flushed as each is answered, so a restart knows what is done."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines = 0
        self._file: Any = None

    def recover(self) -> list[dict[str, Any]]:
        """What an earlier run wrote; a last line cut by a crash is dropped."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        if end != len(data):
            os.truncate(self.path, end)
        entries = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
        self.lines = len(entries)
        return entries

    def open(self) -> None:
        self._file = self.path.open("ab")

    def write(self, entry: dict[str, Any]) -> None:
        self._file.write(json.dumps(entry, separators=(",", ":")).encode() + b"\n")
        self._file.flush()
        self.lines += 1

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


@dataclass(eq=False)
class Run:
    """A batch this process is running."""

    id: str
    tenant_id: str
    key_id: str
    created_at: datetime
    expires_at: datetime
    endpoint: Endpoint
    input_path: Path
    work: Path
    status: str
    pending: deque[Pending] = field(default_factory=deque)
    in_flight: int = 0
    not_before: float = 0.0  # monotonic: a refused line's retry-after
    stopping: str | None = None  # "cancelled", "expired", or "lost" (another process has it)
    dispatching: bool = False
    total: int = 0
    model: str | None = None
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    weight: float = 1.0  # the plan's engine weight
    cap: int | None = None  # the most lines in flight (half the tenant's concurrency limit)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    output: Partial = field(init=False)
    errors: Partial = field(init=False)
    _fd: int | None = None

    def __post_init__(self) -> None:
        self.output = Partial(self.work / "output.jsonl")
        self.errors = Partial(self.work / "errors.jsonl")

    @property
    def done(self) -> bool:
        return self.in_flight == 0 and (not self.pending or self.stopping is not None)

    def stop(self, why: str) -> None:
        if self.stopping is None:
            self.stopping = why
        self.changed.set()

    def progress(self) -> Progress:
        return Progress(self.completed, self.failed, self.input_tokens, self.cached_tokens,
                        self.output_tokens)

    def read(self, line: Pending) -> bytes:
        if self._fd is None:
            self._fd = os.open(self.input_path, os.O_RDONLY)
        return os.pread(self._fd, line.length, line.offset)

    def answered(self, entry: dict[str, Any], *, ok: bool) -> None:
        if ok:
            self.output.write(entry)
            self.completed += 1
            prompt, cached, output = usage_of(entry)
            self.input_tokens += prompt
            self.cached_tokens += cached
            self.output_tokens += output
        else:
            self.errors.write(entry)
            self.failed += 1

    def close(self) -> None:
        self.output.close()
        self.errors.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
