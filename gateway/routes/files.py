"""OpenAI's Files API for the Batch API: upload (purpose `batch`), list, retrieve, content,
delete. Always the caller's tenant: another tenant's file id answers exactly like an id never
issued (404). The upload is authenticated before its body is read (`TenantUploadGuard`), and
bounded by `max_file_bytes` (413)."""

from __future__ import annotations

import asyncio
from pathlib import PurePath
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import FileResponse, JSONResponse

from gateway.batches.files import FileStore, FileTooLarge
from gateway.batches.objects import file_json, no_such_file, own_file, page
from gateway.deps import SessionDep, StateDep, TenantDep
from gateway.errors import APIError, bad_request, conflict
from gateway.state import GatewayState
from tenancy import batches as rows
from tenancy.batches import StoredFile, new_file_id

router = APIRouter(prefix="/v1/files", tags=["files"])
FILES_PATH = "/v1/files"  # uploads: authenticated before the body, their own size bound
MAX_FILENAME_CHARS = 255


def store(state: GatewayState) -> FileStore:
    return FileStore(state.settings.files_dir)


@router.post("")
async def upload_file(key: TenantDep, state: StateDep, session: SessionDep,
                      file: Annotated[UploadFile, File()],
                      purpose: Annotated[str, Form()]) -> JSONResponse:
    if purpose != "batch":
        raise bad_request(f"This gateway keeps files for the Batch API only: 'purpose' must "
                          f"be 'batch', not '{purpose[:64]}'.", param="purpose",
                          code="invalid_value")
    settings = state.settings
    if await rows.count_files(session, tenant_id=key.tenant_id) >= settings.max_files_per_tenant:
        raise bad_request(f"A tenant may keep at most {settings.max_files_per_tenant} files; "
                          "delete some first.", code="too_many_files")
    filename = PurePath((file.filename or "").replace("\x00", "")).name[-MAX_FILENAME_CHARS:]
    file_id = new_file_id()
    files = store(state)
    try:
        size = await asyncio.to_thread(files.save, key.tenant_id, file_id, file.file,
                                       limit=settings.max_file_bytes)
    except FileTooLarge as exc:
        raise APIError(413, f"The file is larger than {exc.limit} bytes.",
                       code="file_too_large", param="file") from None
    if size == 0:
        await asyncio.to_thread(files.delete, key.tenant_id, file_id)
        raise bad_request("The file is empty.", param="file", code="empty_file")
    row = StoredFile(id=file_id, tenant_id=key.tenant_id, filename=filename or "upload.jsonl",
                     purpose=purpose, bytes=size)
    session.add(row)
    try:
        await session.commit()
    except BaseException:
        await asyncio.to_thread(files.delete, key.tenant_id, file_id)
        raise
    return JSONResponse(file_json(row))


@router.get("")
async def list_files(key: TenantDep, session: SessionDep,
                     purpose: Annotated[str | None, Query(max_length=64)] = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                     after: Annotated[str | None, Query(max_length=64)] = None,
                     order: Literal["asc", "desc"] = "desc") -> JSONResponse:
    cursor = None if after is None else await own_file(session, key.tenant_id, after, "after")
    found = await rows.list_files(session, tenant_id=key.tenant_id, purpose=purpose,
                                  after=cursor, limit=limit + 1, ascending=order == "asc")
    return JSONResponse(page([file_json(f) for f in found[:limit]],
                             has_more=len(found) > limit))


@router.get("/{file_id}")
async def retrieve_file(file_id: str, key: TenantDep, session: SessionDep) -> JSONResponse:
    return JSONResponse(file_json(await own_file(session, key.tenant_id, file_id)))


@router.get("/{file_id}/content")
async def file_content(file_id: str, key: TenantDep, session: SessionDep,
                       state: StateDep) -> FileResponse:
    row = await own_file(session, key.tenant_id, file_id)
    path = store(state).path(key.tenant_id, row.id)
    if not path.is_file():
        raise no_such_file(file_id)
    return FileResponse(path, media_type="application/octet-stream", filename=row.filename)


@router.delete("/{file_id}")
async def delete_file(file_id: str, key: TenantDep, session: SessionDep,
                      state: StateDep) -> dict[str, Any]:
    """Refused (409) while a batch that reads it is still running."""
    row = await own_file(session, key.tenant_id, file_id)
    users = await rows.files_in_use(session, tenant_id=key.tenant_id, file_id=row.id)
    if users:
        raise conflict(f"The file is the input of batch '{users[0]}', which is still "
                       "running; cancel it or wait for it to finish.")
    await session.delete(row)
    await session.commit()
    await asyncio.to_thread(store(state).delete, key.tenant_id, row.id)
    return {"id": row.id, "object": "file", "deleted": True}
