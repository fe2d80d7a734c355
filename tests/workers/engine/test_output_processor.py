"""The output processor's side for token deltas (`with_text`): what the serving client shows
of each step's tokens, held to what the detokenizer gives when fed the same tokens."""

from workers.engine.output_processor import text_stream, with_text
from workers.engine.outputs import CompletionOutput, TokenLogprob
from workers.engine.sampling_params import SamplingParams


def deltas(tokenizer, ids, params, *, per_step=2, finish_reason="length"):
    """Feed `ids` as token deltas of `per_step` tokens, the last one finished."""
    stream = text_stream(tokenizer, tokenizer.encode("Say:"), params)
    shown = []
    for start in range(0, len(ids), per_step):
        chunk = ids[start:start + per_step]
        last = start + per_step >= len(ids)
        out = CompletionOutput(0, "", chunk, finish_reason if last else None, None,
                               [TokenLogprob(t, -1.0) for t in chunk])
        shown.append(with_text(stream, out))
        if shown[-1][1]:
            break
    return shown


def test_token_deltas_give_the_text_of_the_whole(tokenizer):
    text = "Fête 🎉 naïve, plain words"
    ids = tokenizer.encode(text, add_special_tokens=False)
    shown = deltas(tokenizer, ids, SamplingParams())
    assert "".join(out.text for out, _ in shown) == text
    assert [t for out, _ in shown for t in out.token_ids] == ids
    assert shown[-1][0].finish_reason == "length" and not shown[-1][1]


def test_a_stop_string_cuts_text_tokens_and_logprobs_on_its_token(tokenizer):
    text = "alpha beta STOPHERE gamma delta"
    ids = tokenizer.encode(text, add_special_tokens=False)
    shown = deltas(tokenizer, ids, SamplingParams(stop=["STOPHERE"]), per_step=3)
    out, stopped = shown[-1]
    assert stopped and out.finish_reason == "stop" and out.stop_reason == "STOPHERE"
    assert "".join(o.text for o, _ in shown) == "alpha beta "
    kept = [t for o, _ in shown for t in o.token_ids]
    assert tokenizer.decode(kept).endswith("STOPHERE")  # through the completing token only
    assert kept == ids[:len(kept)] and len(kept) < len(ids)
    assert [lp.token_id for o, _ in shown for lp in o.logprobs] == kept
