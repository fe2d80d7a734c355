"""The engine core and the tool-call processing import without torch (DESIGN.md: only
`workers.runner` touches it), so they can be tested and reused on any machine."""

from __future__ import annotations

import subprocess
import sys

from tests.gateway.support import REPO

PROBE = """
import importlib, pkgutil, sys
sys.modules["torch"] = None  # any `import torch` now fails
import workers.engine, workers.tools
names = [m.name for pkg in (workers.engine, workers.tools)
         for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + ".")]
for name in names + ["workers.protocol.events"]:
    importlib.import_module(name)
print(len(names))
"""


def test_engine_core_and_tools_import_without_torch():
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 10  # every module of both packages was imported
