"""Usage exports and invoices as HTTP downloads: what the admin API and the console both
serve, one behind an admin key, the other behind the console's session."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.responses import Response, StreamingResponse

from billing import export, invoices


async def usage_export(sessionmaker: async_sessionmaker[AsyncSession],
                       filters: export.RecordFilter, fmt: export.ExportFormat
                       ) -> StreamingResponse:
    """Every matching record, oldest first, streamed from a server-side cursor: memory stays
    flat for any range."""

    async def body() -> AsyncGenerator[bytes]:
        # Its own session: the response outlives the request's dependencies.
        async with sessionmaker() as session:
            async for chunk in export.export(session, filters=filters, fmt=fmt):
                yield chunk

    chunks = body()
    # The query runs before the first chunk: a database failure is still a 500 in OpenAI's
    # shape here, not a 200 cut short.
    first = await anext(chunks, b"")
    name = export.filename(fmt=fmt, filters=filters)
    return StreamingResponse(_prepend(first, chunks), media_type=export.MEDIA_TYPES[fmt],
                             headers={"content-disposition": f'attachment; filename="{name}"'})


async def _prepend(first: bytes, rest: AsyncGenerator[bytes]) -> AsyncIterator[bytes]:
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()  # a client gone mid-stream closes the cursor and session now


def invoice(view: invoices.InvoiceView, fmt: str) -> Response:
    """JSON with a fixed key order, or CSV with a `total` row: deterministic bytes."""
    if fmt == "csv":
        name = f"invoice-{view.tenant_id}-{view.period}.csv"
        return Response(view.csv(), media_type="text/csv; charset=utf-8",
                        headers={"content-disposition": f'attachment; filename="{name}"'})
    return Response(json.dumps(view.document(), separators=(",", ":")),
                    media_type="application/json")
