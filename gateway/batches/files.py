"""Tenants' files on disk: `<files_dir>/<tenant_id>/<file_id>`, and a batch's work folder
`<files_dir>/<tenant_id>/batches/<batch_id>/` holding its partial output and error files
until it finishes. Ids are generated here (hex), never taken from a client, so a path never
leaves its tenant's folder. Everything here blocks: callers run it in a thread."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 20


class FileTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"larger than {limit} bytes")
        self.limit = limit


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, tenant_id: str, file_id: str) -> Path:
        return self.root / tenant_id / file_id

    def work_dir(self, tenant_id: str, batch_id: str) -> Path:
        return self.root / tenant_id / "batches" / batch_id

    def save(self, tenant_id: str, file_id: str, source: BinaryIO, *, limit: int) -> int:
        """Copy `source` into the tenant's folder, at most `limit` bytes (FileTooLarge, and
        nothing kept, past it); the file appears whole or not at all. Returns its size."""
        target = self.path(tenant_id, file_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{file_id}.part")
        size = 0
        try:
            with partial.open("wb") as out:
                while chunk := source.read(CHUNK):
                    size += len(chunk)
                    if size > limit:
                        raise FileTooLarge(limit)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            partial.replace(target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
        return size

    def adopt(self, tenant_id: str, file_id: str, source: Path) -> int:
        """A batch's finished partial file becomes the tenant's file `file_id` (a hard link:
        no copy; the partial stays until the batch's work folder is removed). Its size."""
        target = self.path(tenant_id, file_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, target)
        except OSError:  # a filesystem without hard links
            shutil.copyfile(source, target)
        return target.stat().st_size

    def delete(self, tenant_id: str, file_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(tenant_id, file_id).unlink()

    def remove_work(self, tenant_id: str, batch_id: str) -> None:
        shutil.rmtree(self.work_dir(tenant_id, batch_id), ignore_errors=True)
