"""`switchboard worker`: one engine behind an internal, OpenAI-compatible HTTP API.

The app (and with it the engine and torch) loads on first use of a name from it, so the
gateway can read the workers' registration format without importing an engine.
"""

from typing import Any

__all__ = ["WorkerOptions", "create_app"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from workers.server import app

        return getattr(app, name)
    raise AttributeError(f"module 'workers.server' has no attribute {name!r}")
