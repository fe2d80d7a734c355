"""Pydantic shapes of what crosses the HTTP boundary (kept apart from the ORM models)."""
