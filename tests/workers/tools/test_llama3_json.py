"""Llama 3.x JSON tool calls, and choosing a parser by name."""

from __future__ import annotations

import json

import pytest

from tests.workers.tools.helpers import run_parser
from workers.tools.hermes import ParsedCall
from workers.tools.llama3_json import Llama3JsonParser
from workers.tools.parsers import make_parser


def run(pieces):
    return run_parser(Llama3JsonParser(), pieces)


def test_one_and_several_calls_however_split():
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "now", "parameters": {}}')
    expected = ("", [ParsedCall("get_weather", json.dumps({"city": "Paris"})),
                     ParsedCall("now", "{}")])
    assert run([text]) == expected
    assert run(list(text)) == expected  # one character at a time
    assert run(['  {"name": "now", "arguments": {}}']) == ("", [ParsedCall("now", "{}")])


def test_prose_is_content_from_its_first_character():
    parser = Llama3JsonParser()
    assert parser.feed("The weather").content == "The weather"
    assert parser.feed(' is {"fine"}').content == ' is {"fine"}'
    assert parser.finish().content == ""


def test_json_that_is_not_a_call_is_content_unchanged():
    assert run(['{"answer": 42}']) == ('{"answer": 42}', [])
    assert run(['{"name": "f", "parameters": {}} trailing']) == (
        '{"name": "f", "parameters": {}} trailing', [])


def test_parsers_by_name():
    assert isinstance(make_parser("llama3_json"), Llama3JsonParser)
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        make_parser("mistral")
