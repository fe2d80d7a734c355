"""The llguidance side: compile cache, matchers, closing objects, errors naming the field."""

from __future__ import annotations

import pytest
import torch

from workers.engine.sampling_params import InvalidRequestError
from workers.engine.structured import StructuredOutputs
from workers.runner import structured_backend, token_mask
from workers.runner.structured_backend import StructuredBackend, closed_objects


@pytest.fixture(scope="module")
def backend(tokenizer):
    return StructuredBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def allowed(matcher, vocab: int) -> set[int]:
    bitmask = torch.zeros(1, token_mask.bitmask_words(vocab), dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return set(torch.nonzero(token_mask.unpack(bitmask, vocab)[0]).flatten().tolist())


def test_matcher_walks_a_choice_and_ends_with_it(backend, tokenizer):
    grammar = backend.compile(StructuredOutputs(choice=["yes", "no"]))
    matcher = backend.matcher(grammar)
    first = allowed(matcher, backend.vocab_size)
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert yes[0] in first and tokenizer.eos_token_id not in first
    for token in yes:
        assert matcher.accept_token(token)
    assert matcher.is_terminated()  # nothing can follow "yes"
    other = backend.matcher(grammar)  # a fresh copy: the template never moved
    assert not other.is_terminated() and allowed(other, backend.vocab_size) == first


def test_compiles_once_per_text(backend):
    before = backend.num_compiles
    for _ in range(3):
        backend.compile(StructuredOutputs(regex="[0-9]{2}"))
    backend.compile(StructuredOutputs(regex="[0-9]{2}", param="guided_regex"))  # same text
    backend.compile(StructuredOutputs(regex="[0-9]{3}"))
    assert backend.num_compiles == before + 2


@pytest.mark.parametrize(("spec", "param"), [
    (StructuredOutputs(json="{not json", param="guided_json"), "guided_json"),
    (StructuredOutputs(json="[1, 2]"), "structured.json"),
    (StructuredOutputs(json={"type": "no-such-type"}, param="response_format.json_schema.schema"),
     "response_format.json_schema.schema"),
    (StructuredOutputs(regex="(", param="structured_outputs.regex"), "structured_outputs.regex"),
    (StructuredOutputs(grammar="root ::= missing"), "structured.grammar"),
])
def test_bad_constraints_raise_invalid_request(backend, spec, param):
    with pytest.raises(InvalidRequestError) as info:
        backend.compile(spec)
    assert info.value.param == param
    assert str(info.value).startswith(f"invalid {spec.kind}: ")


def test_closed_objects_only_closes_what_lists_properties():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"x": {}}},
                       "free": {"type": "object"},
                       "open": {"properties": {}, "additionalProperties": True}},
        "$defs": {"d": {"properties": {"y": {}}}},
        "allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}],
        "items": [{"properties": {}}],
    }
    out = closed_objects(schema)
    assert "additionalProperties" not in out  # it has an allOf: its parts decide together
    props = out["properties"]
    assert set(props) == {"properties", "free", "open"}  # a property named "properties"
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]
    assert props["open"]["additionalProperties"] is True
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert all("additionalProperties" not in part for part in out["allOf"])
    assert out["items"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema["$defs"]["d"]  # the input is not changed


def test_fill_ahead_masks_each_position_and_leaves_the_matcher_where_it_was(backend,
                                                                             tokenizer):
    """Speculative verification: position i's mask assumes proposals 0..i-1 were kept; a
    refused proposal stops the read-ahead, and the matcher is rolled back."""
    vocab = backend.vocab_size
    matcher = backend.matcher(backend.compile(StructuredOutputs(regex="[0-9]{3}")))
    digit = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    one, two, x = (tokenizer.convert_tokens_to_ids(t) for t in ("1", "2", "x"))
    before = allowed(matcher, vocab)
    masks = token_mask.unpack(token_mask.fill_ahead(matcher, [one, two, x, one], vocab), vocab)
    at = [set(torch.nonzero(m).flatten().tolist()) for m in masks]
    assert digit <= at[0] and x not in at[0]
    assert at[0] == at[1] == at[2] == before  # three digits, each from the digits' set
    assert at[3] == at[4] == set(range(vocab))  # after the refused "x": never sampled from
    assert allowed(matcher, vocab) == before and not matcher.is_terminated()
    # three digits complete the grammar: the sample ends at the third, nothing is masked after
    ahead = token_mask.unpack(token_mask.fill_ahead(matcher, [one, two, one], vocab), vocab)
    assert bool(ahead[3].all()) and not bool(ahead[2].all())
    assert allowed(matcher, vocab) == before


SELF = {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}  # issue 40


def test_a_schema_without_a_finite_instance_is_refused_before_compiling(backend):
    before = backend.num_compiles
    spec = StructuredOutputs(json=SELF, param="response_format.json_schema.schema")
    with pytest.raises(InvalidRequestError) as info:
        backend.compile(spec)
    assert info.value.param == "response_format.json_schema.schema"
    assert str(info.value).startswith(
        "invalid json: the schema cannot be satisfied: it recurses without end: '#' requires "
        "itself at every level (# -> #/properties/n -> #)")
    # what is checked is what would compile: objects closed, so a required name they do not
    # list cannot be written
    closed = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}
    with pytest.raises(InvalidRequestError, match="requires property 'b' but does not allow"):
        backend.compile(StructuredOutputs(json=closed))
    assert backend.num_compiles == before  # refused before llguidance saw either
    linked = {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}},
              "required": ["v"]}
    backend.compile(StructuredOutputs(json=linked))  # recursion with a way out compiles


def test_a_broken_matcher_says_why(backend, monkeypatch):
    """Had the check missed it, llguidance would break on the endless schema mid-answer: its
    only allowed first token (`{"`) forces `{"n": {"n": ...` without end, and consuming it
    fails. The matcher then reports the error the engine logs."""
    monkeypatch.setattr(structured_backend, "unsatisfiable", lambda schema: None)
    matcher = backend.matcher(backend.compile(StructuredOutputs(json={**SELF, "title": "x"})))
    assert matcher.error() is None
    (first,) = allowed(matcher, backend.vocab_size)
    assert not matcher.accept_token(first)
    assert matcher.error()  # one line, llguidance's words
    assert "\n" not in matcher.error()
