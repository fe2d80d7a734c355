"""The Hermes tool-call parser: the same calls and content however the text is split."""

from __future__ import annotations

import json
import random

import pytest

from tests.workers.tools.helpers import run_parser
from workers.tools.hermes import HermesParser, ParsedCall

TEXT = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>')
CALLS = [ParsedCall("get_weather", json.dumps({"city": "Paris"})),
         ParsedCall("get_time", json.dumps({"tz": "CET"}))]


def run(pieces):
    return run_parser(HermesParser(), pieces)


def test_whole_text():
    content, calls = run([TEXT])
    assert content == "Let me check.\n"
    assert calls == CALLS


@pytest.mark.parametrize("seed", range(20))
def test_any_split_gives_the_same_result(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randint(1, 30)))
    pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)], strict=True)]
    assert run(pieces) == run([TEXT])


def test_one_character_at_a_time_never_shows_a_tag_fragment():
    parser = HermesParser()
    shown = ""
    for ch in TEXT:
        shown += parser.feed(ch).content
        assert "<" not in shown
    assert shown + parser.finish().content == "Let me check.\n"


def test_text_that_only_looks_like_a_tag_is_content():
    assert run(["a <tool", " b < c"]) == ("a <tool b < c", [])
    assert run(["ends with <tool_c"]) == ("ends with <tool_c", [])


def test_a_block_that_is_not_a_call_stays_content():
    text = "<tool_call>not json</tool_call> and <tool_call>[1, 2]</tool_call>"
    assert run([text]) == (text, [])


def test_an_unclosed_call_at_the_end_is_still_a_call():
    content, calls = run(['<tool_call>{"name": "f", "arguments": {}}'])
    assert (content, calls) == ("", [ParsedCall("f", "{}")])
    assert run(['<tool_call>{"name": "f", "argu']) == ('<tool_call>{"name": "f", "argu', [])


def test_arguments_given_as_a_string_or_as_parameters():
    assert run(['<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'])[1] == [
        ParsedCall("f", '{"a": 1}')]
    assert run(['<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>'])[1] == [
        ParsedCall("f", '{"a": 1}')]
    assert run(['<tool_call>{"name": "f", "arguments": "{bad"}</tool_call>'])[1] == []
