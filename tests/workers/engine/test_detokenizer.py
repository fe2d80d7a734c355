from workers.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer


def stream(tokenizer, ids, **kwargs):
    """Feed tokens one at a time; return the emitted deltas and the detokenizer."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:"), **kwargs)
    deltas, seen = [], ""
    for token in ids:
        stopped = detok.append(token)
        assert detok.text.startswith(seen)  # emitted text is never taken back
        deltas.append(detok.text[len(seen):])
        seen = detok.text
        if stopped:
            break
    else:
        detok.flush()
        deltas.append(detok.text[len(seen):])
    return deltas, detok


def test_multibyte_characters_are_never_split(tokenizer):
    text = "Fête 🎉 naïve 日本語 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # the emoji and CJK span several byte tokens
    deltas, detok = stream(tokenizer, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == text
    assert detok.text == tokenizer.decode(ids)


def test_stop_string_across_token_boundaries_never_leaks(tokenizer):
    text = "alpha beta STOPHERE gamma"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, detok = stream(tokenizer, ids, stop=["STOPHERE"])
    assert detok.stop_reason == "STOPHERE"
    assert "".join(deltas) == "alpha beta "
    assert all("STOP" not in d and d != "ST" for d in deltas)


def test_partial_stop_prefix_is_held_then_released(tokenizer):
    text = "one STO two"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, detok = stream(tokenizer, ids, stop=["STOP"])
    assert detok.stop_reason is None
    assert "".join(deltas) == text


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode("x = 1; y = 2; END z", add_special_tokens=False)
    _, detok = stream(tokenizer, ids, stop=["END"], include_stop_str_in_output=True)
    assert detok.text == "x = 1; y = 2; END"


def test_first_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("a b\n\nc ### d", add_special_tokens=False)
    _, detok = stream(tokenizer, ids, stop=["###", "\n\n"])
    assert detok.text == "a b"
    assert detok.stop_reason == "\n\n"


def test_special_tokens_skipped_by_default(tokenizer):
    eos = tokenizer.eos_token_id
    ids = [*tokenizer.encode("hello", add_special_tokens=False), eos]
    _, detok = stream(tokenizer, ids)
    assert detok.text == "hello"
    _, detok = stream(tokenizer, ids, skip_special_tokens=False)
    assert detok.text == "hello" + tokenizer.eos_token
