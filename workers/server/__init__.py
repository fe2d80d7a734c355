"""`switchboard worker`: one engine behind an internal, OpenAI-compatible HTTP API."""

from workers.server.app import WorkerOptions, create_app

__all__ = ["WorkerOptions", "create_app"]
