"""OpenAI/vLLM body fields -> SamplingParams: structured outputs and logit_bias."""

from __future__ import annotations

import pytest

from workers.engine.sampling_params import InvalidRequestError
from workers.openai_protocol import sampling_params

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_plain_body_has_no_constraint():
    params = sampling_params({"response_format": {"type": "text"}}, chat=True)
    assert params.structured is None and params.logit_bias is None


def test_response_format_json_schema_and_json_object():
    body = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}}
    spec = sampling_params(body, chat=True).structured
    assert spec is not None and spec.json == SCHEMA
    assert spec.param == "response_format.json_schema.schema"
    spec = sampling_params({"response_format": {"type": "json_object"}}, chat=False).structured
    assert spec is not None and spec.json_object


@pytest.mark.parametrize(("field", "value", "kind"), [
    ("guided_json", SCHEMA, "json"), ("guided_json", '{"type": "string"}', "json"),
    ("guided_regex", "[a-z]+", "regex"), ("guided_choice", ["yes", "no"], "choice"),
    ("guided_grammar", 'root ::= "a"', "grammar"),
])
def test_vllm_guided_fields(field, value, kind):
    spec = sampling_params({field: value}, chat=True).structured
    assert spec is not None and spec.kind == kind and spec.param == field


@pytest.mark.parametrize(("value", "kind"), [
    ({"json": SCHEMA}, "json"), ({"json_object": True}, "json_object"),
    ({"regex": "a+"}, "regex"), ({"choice": ["a"]}, "choice"), ({"grammar": 'root ::= "a"'},
                                                                 "grammar"),
])
def test_structured_outputs_field(value, kind):
    spec = sampling_params({"structured_outputs": value}, chat=True).structured
    assert spec is not None and spec.kind == kind
    assert spec.param == f"structured_outputs.{kind}"


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA,
                                                                  "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_regex": 3}, "guided_regex"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
])
def test_bad_bodies_name_the_field(body, param):
    with pytest.raises(InvalidRequestError) as info:
        sampling_params(body, chat=True)
    assert info.value.param == param


def test_logit_bias_keys_become_token_ids():
    params = sampling_params({"logit_bias": {"50256": -100, "7": 2.5}}, chat=True)
    assert params.logit_bias == {50256: -100.0, 7: 2.5}
