"""Reading HTML form fields into typed values, collecting one message per bad field.

Browsers send every field as text (empty when left blank), so "blank" means "not set"
(unlimited, all, no expiry; a setting that always has a value takes its default). A setting's
bounds come from its declaration in `tenancy.fields`, as the admin API's and the CLI's do. The
data functions then apply their own rules; their messages are shown beside the form too.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from starlette.datastructures import FormData, UploadFile

from gateway.errors import APIError
from tenancy.errors import ServiceError
from tenancy.fields import (
    BUDGET_USD_MAX,
    LIST_ITEM_MAX,
    LIST_MAX,
    MICROS_PER_USD,
    NAME_MAX,
    Choice,
    Names,
    Number,
)

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

    def text(self, name: str, *, required: bool = False, max_len: int = NAME_MAX,
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

    def setting(self, field: Number | Choice | Names) -> Any:
        """A plan's or key's setting, read by its kind and checked against its bounds."""
        if isinstance(field, Number):
            return self.number(field)
        if isinstance(field, Choice):
            return self.choice(field)
        return self.names(field.name)

    def number(self, field: Number) -> Any:
        """Blank: None where the setting may be unset (unlimited), else its default."""
        name = field.name
        value = self.raw(name)
        blank = None if field.nullable else field.default
        if not value:
            return blank
        try:
            number = field.kind(value)
        except ValueError:
            self.errors[name] = ("Enter a whole number, or leave it blank." if field.kind is int
                                 else "Enter a number, like 1 or 2.5, or leave it blank.")
            return blank
        if not field.contains(number):  # NaN and the infinities fail this too
            self.errors[name] = f"Enter a number {field.range_words}, or leave it blank."
            return blank
        return number

    def dollars(self, name: str, *, high: int = BUDGET_USD_MAX) -> int | None:
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
        micros = amount * MICROS_PER_USD
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
        if (any(len(item) > LIST_ITEM_MAX or "\x00" in item for item in items)
                or len(items) > LIST_MAX):
            self.errors[name] = (f"Names are at most {LIST_ITEM_MAX} characters, at most "
                                 f"{LIST_MAX} of them.")
            return None
        return items

    def choice(self, field: Choice) -> str | None:
        """Blank: the choice's default, where it has one."""
        value = self.raw(field.name) or field.default
        if value not in field.options:
            self.errors[field.name] = f"Pick one of: {', '.join(field.options)}."
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
