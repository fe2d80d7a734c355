"""Money is integer micro-USD everywhere; USD appears only as exact decimal strings."""

from __future__ import annotations

MICROS_PER_USD = 1_000_000


def usd(micros: int) -> str:
    """Integer micro-USD as an exact decimal string: 1234567 -> "1.234567" (never a float)."""
    sign = "-" if micros < 0 else ""
    whole, frac = divmod(abs(micros), MICROS_PER_USD)
    return f"{sign}{whole}.{frac:06d}"
