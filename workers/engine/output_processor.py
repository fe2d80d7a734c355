"""The output processor: samples' tokens -> `CompletionOutput`s with text, for both fronts.

One place decides what a caller sees of a sample: its text (one `IncrementalDetokenizer` per
sample, built by `text_stream`), where a stop string cuts it (the text, the tokens and the
logprobs all end with the token that completed it), and what a delta output carries.

Where the text is made depends on the caller, for a reason each. The serving path takes
token deltas and detokenizes them here, off the step thread (`with_text`, used by
`workers/client.py`), as vLLM v1 does. A request that asks the engine to detokenize
(`SamplingParams.detokenize`, the offline `LLM`'s default) has its stream fed in the step
(`StopChecker.check`), so that a stop string ends the sample on the very token that completed
it, before a speculating step's later tokens are kept; `request_output` then reads it.
"""

from __future__ import annotations

from typing import Any

from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.outputs import CompletionOutput, RequestOutput
from workers.engine.request import Request, Sample
from workers.engine.sampling_params import SamplingParams


def text_stream(tokenizer: Any, prompt_token_ids: list[int],
                params: SamplingParams) -> IncrementalDetokenizer:
    """One sample's detokenizer, with the request's stop strings and special-token choice."""
    return IncrementalDetokenizer(
        tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
        stop=list(params.stop or []),
        include_stop_str_in_output=params.include_stop_str_in_output)


def request_output(request: Request, *, finished: bool) -> RequestOutput:
    """A request's output after a step: everything so far, or, for `output_kind="delta"`,
    only what is new since its last output (O(new) per step, not a copy of it all)."""
    delta = request.params.output_kind == "delta"
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=[_sample_output(i, sample, delta) for i, sample in enumerate(request.samples)],
        finished=finished,
        metrics=request.metrics,
        num_cached_tokens=request.samples[0].seq.num_cached_tokens or 0,
    )


def _sample_output(index: int, sample: Sample, delta: bool) -> CompletionOutput:
    seq = sample.seq
    tokens = seq.token_ids
    logprobs = sample.logprobs
    if delta:
        out_text = sample.detokenizer.take()
        out_tokens = tokens[seq.num_prompt_tokens + sample.sent_tokens:]
        out_logprobs = None if logprobs is None else logprobs[sample.sent_logprobs:]
        sample.sent_tokens = len(tokens) - seq.num_prompt_tokens
        sample.sent_logprobs = 0 if logprobs is None else len(logprobs)
    else:
        out_text, out_tokens = sample.detokenizer.text, seq.output_token_ids
        out_logprobs = None if logprobs is None else list(logprobs)
    return CompletionOutput(
        index=index, text=out_text, token_ids=out_tokens,
        finish_reason=str(seq.finish_reason) if seq.finish_reason else None,
        stop_reason=sample.stop_reason, logprobs=out_logprobs)


def with_text(stream: IncrementalDetokenizer,
              out: CompletionOutput) -> tuple[CompletionOutput, bool]:
    """A sample's token delta from an engine that did not detokenize, with its new text:
    (the output, whether a stop string ended the sample here). Past a stop string the
    tokens and logprobs are dropped and the finish is "stop"; the engine has not heard of
    it yet (the caller stops the sample)."""
    kept = 0
    stopped = False
    for token in out.token_ids:
        kept += 1
        if stream.append(token):
            stopped = True
            break
    if stopped:
        reason, stop_reason = "stop", stream.stop_reason
    else:
        reason, stop_reason = out.finish_reason, out.stop_reason
        if reason is not None:
            stream.flush()  # the sample ended for another reason: release the held tail
    logprobs = None if out.logprobs is None else out.logprobs[:kept]
    return CompletionOutput(out.index, stream.take(), out.token_ids[:kept], reason,
                            stop_reason, logprobs), stopped
