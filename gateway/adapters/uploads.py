"""Uploaded adapter files: one fresh folder per upload under `adapter_dir/<tenant id>/`.

Folder names are random, never derived from what the client sent, so no upload can land
outside `adapter_dir` or on top of another one. Every folder is owner-only (0700) and every file
0600: tenants' weights are theirs. File I/O runs on a thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import BinaryIO

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


async def save_upload(adapter_dir: Path, tenant_id: str, files: dict[str, BinaryIO]) -> Path:
    """Write `files` (file name -> readable binary) into a new folder; returns it."""
    folder = adapter_dir.resolve() / tenant_id / uuid.uuid4().hex  # absolute, as rows need
    await asyncio.to_thread(_write, folder, files)
    return folder


async def remove_upload(adapter_dir: Path, folder: str | Path) -> None:
    """Delete an upload folder; refuses (and logs) anything outside `adapter_dir`."""
    target = Path(folder).resolve()
    root = adapter_dir.resolve()
    if target == root or not target.is_relative_to(root):
        logger.warning("not deleting %s: it is not an upload under %s", target, root)
        return
    await asyncio.to_thread(_remove, target)


def _write(folder: Path, files: dict[str, BinaryIO]) -> None:
    for parent in (folder.parent.parent, folder.parent):  # adapter_dir, then the tenant's
        _private_dir(parent)
    folder.mkdir(mode=0o700)
    try:
        for name, source in files.items():
            source.seek(0)
            fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(fd, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
    except BaseException:
        _remove(folder)
        raise


def _private_dir(path: Path) -> None:
    """Create `path` (and its parents) owner-only; an existing one is left as it is, since an
    operator may have shared it on purpose."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700, exist_ok=True)


def _remove(folder: Path) -> None:
    try:
        shutil.rmtree(folder)
    except FileNotFoundError:
        return
    except OSError as exc:  # left behind, but said so: an operator can clean it up
        logger.warning("could not delete adapter files in %s: %s", folder, exc)
