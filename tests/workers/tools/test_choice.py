"""tools + tool_choice -> what the engine is asked to do, and the schema that constrains it."""

from __future__ import annotations

import pytest

from workers.engine.sampling_params import InvalidRequestError
from workers.tools.choice import tool_plan

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}


def test_modes():
    assert tool_plan({}).mode == "none"
    assert tool_plan({"tools": [WEATHER]}).mode == "auto"
    assert tool_plan({"tools": [WEATHER], "tool_choice": "none"}).parses is False
    assert tool_plan({"tools": [WEATHER], "tool_choice": "auto"}).schema() is None


def test_named_function_is_constrained_to_its_parameters():
    plan = tool_plan({"tools": [WEATHER, NOW], "tool_choice": {
        "type": "function", "function": {"name": "get_weather"}}})
    assert (plan.mode, plan.named) == ("named", "get_weather")
    assert plan.schema() == WEATHER["function"]["parameters"]
    plan = tool_plan({"tools": [WEATHER, NOW], "tool_choice": {
        "type": "function", "function": {"name": "now"}}})
    assert plan.schema() == {"type": "object"}


def test_required_is_an_array_of_calls():
    schema = tool_plan({"tools": [WEATHER, NOW], "tool_choice": "required"}).schema()
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]]
    assert names == ["get_weather", "now"]
    assert schema["items"]["anyOf"][0]["properties"]["arguments"] == \
        WEATHER["function"]["parameters"]
    single = tool_plan({"tools": [WEATHER], "tool_choice": "required",
                        "parallel_tool_calls": False}).schema()
    assert single["maxItems"] == 1 and single["items"]["properties"]["name"] == {
        "const": "get_weather"}


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_requests_name_the_field(body, param):
    with pytest.raises(InvalidRequestError) as info:
        tool_plan(body)
    assert info.value.param == param
