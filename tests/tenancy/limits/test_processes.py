"""Exactness across OS processes sharing one Redis, like several gateway replicas."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from tests.tenancy.limits.conftest import REDIS_URL

ROOT = Path(__file__).resolve().parents[3]
PROCESSES = 3
PER_PROCESS = 70


def test_three_processes_admit_exactly_the_limit(namespace: str) -> None:
    start_at = time.time() + 2.0  # all bursts start together, after interpreter start-up
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.tenancy.limits.burst",
                REDIS_URL,
                namespace,
                f"w{i}",
                str(PER_PROCESS),
                str(start_at),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(PROCESSES)
    ]
    totals: Counter[str] = Counter()
    for worker in workers:
        out, err = worker.communicate(timeout=60)
        assert worker.returncode == 0, err
        totals.update(json.loads(out))
    assert totals == {"admitted": 50, "rpm": PROCESSES * PER_PROCESS - 50}
