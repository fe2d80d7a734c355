"""A crash-safe outbox for usage records: a local write-ahead log that the meter drains.

Why: the meter batches database writes, so a record waits in memory for up to a flush
interval, and a SIGKILL, an OOM kill or a crash would lose the usage of answers that clients
already received. `append` writes the record as one JSON line with one unbuffered `os.write`
on an O_APPEND descriptor: once it returns, the bytes are in the kernel and survive the death
of the process (a power loss needs `fsync`, see `sync`). It costs a few microseconds.

Layout: the directory holds segment files `usage-<pid>-<random>-<seq>.jsonl`, each written by
one process only, which holds an exclusive `flock` on every segment it has not yet deleted. A
segment is deleted once every record in it is committed to the database. A process that
starts claims the segments nobody holds (left by a dead process), replays them and deletes
them; segments of live replicas sharing the directory stay locked and are left alone. Replays
may deliver a record twice: the database write is idempotent on `request_id`.

New segments are created under a dot name, locked, then renamed, so no starting process can
claim a segment between its creation and its lock. Use a local filesystem (flock on NFS is
not dependable). One event loop per outbox: it is not thread-safe.

The records name tenants and what they spent, so the outbox keeps them owner-only: segments
are 0600, and the directory (with any parent the outbox has to create) 0700. A directory
that already exists keeps its mode: an operator may have shared it on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SEGMENT_RECORDS = 10_000
SEGMENT_BYTES = 8 << 20
RETRY_AFTER_S = 1.0  # after a disk error, appends skip the disk for this long
STALE_NEW_S = 60.0  # a dot file older than this is a creation cut short by a crash
_PATTERN = "usage-*.jsonl"
_NEW = ".new-"
_DATETIME = "$dt"


@dataclass(eq=False)
class Segment:
    """One segment file and what the process knows of it (counts are of this process)."""

    path: Path
    fd: int
    appended: int = 0
    committed: int = 0
    size: int = 0
    dirty: bool = False  # written since the last fsync

    @property
    def settled(self) -> bool:
        return self.committed >= self.appended


class Outbox:
    """This process's segments in `directory`, plus the leftovers of dead processes it claims.

    `fsync` is off by default: records then survive process death but not a power loss or a
    kernel crash. The meter calls `sync` every `fsync_interval_s` when one is set, bounding
    what a power loss can take to that interval.
    """

    def __init__(self, directory: Path, *, segment_records: int = SEGMENT_RECORDS,
                 segment_bytes: int = SEGMENT_BYTES) -> None:
        self.directory = Path(directory)
        self._segment_records = segment_records
        self._segment_bytes = segment_bytes
        self._prefix = ""  # set on first use: the pid of the process that writes
        self._seq = 0
        self._live: Segment | None = None
        self._sealed: list[Segment] = []
        self._claimed: list[Segment] = []
        self._skip_until = 0.0
        self._new_dir_entries = False

    # -- the request path --------------------------------------------------------------

    def append(self, record: dict[str, Any]) -> Segment | None:
        """Write one record durably (against process death); the segment holding it, or None
        when it could not be written (logged; the caller keeps it in memory). Never raises."""
        if self._skip_until and time.monotonic() < self._skip_until:
            return None
        try:
            line = _ENCODER.encode(record).encode() + b"\n"
        except (TypeError, ValueError) as exc:
            logger.error("usage record %s cannot be serialised for the outbox (%s); kept in "
                         "memory only", record.get("request_id"), exc)
            return None
        try:
            segment = self._live if self._live is not None else self._open_segment()
            _write_all(segment.fd, line)
        except OSError as exc:
            self._disk_failed(exc)
            return None
        segment.appended += 1
        segment.size += len(line)
        segment.dirty = True
        if segment.appended >= self._segment_records or segment.size >= self._segment_bytes:
            self._seal_live()
        return segment

    # -- the meter's background side ---------------------------------------------------

    def seal(self) -> None:
        """Close the live segment to new records (done at the start of each flush), so it can
        be deleted as soon as the batch that holds its records is committed."""
        if self._live is not None and self._live.appended:
            self._seal_live()

    def commit(self, segments: list[Segment | None]) -> None:
        """One record of each listed segment is in the database; delete settled segments."""
        for segment in segments:
            if segment is not None:
                segment.committed += 1
        self._collect()

    def claim_leftovers(self) -> list[Segment]:
        """Lock the segments no live process holds (left by dead ones) and return them, oldest
        first; `discard` each once its records are in the database."""
        _private_dir(self.directory)
        own = self._prefix or "\0"
        claimed = []
        for path in sorted(self.directory.glob(_PATTERN), key=_mtime):
            if path.name.startswith(own):
                continue
            fd = _lock_existing(path)
            if fd is not None:
                segment = Segment(path, fd, size=os.fstat(fd).st_size)
                claimed.append(segment)
                self._claimed.append(segment)
        self._remove_stale_new_files()
        return claimed

    def read(self, segment: Segment) -> list[dict[str, Any]]:
        """The records of a claimed segment. Lines that do not parse (a record cut short when
        its writer died, which was then never acknowledged) are skipped with a warning."""
        size = os.fstat(segment.fd).st_size
        data = bytearray()
        while len(data) < size:
            chunk = os.pread(segment.fd, size - len(data), len(data))
            if not chunk:
                break
            data += chunk
        records = []
        lines = bytes(data).split(b"\n")
        for number, line in enumerate(lines, 1):
            if not line:
                continue
            try:
                record = json.loads(line, object_hook=_decode)
            except ValueError:
                last = number == len(lines)
                logger.warning("outbox %s: %s line %d skipped (%d bytes)", segment.path.name,
                               "torn last" if last else "unreadable", number, len(line))
                continue
            if isinstance(record, dict) and "request_id" in record:
                records.append(record)
            else:
                logger.warning("outbox %s: line %d is not a usage record; skipped",
                               segment.path.name, number)
        return records

    def discard(self, segment: Segment) -> None:
        """A claimed segment's records are all in the database: delete it."""
        self._claimed.remove(segment)
        _delete(segment)

    def pending(self) -> int:
        """Records of this process written here and not yet committed."""
        return sum(s.appended - s.committed for s in self._own())

    def segments(self) -> int:
        return len(self._own()) + len(self._claimed)

    async def sync(self) -> None:
        """fsync what was written since the last call (and new directory entries), on a
        thread so that the event loop never waits for the disk."""
        fds = []
        try:
            for segment in self._own():
                if segment.dirty:
                    segment.dirty = False
                    fds.append(os.dup(segment.fd))  # the original may close meanwhile
            if self._new_dir_entries:
                self._new_dir_entries = False
                fds.append(os.open(self.directory, os.O_RDONLY | os.O_CLOEXEC))
            await asyncio.to_thread(_fsync_all, fds)
        except OSError as exc:
            logger.warning("outbox fsync failed (%s)", exc)
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> int:
        """Delete this process's settled segments and release every lock; segments still
        holding uncommitted records stay for the next start. Returns how many records stay."""
        left = 0
        for segment in self._own():
            if segment.settled:
                _delete(segment)
            else:
                left += segment.appended - segment.committed
                os.close(segment.fd)
        for segment in self._claimed:
            os.close(segment.fd)
        self._live = None
        self._sealed.clear()
        self._claimed.clear()
        return left

    # -- internals ----------------------------------------------------------------------

    def _own(self) -> list[Segment]:
        return [*self._sealed, *([self._live] if self._live is not None else [])]

    def _open_segment(self) -> Segment:
        if not self._prefix:
            self._prefix = f"usage-{os.getpid()}-{secrets.token_hex(4)}"
        name = f"{self._prefix}-{self._seq:06d}.jsonl"
        self._seq += 1
        _private_dir(self.directory)
        new = self.directory / f"{_NEW}{name}"
        fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(new, self.directory / name)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                new.unlink()
            raise
        self._live = Segment(self.directory / name, fd)
        self._new_dir_entries = True
        return self._live

    def _seal_live(self) -> None:
        segment, self._live = self._live, None
        if segment is None:
            return
        if segment.settled:
            _delete(segment)
        else:
            self._sealed.append(segment)

    def _collect(self) -> None:
        keep = []
        for segment in self._sealed:
            if segment.settled:
                _delete(segment)
            else:
                keep.append(segment)
        self._sealed = keep

    def _disk_failed(self, exc: OSError) -> None:
        # The live segment may now end in a partial line: never append after it.
        self._seal_live()
        self._skip_until = time.monotonic() + RETRY_AFTER_S
        logger.error("usage outbox %s unwritable (%s); records stay in memory only for %.0fs",
                     self.directory, exc, RETRY_AFTER_S)

    def _remove_stale_new_files(self) -> None:
        cutoff = time.time() - STALE_NEW_S
        for path in self.directory.glob(f"{_NEW}*"):
            if _mtime(path) < cutoff:
                fd = _lock_existing(path)
                if fd is not None:
                    _delete(Segment(path, fd))


def _private_dir(directory: Path) -> None:
    """Create `directory` and its missing parents owner-only (`mkdir -p` would make the
    parents 0755 whatever the mode asked)."""
    missing = []
    path = directory
    while not path.exists() and path.parent != path:
        missing.append(path)
        path = path.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another replica made it meanwhile
            path.mkdir(mode=0o700)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _lock_existing(path: Path) -> int | None:
    """An fd holding the exclusive lock on `path`, or None if a live process holds it or it
    is gone (another process claimed and deleted it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != os.stat(path).st_ino:
            raise FileNotFoundError(path)  # deleted and replaced while we waited
    except OSError:  # BlockingIOError: held by a live process
        os.close(fd)
        return None
    return fd


def _delete(segment: Segment) -> None:
    try:
        segment.path.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("cannot delete outbox segment %s (%s)", segment.path, exc)
    finally:
        os.close(segment.fd)


def _fsync_all(fds: list[int]) -> None:
    for fd in fds:
        os.fsync(fd)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _encode(value: object) -> object:
    if isinstance(value, datetime):
        return {_DATETIME: value.isoformat()}
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


_ENCODER = json.JSONEncoder(default=_encode, separators=(",", ":"))  # ASCII: no raw newline


def _decode(obj: dict[str, Any]) -> object:
    if len(obj) == 1 and _DATETIME in obj:
        return datetime.fromisoformat(obj[_DATETIME])
    return obj
