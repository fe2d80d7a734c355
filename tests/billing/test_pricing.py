"""Charges in integer micro-USD: parts priced separately, markups, shares, rounding up."""

from __future__ import annotations

from decimal import Decimal

from billing.pricing import Rates, charge

RATES = Rates(Decimal("0.15"), Decimal("0.6"), Decimal("0.075"))


def test_parts_are_priced_separately_and_rounded_up() -> None:
    c = charge(RATES, prompt_tokens=1000, completion_tokens=10, cached_tokens=400)
    assert (c.input_micros, c.output_micros, c.cached_micros) == (90, 6, 30)
    assert c.total_micros == 126
    tiny = charge(RATES, prompt_tokens=1, completion_tokens=1)
    assert (tiny.input_micros, tiny.output_micros, tiny.cached_micros) == (1, 1, 0)


def test_cached_tokens_never_exceed_the_prompt() -> None:
    c = charge(RATES, prompt_tokens=10, completion_tokens=0, cached_tokens=50)
    assert (c.input_micros, c.cached_micros) == (0, 1)


def test_markup_and_discount_in_basis_points() -> None:
    rates = Rates(Decimal(2), Decimal(4), Decimal(1))
    assert charge(rates, prompt_tokens=100, completion_tokens=50,
                  markup_bp=2000).total_micros == 240 + 240
    assert charge(rates, prompt_tokens=100, completion_tokens=50,
                  markup_bp=-1000).total_micros == 180 + 180
    assert charge(rates, prompt_tokens=100, completion_tokens=50,
                  markup_bp=-10_000).total_micros == 0


def test_share_for_answers_from_the_response_cache() -> None:
    rates = Rates(Decimal(2), Decimal(4), Decimal(1))
    full = charge(rates, prompt_tokens=100, completion_tokens=50)
    tenth = charge(rates, prompt_tokens=100, completion_tokens=50, share_percent=10)
    assert (tenth.input_micros, tenth.output_micros) == (20, 20)
    assert charge(rates, prompt_tokens=100, completion_tokens=50,
                  share_percent=0).total_micros == 0
    assert full.total_micros == 400
