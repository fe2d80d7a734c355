"""What a call has used so far, kept current as its events arrive: what the gateway bills.

Torch-free (as all of `workers.protocol`), so a gateway that only routes to workers and
upstreams never imports the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.protocol.events import Event, OtherDelta, TextDelta, ToolCallDelta
from workers.protocol.events import Usage as UsageEvent


@dataclass
class Usage:
    """Filled in as a request runs; final once the call or stream has ended."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finished: bool = False
    # Of the prompt, what the deployment had computed when the request ended (engines report
    # it; None where nobody knows): what an answer cut short before its first token costs.
    computed_prompt_tokens: int | None = None
    reported: bool = False  # the upstream has said its own counts (a `Usage` event)

    def observe(self, event: Event) -> None:
        """Keep the counts current from an upstream's events: its own usage once it reports
        it; until then one token per content delta (what a stream cut short is billed)."""
        if isinstance(event, UsageEvent):
            self.prompt_tokens = event.prompt_tokens or self.prompt_tokens
            self.completion_tokens = event.completion_tokens
            self.cached_tokens = event.cached_tokens
            self.reported = True
        elif isinstance(event, TextDelta | ToolCallDelta | OtherDelta) and not self.reported:
            self.completion_tokens += 1


GRAMMAR_ERROR = "grammar_error"  # a choice's grammar broke mid-answer (FinishReason.ERROR)
