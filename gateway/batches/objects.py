"""The File and Batch objects as OpenAI's API shows them (what the `openai` client parses)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tenancy.batches import Batch, StoredFile


def timestamp(at: datetime | None) -> int | None:
    return None if at is None else int(at.timestamp())


def file_json(row: StoredFile) -> dict[str, Any]:
    return {"id": row.id, "object": "file", "bytes": row.bytes,
            "created_at": timestamp(row.created_at), "filename": row.filename,
            "purpose": row.purpose, "status": "processed", "expires_at": None,
            "status_details": None}


@dataclass(frozen=True)
class Progress:
    """A running batch's counts, fresher than its row (written every checkpoint)."""

    completed: int
    failed: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int


def batch_json(row: Batch, progress: Progress | None = None) -> dict[str, Any]:
    counts = progress or Progress(row.completed, row.failed, row.input_tokens,
                                  row.cached_tokens, row.output_tokens)
    return {
        "id": row.id, "object": "batch", "endpoint": row.endpoint,
        "errors": None if not row.errors else {"object": "list", "data": row.errors},
        "input_file_id": row.input_file_id, "completion_window": row.completion_window,
        "status": row.status, "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id, "created_at": timestamp(row.created_at),
        "in_progress_at": timestamp(row.in_progress_at),
        "expires_at": timestamp(row.expires_at),
        "finalizing_at": timestamp(row.finalizing_at),
        "completed_at": timestamp(row.completed_at), "failed_at": timestamp(row.failed_at),
        "expired_at": timestamp(row.expired_at),
        "cancelling_at": timestamp(row.cancelling_at),
        "cancelled_at": timestamp(row.cancelled_at),
        "request_counts": {"total": row.total, "completed": counts.completed,
                           "failed": counts.failed},
        "metadata": row.meta, "model": row.model,
        "usage": {
            "input_tokens": counts.input_tokens,
            "input_tokens_details": {"cached_tokens": counts.cached_tokens},
            "output_tokens": counts.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts.input_tokens + counts.output_tokens,
        },
    }


def page(data: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
