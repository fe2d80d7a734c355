"""Tools and tool messages in the prompt, through the model's template or the ChatML one."""

from __future__ import annotations

import pytest

from workers.engine.sampling_params import InvalidRequestError
from workers.tools.render import render_chat

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
]


def test_tools_are_shown_in_the_system_turn(tokenizer):
    text = render_chat(tokenizer, ROUND_TRIP[:2], tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call")
    assert '"name": "get_weather"' in text and "The weather in a city" in text
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                         "<|im_start|>assistant\n")


def test_a_tool_round_trip_renders_calls_and_responses(tokenizer):
    text = render_chat(tokenizer, ROUND_TRIP, tools=[WEATHER])
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>" in text


def test_plain_chats_keep_the_models_own_template(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    assert render_chat(tokenizer, messages, tools=None) == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_a_template_that_cannot_show_tools_refuses_them(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template",
                        "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")
    with pytest.raises(InvalidRequestError) as info:
        render_chat(tokenizer, ROUND_TRIP[:2], tools=[WEATHER])
    assert (info.value.param, info.value.code) == ("tools", "unsupported_parameter")


def test_images_are_refused_by_name(tokenizer):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(InvalidRequestError, match="does not support images") as info:
        render_chat(tokenizer, messages, tools=None)
    assert info.value.param == "messages.0.content"
