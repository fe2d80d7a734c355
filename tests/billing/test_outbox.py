"""The outbox keeps usage records across the death of a process, and only dead ones' segments
are taken over."""

from __future__ import annotations

import errno
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

import pytest

from billing import outbox as outbox_module
from billing.outbox import Outbox, Segment

REPO = Path(__file__).resolve().parents[2]


def record(request_id: str, **overrides: object) -> dict[str, object]:
    return {"request_id": request_id, "tenant_id": "t1", "key_id": None, "model": "m",
            "prompt_tokens": 3, "completion_tokens": 4, "cost_micros": 11, "ttft_ms": 1.5,
            "created_at": datetime(2025, 4, 1, 12, 30, 0, 123456, tzinfo=UTC),
            "started_at": datetime(2025, 4, 1, 12, 29, 59, tzinfo=UTC), **overrides}


def replay(directory: Path) -> list[dict[str, object]]:
    """What a process starting now would replay, as `UsageMeter.start` does it."""
    box = Outbox(directory)
    records = []
    for segment in box.claim_leftovers():
        records += box.read(segment)
        box.discard(segment)
    return records


def files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_round_trip_keeps_types(tmp_path):
    box = Outbox(tmp_path)
    records = [record("a"), record("b", created_at=datetime.now(UTC), status="error")]
    for r in records:
        assert box.append(r) is not None
    assert box.close() == 2  # uncommitted records stay, as after a crash
    back = replay(tmp_path)
    assert back == records
    assert isinstance(back[0]["created_at"], datetime)
    assert back[0]["created_at"].utcoffset() == timedelta(0)
    assert files(tmp_path) == []  # replayed segments are deleted


@pytest.fixture
def open_umask() -> Iterator[None]:
    """A umask that would leave new files and folders readable by all: the modes asserted
    below must then come from the outbox itself."""
    previous = os.umask(0o002)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("first", ["append", "claim_leftovers"])
def test_the_outbox_is_owner_only_however_it_is_created(tmp_path, open_umask, first):
    configured = tmp_path / "state" / "outbox"  # neither exists yet
    box = Outbox(configured / "0123abcd")  # a folder per database, as the gateway lays it out
    if first == "claim_leftovers":  # the meter's start, before any record
        assert box.claim_leftovers() == []
    assert box.append(record("a")) is not None
    made = [tmp_path / "state", configured, configured / "0123abcd"]
    assert [mode(p) for p in made] == [0o700] * 3
    segments = list(box.directory.iterdir())
    assert len(segments) == 1 and mode(segments[0]) == 0o600
    box.close()


def test_an_existing_outbox_folder_keeps_its_mode(tmp_path, open_umask):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o750)  # an operator's choice
    box = Outbox(shared)
    assert box.append(record("a")) is not None
    assert mode(shared) == 0o750
    assert {mode(p) for p in shared.iterdir()} == {0o600}
    box.close()


def test_rotates_by_records_and_bytes(tmp_path):
    box = Outbox(tmp_path, segment_records=3)
    segments = [box.append(record(str(i))) for i in range(7)]
    assert len(files(tmp_path)) == 3
    assert [s.appended for s in dict.fromkeys(segments)] == [3, 3, 1]  # type: ignore[union-attr]
    box.close()

    big = Outbox(tmp_path / "big", segment_bytes=500)
    for i in range(6):
        big.append(record(f"big-{i}", model="x" * 200))
    assert len(files(tmp_path / "big")) == 3  # two lines of ~300 bytes per segment
    big.close()
    assert sorted(r["request_id"] for r in replay(tmp_path / "big")) == [
        f"big-{i}" for i in range(6)]


def test_committed_segments_are_deleted(tmp_path):
    box = Outbox(tmp_path, segment_records=2)
    segments = [box.append(record(str(i))) for i in range(3)]
    first, live = segments[0], segments[2]
    assert len(files(tmp_path)) == 2
    box.commit(segments[:1])
    assert len(files(tmp_path)) == 2  # one record of the sealed segment is not committed yet
    box.commit(segments[1:2])
    assert files(tmp_path) == [live.path.name]  # type: ignore[union-attr]
    assert not first.path.exists()  # type: ignore[union-attr]
    box.commit(segments[2:])
    assert box.pending() == 0
    box.seal()  # the flush seals the live segment: settled, it goes at once
    assert files(tmp_path) == []
    assert box.append(record("later")) is not None  # and a new one opens
    assert box.close() == 1
    assert [r["request_id"] for r in replay(tmp_path)] == ["later"]


def test_clean_close_leaves_nothing(tmp_path):
    box = Outbox(tmp_path)
    box.commit([box.append(record("a")), box.append(record("b"))])
    assert box.close() == 0
    assert files(tmp_path) == []


def test_torn_last_line_is_skipped(tmp_path, caplog):
    box = Outbox(tmp_path)
    segment = box.append(record("a"))
    box.append(record("b"))
    assert segment is not None
    box.close()
    with segment.path.open("ab") as f:
        f.write(b'{"request_id":"torn","tenant_id":"t')  # the writer died mid-write
    with caplog.at_level(logging.WARNING, logger="billing.outbox"):
        assert [r["request_id"] for r in replay(tmp_path)] == ["a", "b"]
    assert "torn last line 3 skipped" in caplog.text


def test_a_live_segment_in_the_same_process_is_not_claimed(tmp_path):
    """flock locks belong to the open file: a second Outbox sees the first one's segments as
    held, like a replica's."""
    first = Outbox(tmp_path)
    first.append(record("mine"))
    assert first.claim_leftovers() == []  # never its own
    assert Outbox(tmp_path).claim_leftovers() == []
    first.close()
    assert [r["request_id"] for r in replay(tmp_path)] == ["mine"]


_WRITER = """
import sys
from pathlib import Path
from billing.outbox import Outbox

box = Outbox(Path(sys.argv[1]), segment_records=2)
for i in range(5):
    assert box.append({"request_id": f"r{i}", "tenant_id": "t"}) is not None
print("ready", flush=True)
sys.stdin.read()  # hold the locks until killed
"""


def test_only_a_dead_process_segments_are_drained(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        assert len(files(tmp_path)) == 3
        assert replay(tmp_path) == []  # alive: its segments are locked
        assert len(files(tmp_path)) == 3
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert sorted(r["request_id"] for r in replay(tmp_path)) == [f"r{i}" for i in range(5)]
    assert files(tmp_path) == []


def test_stale_half_created_segment_is_removed(tmp_path):
    stale = tmp_path / ".new-usage-1-dead-000000.jsonl"
    stale.write_bytes(b"")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    fresh = tmp_path / ".new-usage-2-beef-000000.jsonl"  # being created right now
    fresh.write_bytes(b"")
    assert Outbox(tmp_path).claim_leftovers() == []
    assert files(tmp_path) == [fresh.name]


def test_disk_errors_never_raise(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    caplog.set_level(logging.ERROR, logger="billing.outbox")
    assert Outbox(blocker / "outbox").append(record("a")) is None  # cannot even mkdir
    assert "unwritable" in caplog.text

    box = Outbox(tmp_path / "box")
    first = box.append(record("ok"))
    assert first is not None

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(outbox_module.os, "write", full)
        assert box.append(record("lost")) is None
    assert box.append(record("skipped")) is None  # the disk is left alone for a while
    monkeypatch.setattr(outbox_module, "RETRY_AFTER_S", 0.0)
    box._skip_until = 0.0  # the pause is over
    second = box.append(record("again"))
    assert second is not None and second is not first  # never after a possibly torn line
    box.close()
    assert sorted(r["request_id"] for r in replay(tmp_path / "box")) == ["again", "ok"]


def test_unserialisable_record_is_not_written(tmp_path):
    box = Outbox(tmp_path)
    assert box.append(record("d", cost_micros=Decimal("1.5"))) is None
    assert box.append(record("fine")) is not None
    box.close()
    assert [r["request_id"] for r in replay(tmp_path)] == ["fine"]


async def test_sync_flushes_to_disk(tmp_path):
    box = Outbox(tmp_path)
    segment = box.append(record("a"))
    assert isinstance(segment, Segment) and segment.dirty
    await box.sync()
    assert not segment.dirty
    box.close()
