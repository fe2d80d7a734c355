"""The File and Batch objects as OpenAI's API shows them (what the `openai` client parses), and
a tenant's own file by id, as the Files and Batches routes both look it up."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.errors import APIError, not_found
from tenancy import batches as rows
from tenancy.batches import Batch, StoredFile

FILE_ID = re.compile(r"^file-[0-9a-f]{32}$")


def no_such_file(file_id: str, param: str = "file_id") -> APIError:
    return not_found(f"No such File object: '{file_id}'.", param=param)


async def own_file(session: AsyncSession, tenant_id: str, file_id: str,
                   param: str = "file_id") -> StoredFile:
    """The tenant's file; anyone else's, or a malformed id, is as missing as one never
    issued (and a malformed id costs no query)."""
    row = None
    if FILE_ID.match(file_id):
        row = await rows.get_file(session, tenant_id=tenant_id, file_id=file_id)
    if row is None:
        raise no_such_file(file_id, param)
    return row


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
