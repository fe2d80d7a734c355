"""Uploaded adapter files: one fresh folder per upload under `adapter_dir/<tenant id>/`.

Folder names are random, never derived from what the client sent, so no upload can land
outside `adapter_dir` or on top of another one. File I/O runs on a thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
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
    folder.mkdir(parents=True, mode=0o700)
    try:
        for name, source in files.items():
            source.seek(0)
            with open(folder / name, "xb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
    except BaseException:
        _remove(folder)
        raise


def _remove(folder: Path) -> None:
    try:
        shutil.rmtree(folder)
    except FileNotFoundError:
        return
    except OSError as exc:  # left behind, but said so: an operator can clean it up
        logger.warning("could not delete adapter files in %s: %s", folder, exc)
