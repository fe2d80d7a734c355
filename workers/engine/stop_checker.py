"""The stop checker: does a sample end with the token it just took, and why.

Checked on every kept token, in the step, so a sample never runs a step past its end: a
grammar that broke, a stop string (only where the engine detokenizes: the serving path
matches those in its output processor and stops the sample itself), EOS or the grammar's
end, a stop token id, then the length limit.
"""

from __future__ import annotations

import logging

from workers.engine.request import Sample
from workers.engine.sequence import FinishReason, Sequence

logger = logging.getLogger(__name__)


class StopChecker:
    def __init__(self, eos_token_ids: list[int], max_model_len: int) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.num_grammar_errors = 0  # samples failed: a grammar refused its own masked token

    def check(self, sample: Sample, token: int) -> FinishReason | None:
        """Why the sample ends with `token` (already appended), or None: it goes on."""
        seq = sample.seq
        params = seq.sampling_params
        grammar_done = grammar_broken = False
        if seq.grammar is not None:
            grammar_done, grammar_broken = self.advance_grammar(seq, token)
        if grammar_broken:
            if params.detokenize:
                sample.detokenizer.append(token)  # the text shows what token_ids hold
            reason = FinishReason.ERROR
        elif params.detokenize and sample.detokenizer.append(token):
            sample.stop_reason = sample.detokenizer.stop_reason
            reason = FinishReason.STOP
        elif grammar_done or (not params.ignore_eos and token in self.eos_token_ids):
            reason = FinishReason.STOP
        elif token in params.stop_token_ids:
            reason, sample.stop_reason = FinishReason.STOP, token
        elif (
            seq.num_output_tokens >= (params.max_tokens or 0)
            or seq.num_tokens >= self.max_model_len
        ):
            reason = FinishReason.LENGTH
        else:
            return None
        if params.detokenize:
            sample.detokenizer.flush()
        return reason

    def advance_grammar(self, seq: Sequence, token: int) -> tuple[bool, bool]:
        """Feed a kept token to the sample's matcher: (ended, broken). Ended: nothing more can
        follow, or a stop token came where it was allowed, whatever ignore_eos says.

        Broken: the matcher refused the token its own mask allowed (llguidance hit one of its
        limits, or a bug). That sample's output cannot be trusted, and ending it as "stop"
        would pass a cut document off as complete (or "length" as merely long), so it ends
        with `FinishReason.ERROR`: logged here at error level with the request id, counted
        in `num_grammar_errors`, and failed to the client (a 500, code `grammar_error`)."""
        assert seq.grammar is not None
        if seq.grammar.accept_token(token):
            return seq.grammar.is_terminated(), False
        self.num_grammar_errors += 1
        logger.error("request %s: sample %d: token %d is outside its grammar (%s); the sample "
                     "fails with a grammar_error", seq.request_id, seq.sample_index, token,
                     seq.grammar.error() or "refused")
        return False, True
