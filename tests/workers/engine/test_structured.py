"""StructuredOutputs and logit_bias as plain data: validation before anything compiles."""

from __future__ import annotations

import pytest

from workers.engine.sampling_params import InvalidRequestError, SamplingParams
from workers.engine.structured import StructuredOutputs


def test_exactly_one_constraint():
    assert StructuredOutputs(json={"type": "object"}).kind == "json"
    assert StructuredOutputs(json_object=True).kind == "json_object"
    assert StructuredOutputs(regex="a+").kind == "regex"
    assert StructuredOutputs(choice=["a", "b"]).kind == "choice"
    assert StructuredOutputs(grammar='root ::= "a"').kind == "grammar"
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])


@pytest.mark.parametrize("kwargs", [
    {"json": 3}, {"choice": []}, {"choice": ["a", ""]}, {"choice": "ab"}, {"regex": ""},
    {"grammar": 5}, {"json": {"default": {1, 2}}},
])
def test_bad_shapes_name_the_field(kwargs):
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutputs(**kwargs, param="guided_x")
    assert info.value.param == "guided_x"


def test_text_is_the_cache_key_and_keeps_property_order():
    a = StructuredOutputs(json={"properties": {"b": {}, "a": {}}})
    b = StructuredOutputs(json={"properties": {"b": {}, "a": {}}}, param="guided_json")
    assert a.text == b.text == '{"properties":{"b":{},"a":{}}}'
    assert StructuredOutputs(choice=["x", "y"]).text == '["x", "y"]'
    assert a.error_param == "structured.json"


def test_sampling_params_carry_structured_and_logit_bias():
    spec = StructuredOutputs(regex="[0-9]+")
    params = SamplingParams(structured=spec, logit_bias={5: 100, 7: -100.0})
    assert params.structured is spec
    assert params.logit_bias == {5: 100.0, 7: -100.0}
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured={"json": {}})  # type: ignore[arg-type]


@pytest.mark.parametrize("bias", [
    {1: 101}, {1: -100.5}, {-1: 1}, {"1": 1}, {1: "1"}, {1: float("nan")}, {True: 1}, [1],
])
def test_bad_logit_bias_names_logit_bias(bias):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.param == "logit_bias"
