"""What a step costs, in token-equivalents, and how long one takes on this machine.

A prompt or output token costs one unit for its projections; attention adds its context over
`attention_tokens` (the context length at which a token's attention FLOPs equal its
projections': 2 x layer parameters / (4 x head size x query heads x layers), about 3,000 for
SmolLM2). The engine times every step and keeps a moving average of seconds per unit, so the
scheduler can turn "at most this long" into units without knowing the hardware. Until a step
big enough to time has run, it assumes a slow machine (`GUESS_SECONDS_PER_UNIT`, about a
2-core CPU): a fast one then runs a short step or two, never a long one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GUESS_SECONDS_PER_UNIT = 1e-3


@dataclass
class StepCost:
    attention_tokens: float = 0.0  # 0: attention not counted
    seconds_per_unit: float | None = None  # None until a step has been timed
    smoothing: float = 0.3  # weight of the newest step in the moving average
    min_units: float = 32.0  # smaller steps are mostly fixed overhead: not timed

    def of_chunk(self, num_tokens: int, start_pos: int) -> float:
        """Units of `num_tokens` tokens computed after `start_pos` cached ones."""
        if self.attention_tokens <= 0:
            return float(num_tokens)
        return num_tokens * (1.0 + (start_pos + num_tokens / 2.0) / self.attention_tokens)

    def tokens_within(self, units: float, start_pos: int, limit: int) -> int:
        """The most tokens (up to `limit`) after `start_pos` that cost at most `units`."""
        if units <= 0 or limit <= 0:
            return 0
        if self.attention_tokens <= 0:
            return min(limit, int(units))
        # n (1 + (p + n/2) / K) <= u  <=>  n^2 / (2K) + n (1 + p/K) - u <= 0
        k = self.attention_tokens
        b = 1.0 + start_pos / k
        n = max(0, min(limit, int((-b + math.sqrt(b * b + 2.0 * units / k)) * k)))
        while n < limit and self.of_chunk(n + 1, start_pos) <= units:  # float rounding
            n += 1
        while n > 0 and self.of_chunk(n, start_pos) > units:
            n -= 1
        return n

    def observe(self, units: float, seconds: float) -> None:
        """Fold one timed step into the seconds-per-unit average."""
        if units < self.min_units or seconds <= 0:
            return
        sample = seconds / units
        if self.seconds_per_unit is None:
            self.seconds_per_unit = sample
        else:
            self.seconds_per_unit += self.smoothing * (sample - self.seconds_per_unit)

    def units_in(self, seconds: float) -> float:
        """How many units fit in `seconds` at the measured rate (or the guess before it)."""
        return seconds / (self.seconds_per_unit or GUESS_SECONDS_PER_UNIT)


def attention_tokens(config: object) -> float:
    """`StepCost.attention_tokens` for a Llama-shaped HF config."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", heads) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    layer_params = (hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden
                    + 3 * hidden * config.intermediate_size)
    return 2.0 * layer_params / (4.0 * head_dim * heads)


@dataclass
class StepRoom:
    """What is left of one step's units for prompt chunks (None: no limit). The first chunk
    that asks gets at least `min_chunk` tokens, so prompts always advance."""

    cost: StepCost
    units: float | None
    min_chunk: int  # the scheduler's MIN_SHARED_CHUNK
    prefilled: bool = False

    def take(self, num_tokens: int, start_pos: int) -> int:
        """How many of `num_tokens` prompt tokens after `start_pos` fit; charges them."""
        if self.units is None or num_tokens <= 0:
            return num_tokens
        n = self.cost.tokens_within(self.units, start_pos, num_tokens)
        if not self.prefilled:
            n = max(n, min(num_tokens, self.min_chunk))
        if n:
            self.prefilled = True
            self.charge(n, start_pos)
        return n

    def charge(self, num_tokens: int, start_pos: int) -> None:
        """Count tokens that run whatever the room (decode rows)."""
        if self.units is not None:
            self.units -= self.cost.of_chunk(num_tokens, start_pos)
