"""A gateway that only routes to workers and upstreams imports neither torch nor transformers:
`import gateway.app` took 3.9 s and 290 MiB with them, 2.3 s and 108 MiB without (issue 38)."""

from __future__ import annotations

import subprocess
import sys

from tests.gateway.support import REPO

PROBE = """
import sys
import gateway.app, gateway.cli, gateway.deployments.worker, gateway.deployments.http
heavy = sorted(m for m in ("torch", "transformers", "litellm") if m in sys.modules)
print(",".join(heavy))
"""


def test_the_gateway_imports_no_engine():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=120)
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"
