"""Logprobs always serialize as JSON: a NaN or -inf (a masked or impossible token) becomes
OpenAI's floor, never a bare `NaN` / `-Infinity`."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

from workers.client import FLOOR_LOGPROB, EmbeddedClient
from workers.engine.outputs import TokenLogprob


def test_non_finite_logprobs_become_the_floor(tokenizer):
    client = EmbeddedClient(SimpleNamespace(tokenizer=tokenizer), "m")  # type: ignore[arg-type]
    entries = [TokenLogprob(5, math.nan, [(5, math.nan), (6, -math.inf)]),
               TokenLogprob(7, -0.25, [(7, -0.25)])]
    for chat in (True, False):
        body = client.logprobs(entries, chat)
        text = json.dumps(body, allow_nan=False)  # raises on NaN or infinities
        assert str(FLOOR_LOGPROB) in text and "-0.25" in text
    chat = client.logprobs(entries, True)["content"]
    assert [e["logprob"] for e in chat] == [FLOOR_LOGPROB, -0.25]
    assert [t["logprob"] for t in chat[0]["top_logprobs"]] == [FLOOR_LOGPROB, FLOOR_LOGPROB]
