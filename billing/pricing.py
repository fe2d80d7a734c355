"""What a request costs: input, cached input and output priced separately, in integer
micro-USD, with the plan's markup; and the price versions records point at.

A price per 1M tokens in USD is exactly micro-USD per token, so a part's cost is
`rate x tokens`, adjusted by the markup (basis points) and, for answers from the response
cache, the plan's share; each part is rounded up on its own and the total is their sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from billing.models import PriceVersion

BASIS = 10_000


@dataclass(frozen=True, slots=True)
class Rates:
    """USD per 1M tokens, and the price version they come from (None: not recorded)."""

    input_per_1m: Decimal
    output_per_1m: Decimal
    cached_input_per_1m: Decimal
    price_id: str | None = None


@dataclass(frozen=True, slots=True)
class Charge:
    input_micros: int = 0
    output_micros: int = 0
    cached_micros: int = 0

    @property
    def total_micros(self) -> int:
        return self.input_micros + self.output_micros + self.cached_micros


def charge(rates: Rates, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
           markup_bp: int = 0, share_percent: int | Decimal = 100) -> Charge:
    """`cached_tokens` are the part of the prompt served from the prefix cache;
    `share_percent` scales the whole (a cached answer's or a batch line's share)."""
    cached = min(max(cached_tokens, 0), prompt_tokens)
    factor = Decimal(BASIS + markup_bp) * share_percent / (BASIS * 100)

    def part(rate: Decimal, tokens: int) -> int:
        return max(0, math.ceil(rate * tokens * factor))

    return Charge(part(rates.input_per_1m, prompt_tokens - cached),
                  part(rates.output_per_1m, completion_tokens),
                  part(rates.cached_input_per_1m, cached))


async def ensure_price_version(session: AsyncSession, *, deployment: str, tier: str,
                               rates: Rates, source: str) -> str:
    """The id of the deployment's current price version, adding one if the price changed."""
    latest = await session.scalar(
        select(PriceVersion).where(PriceVersion.deployment == deployment)
        .order_by(PriceVersion.effective_from.desc(), PriceVersion.id.desc()).limit(1))
    if latest is not None and (latest.tier, latest.input_per_1m, latest.output_per_1m,
                               latest.cached_input_per_1m, latest.source) == (
            tier, rates.input_per_1m, rates.output_per_1m, rates.cached_input_per_1m, source):
        return latest.id
    version = PriceVersion(deployment=deployment, tier=tier, input_per_1m=rates.input_per_1m,
                           output_per_1m=rates.output_per_1m,
                           cached_input_per_1m=rates.cached_input_per_1m, source=source)
    session.add(version)
    await session.commit()
    return version.id
