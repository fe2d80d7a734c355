"""The errors of the tenancy data functions, which the HTTP layer and the CLI turn into
client-facing messages (gateway/app.py maps them to 409, 404 and 400)."""

from __future__ import annotations


class ServiceError(Exception):
    """Base of the errors the HTTP layer and the CLI turn into client-facing messages."""


class ConflictError(ServiceError):
    """The change clashes with existing data (a duplicate name). HTTP 409."""


class NotFoundError(ServiceError):
    """A referenced plan, tenant or key does not exist. HTTP 404."""


class InvalidError(ServiceError, ValueError):
    """A value is out of range or not one of the allowed choices. HTTP 400."""
