"""Every setting an admin gives a plan, a tenant or a key, declared once: its bounds, its
default, and what it means.

The data functions check values against these declarations (`check`, raising InvalidError),
and each admin surface is built from them instead of restating them: the admin API's pydantic
types (gateway/schemas/admin.py), the console's form readers and hints (gateway/console/) and
the CLI's flags (gateway/commands/tenancy.py). tenancy/models.py builds its CHECK constraints
from here too; only the migration that added a constraint keeps its own frozen copy.

Standard library only, so that the models, the CLI and the limiter stay light.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from decimal import ROUND_DOWN, Decimal
from math import isfinite
from typing import Any

from tenancy.errors import InvalidError

INT32_MAX = 2**31 - 1  # limits live in INTEGER columns (32-bit on PostgreSQL)
MICROS_PER_USD = 1_000_000
BUDGET_USD_MAX = 10**9
NAME_MAX = 200  # plan, tenant, key and admin key names
LIST_ITEM_MAX = 512  # one name of an allow-list
LIST_MAX = 1000  # names in one allow-list

BUDGET_PERIODS = ("month", "day")
TENANT_STATUSES = ("active", "suspended")
# off: never; auto: exact cache only for deterministic requests (temperature 0 or a seed);
# exact: exact cache for every request; semantic: exact cache plus the semantic cache.
CACHE_MODES = ("off", "auto", "exact", "semantic")


@dataclass(frozen=True, slots=True)
class Number:
    """An integer, or a finite float, in [low, high] ((low, high] with `above_low`).

    A field without a default is nullable: None is a value ("unlimited", "the gateway's
    default", as `unset` says). One with a default always has a value.
    """

    name: str
    kind: type[int] | type[float]
    low: int
    high: int
    default: Any = None
    help: str = ""
    unset: str = ""
    above_low: bool = False
    noun: str = ""  # how messages call a value: "an integer" or "a number" unless given

    @property
    def nullable(self) -> bool:
        return self.default is None

    @property
    def interval(self) -> str:
        return f"{'(' if self.above_low else '['}{self.low}, {self.high}]"

    @property
    def range_words(self) -> str:
        """The bounds as a sentence says them: "from 1 to 100", "above 0 and at most 100"."""
        if self.above_low:
            return f"above {self.low:g} and at most {self.high:g}"
        return f"from {self.low} to {self.high}"

    @property
    def hint(self) -> str:
        """A help line for forms: what the field means and its bounds."""
        return f"{self.help[:1].upper()}{self.help[1:]}, {self.range_words}."

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and not isfinite(value):
            return False
        above = value > self.low if self.above_low else value >= self.low
        return above and value <= self.high

    def check(self, value: Any) -> Any:
        """The value as stored; InvalidError if it is not one this field holds."""
        if value is None and self.nullable:
            return None
        typed = not isinstance(value, bool) and isinstance(
            value, int if self.kind is int else int | float)
        if typed and self.contains(value):
            return self.kind(value)
        noun = self.noun or ("an integer" if self.kind is int else "a number")
        null = " or null" if self.nullable else ""
        raise InvalidError(f"{self.name} must be {noun} in {self.interval}{null}")

    def parse(self, text: str) -> Any:
        """A value typed as text (a flag, a form field); ValueError says what is wrong."""
        try:
            number = self.kind(text)
        except ValueError:
            raise ValueError(f"not {'an integer' if self.kind is int else 'a number'}: "
                             f"{text!r}") from None
        if not self.contains(number):
            raise ValueError(f"must be in {self.interval}: {text!r}")
        return number

    def constraints(self) -> dict[str, Any]:
        """The bounds as pydantic `Field` keywords."""
        found: dict[str, Any] = {"gt" if self.above_low else "ge": self.low, "le": self.high}
        if self.kind is float:
            found["allow_inf_nan"] = False
        return found

    def sql_check(self) -> str:
        """The bounds as a CHECK constraint's condition."""
        if self.above_low:
            return f"{self.name} > {self.low} AND {self.name} <= {self.high}"
        return f"{self.name} BETWEEN {self.low} AND {self.high}"


@dataclass(frozen=True, slots=True)
class Choice:
    """One of a few words."""

    name: str
    options: tuple[str, ...]
    default: str | None = None
    help: str = ""

    def check(self, value: Any) -> str:
        if value not in self.options:
            raise InvalidError(f"{self.name} must be one of {', '.join(self.options)}")
        return value

    def sql_check(self) -> str:
        return f"{self.name} IN ({', '.join(repr(option) for option in self.options)})"


@dataclass(frozen=True, slots=True)
class Names:
    """An allow-list of names, or None for "all"; kept in order, without repeats."""

    name: str
    help: str = ""
    default: None = None

    def check(self, values: Iterable[str] | None) -> list[str] | None:
        if values is None:
            return None
        if isinstance(values, str):
            raise InvalidError(f"{self.name} must be a list of names, not a string")
        out: dict[str, None] = {}
        for value in values:
            if not isinstance(value, str) or not value:
                raise InvalidError(f"{self.name} must contain non-empty strings")
            if len(value) > LIST_ITEM_MAX:
                raise InvalidError(f"{self.name} holds names of at most {LIST_ITEM_MAX} "
                                   "characters")
            out[value] = None
        if len(out) > LIST_MAX:
            raise InvalidError(f"{self.name} holds at most {LIST_MAX} names")
        return list(out)


def check_name(name: str, what: str) -> str:
    """A plan's, tenant's or adapter's name: stripped, not empty, at most NAME_MAX long."""
    if not isinstance(name, str) or not name.strip():
        raise InvalidError(f"{what} name must be a non-empty string")
    name = name.strip()
    if len(name) > NAME_MAX:
        raise InvalidError(f"{what} name is longer than {NAME_MAX} characters")
    return name


def key_name(name: str | None) -> str:
    """A key's label: optional, stripped, cut at NAME_MAX."""
    return (name or "").strip()[:NAME_MAX]


def usd_to_micros(amount: Decimal, *, rounding: str = ROUND_DOWN) -> int:
    """USD as integer micro-USD, finer fractions rounded by `rounding` (down: cut off)."""
    return int((amount * MICROS_PER_USD).to_integral_value(rounding=rounding))


# --- plans --------------------------------------------------------------------------------

RPM = Number("rpm", int, 1, INT32_MAX, help="requests per minute", unset="unlimited")
TPM = Number("tpm", int, 1, INT32_MAX, help="tokens per minute", unset="unlimited")
MAX_CONCURRENT = Number("max_concurrent", int, 1, INT32_MAX, help="requests in flight",
                        unset="unlimited")
BUDGET_MICROS = Number("budget_micros", int, 0, BUDGET_USD_MAX * MICROS_PER_USD,
                       help="spend cap per period, in micro-USD", unset="unlimited")
BUDGET_PERIOD = Choice("budget_period", BUDGET_PERIODS, "month",
                       help="the period the budget is spent over")
ALLOWED_MODELS = Names("allowed_models", help="allowed models")
ALLOWED_TIERS = Names("allowed_tiers", help="allowed cost tiers")
CACHE_MODE = Choice("cache_mode", CACHE_MODES, "auto",
                    help="response cache: off, auto (deterministic requests only), exact, "
                         "semantic (exact plus similar prompts)")
SEMANTIC_THRESHOLD = Number("semantic_threshold", float, 0, 1, above_low=True,
                            help="cosine similarity a cached prompt must reach (1: identical "
                                 "prompts only)", unset="the gateway's")
CACHE_TTL_S = Number("cache_ttl_s", int, 1, INT32_MAX, help="seconds a cached answer lives",
                     unset="the gateway's")
CACHE_HIT_PRICE_PERCENT = Number("cache_hit_price_percent", int, 0, 100, default=0,
                                 help="percent of the normal price charged for a cached "
                                      "answer")
# From free (-100%) to ten times the price.
PRICE_MARKUP_BP = Number("price_markup_bp", int, -10_000, 100_000, default=0,
                         help="markup (positive) or discount (negative) on every price, in "
                              "basis points: 2000 is +20 percent")
# The plan's place in the engines' fair-share scheduler (workers/engine/fair_share.py). Zero
# would never schedule the tenant; the cap keeps any one within 100 times the default share.
ENGINE_WEIGHT = Number("engine_weight", float, 0, 100, default=1.0, above_low=True,
                       noun="a finite number",
                       help="share of engine tokens relative to other tenants' weights")
PRIORITY = Number("priority", int, -10, 10, default=0,
                  help="order within the tenant, lower runs first; also the most urgent a "
                       "request may ask for")
# Zero would refuse every request; it can only lower a deployment's bound, never raise it.
EMBEDDING_MAX_REQUEST_TOKENS = Number(
    "embedding_max_request_tokens", int, 1, INT32_MAX, unset="the deployment's",
    help="the most input tokens one embeddings request may embed; lowers a deployment's "
         "bound, never raises it")
BATCH_PRICE_PERCENT = Number("batch_price_percent", int, 0, 100, default=50,
                             help="percent of the normal price charged for a line of a "
                                  "batch (the Batch API)")

# What a plan holds besides its name, in the order surfaces list them.
PLAN_SETTINGS: dict[str, Number | Choice | Names] = {
    field.name: field for field in (
        RPM, TPM, MAX_CONCURRENT, BUDGET_MICROS, BUDGET_PERIOD, ALLOWED_MODELS, ALLOWED_TIERS,
        CACHE_MODE, SEMANTIC_THRESHOLD, CACHE_TTL_S, CACHE_HIT_PRICE_PERCENT, PRICE_MARKUP_BP,
        ENGINE_WEIGHT, PRIORITY, EMBEDDING_MAX_REQUEST_TOKENS, BATCH_PRICE_PERCENT)
}

# --- tenants and keys ---------------------------------------------------------------------

TENANT_STATUS = Choice("status", TENANT_STATUSES)
ALLOWED_ADAPTERS = Names("allowed_adapters", help="allowed adapters")
KEY_LIMITS = (RPM, TPM, MAX_CONCURRENT)  # a key's own limits, under its plan's
