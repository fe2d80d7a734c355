"""The engine benchmark counts the CPU its system's whole process tree used, a grandchild
that its parent never reaps included (vLLM's engine core), so that work is not reported as
another process's load."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench import engine_throughput as et

# The child starts a grandchild that spins for `spin` seconds, does not wait for it, and
# exits once the grandchild is done (so only tree sampling can see the grandchild's CPU).
CHILD = """
import subprocess, sys, time
spin = float(sys.argv[1])
g = subprocess.Popen([sys.executable, "-c",
    "import time\\nend = time.monotonic() + %r\\nwhile time.monotonic() < end: pass" % spin])
time.sleep(spin + 0.6)
"""


def test_an_unreaped_grandchilds_cpu_counts_as_the_runs_own():
    own = et.run_counting_cpu([sys.executable, "-c", CHILD, "1.5"], 30, None, None)
    assert own >= 1.0  # the grandchild spun ~1.5 s on a core; RUSAGE_CHILDREN sees ~0


def test_a_run_past_its_limit_is_stopped():
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        et.run_counting_cpu([sys.executable, "-c", "import time; time.sleep(30)"], 1, None,
                            None)
    assert time.monotonic() - started < 10
