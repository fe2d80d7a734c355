"""The engine benchmark counts the CPU its system's whole process tree used, a grandchild
that its parent never reaps included (vLLM's engine core), so that work is not reported as
another process's load."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench.common.cpu_accounting import run_counting_cpu

# The child starts a grandchild that spins until it has used `spin` seconds of CPU (not of
# wall time: on a busy machine it gets a share of a core) and then leaves a file; the child
# sleeps until the file is there and exits without waiting for it (so only tree sampling can
# see the grandchild's CPU).
CHILD = """
import os, subprocess, sys, tempfile, time
spin = float(sys.argv[1])
done = os.path.join(tempfile.mkdtemp(), "done")
g = subprocess.Popen([sys.executable, "-c",
    "import time\\nwhile time.process_time() < %r: pass\\nopen(%r, 'w').close()"
    % (spin, done)])
while not os.path.exists(done):
    time.sleep(0.05)
"""


def test_an_unreaped_grandchilds_cpu_counts_as_the_runs_own():
    own = run_counting_cpu([sys.executable, "-c", CHILD, "1.5"], 30, None, None)
    assert own >= 1.0  # the grandchild spun ~1.5 s on a core; RUSAGE_CHILDREN sees ~0


def test_a_run_past_its_limit_is_stopped():
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_counting_cpu([sys.executable, "-c", "import time; time.sleep(30)"], 1, None, None)
    assert time.monotonic() - started < 10
