"""Reading HTML form fields into typed values, collecting one message per bad field.

Browsers send every field as text (empty when left blank), so "blank" means "not set"
(unlimited, all, no expiry). The service layer then applies its own rules; its messages are
shown beside the form too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from starlette.datastructures import FormData, UploadFile

from gateway.errors import APIError
from tenancy.service import ServiceError

INT32_MAX = 2**31 - 1
_SPLIT = re.compile(r"[,\s]+")


class FormReader:
    """Typed getters over one submitted form; `errors` maps field name -> message."""

    def __init__(self, data: FormData) -> None:
        self.data = data
        self.errors: dict[str, str] = {}

    @property
    def ok(self) -> bool:
        return not self.errors

    def values(self) -> dict[str, str]:
        """What was typed, to fill the form again after an error (files and token left out)."""
        return {k: v for k, v in self.data.items() if isinstance(v, str) and k != "csrf_token"}

    def raw(self, name: str) -> str:
        value = self.data.get(name)
        return value.strip() if isinstance(value, str) else ""

    def text(self, name: str, *, required: bool = False, max_len: int = 200,
             label: str | None = None) -> str:
        value = self.raw(name)
        what = label or name.replace("_", " ")
        if required and not value:
            self.errors[name] = f"Enter a {what}."
        elif len(value) > max_len:
            self.errors[name] = f"The {what} is longer than {max_len} characters."
        elif "\x00" in value:
            self.errors[name] = f"The {what} contains a NUL character."
        return value

    def integer(self, name: str, *, low: int = 1, high: int = INT32_MAX) -> int | None:
        """Blank: None (no limit)."""
        value = self.raw(name)
        if not value:
            return None
        try:
            number = int(value)
        except ValueError:
            self.errors[name] = "Enter a whole number, or leave it blank."
            return None
        if not low <= number <= high:
            self.errors[name] = f"Enter a number from {low} to {high}, or leave it blank."
            return None
        return number

    def weight(self, name: str, *, high: float, default: float) -> float:
        """A finite number in (0, high]; blank: `default` (the field always has a value)."""
        value = self.raw(name)
        if not value:
            return default
        try:
            number = float(value)
        except ValueError:
            self.errors[name] = "Enter a number, like 1 or 2.5, or leave it blank."
            return default
        if not 0 < number <= high:  # NaN and the infinities fail this too
            self.errors[name] = f"Enter a number above 0 and at most {high:g}, or leave it blank."
            return default
        return number

    def dollars(self, name: str, *, high: int = 10**9) -> int | None:
        """A USD amount as integer micro-USD; blank: None."""
        value = self.raw(name).removeprefix("$")
        if not value:
            return None
        try:
            amount = Decimal(value)
        except InvalidOperation:
            self.errors[name] = "Enter an amount in dollars, like 25 or 12.50."
            return None
        if not amount.is_finite() or not 0 <= amount <= high:
            self.errors[name] = f"Enter an amount from 0 to {high} dollars."
            return None
        micros = amount * 1_000_000
        if micros != micros.to_integral_value():
            self.errors[name] = "Amounts go down to a millionth of a dollar."
            return None
        return int(micros)

    def names(self, name: str) -> list[str] | None:
        """Comma- or space-separated names; blank: None (everything allowed)."""
        value = self.raw(name)
        if not value:
            return None
        items = list(dict.fromkeys(p for p in _SPLIT.split(value) if p))
        if any(len(item) > 512 or "\x00" in item for item in items) or len(items) > 1000:
            self.errors[name] = "Names are at most 512 characters, at most 1000 of them."
            return None
        return items

    def choice(self, name: str, options: Sequence[str], *, default: str | None = None
               ) -> str | None:
        value = self.raw(name) or default
        if value not in options:
            self.errors[name] = f"Pick one of: {', '.join(options)}."
            return None
        return value

    def flag(self, name: str) -> bool:
        return self.raw(name).lower() in ("1", "on", "true", "yes")

    def future_time(self, name: str) -> datetime | None:
        """A `datetime-local` field taken as UTC, which must be in the future; blank: None."""
        value = self.raw(name)
        if not value:
            return None
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            self.errors[name] = "Enter a date and time, like 2030-01-31T12:00."
            return None
        moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
        if moment <= datetime.now(UTC):
            self.errors[name] = "The expiry must be in the future."
            return None
        return moment

    def file(self, name: str) -> UploadFile | None:
        value: Any = self.data.get(name)
        if not isinstance(value, UploadFile) or not value.filename:
            self.errors[name] = "Choose a file."
            return None
        return value


def error_text(exc: ServiceError | APIError) -> str:
    """A service or API error as the message shown beside a form."""
    text = exc.message if isinstance(exc, APIError) else str(exc)
    return text[:1].upper() + text[1:]
