"""Cache keys change exactly when the answer could change."""

from __future__ import annotations

from typing import Any

import pytest

from caching.keys import (
    MAX_SEMANTIC_CHARS,
    OUTPUT_PARAMS,
    exact_key,
    is_deterministic,
    semantic_scope,
    semantic_text,
)

CHAT: dict[str, Any] = {
    "model": "small",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "temperature": 0,
    "max_tokens": 32,
}


def key(body: dict[str, Any], *, tenant: str = "t1", model_key: str = "m1",
        chat: bool = True) -> str:
    return exact_key(tenant_id=tenant, model_key=model_key, chat=chat, body=body)


def scope(body: dict[str, Any], *, tenant: str = "t1", model_key: str = "m1",
          chat: bool = True) -> str:
    return semantic_scope(tenant_id=tenant, model_key=model_key, chat=chat, body=body)


def with_(body: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**body, **changes}


CHANGED_VALUES: dict[str, Any] = {
    "temperature": 0.7, "top_p": 0.5, "top_k": 5, "min_p": 0.1, "n": 2, "stop": ["\n"],
    "seed": 7, "max_tokens": 64, "max_completion_tokens": 10, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "repetition_penalty": 1.1, "min_tokens": 3, "ignore_eos": True,
    "logprobs": True, "top_logprobs": 2,
}


def test_exact_key_is_sha256_hex() -> None:
    k = key(CHAT)
    assert len(k) == 64 and int(k, 16) >= 0
    assert key(CHAT) == k  # stable


@pytest.mark.parametrize("name", OUTPUT_PARAMS)
def test_every_output_param_changes_the_key(name: str) -> None:
    assert key(with_(CHAT, **{name: CHANGED_VALUES[name]})) != key(CHAT)


SHAPING = {"tools": [{"type": "function", "function": {"name": "f"}}],
           "response_format": {"type": "json_object"}, "logit_bias": {"50256": -100},
           "tool_choice": "required", "guided_json": {"type": "object"},
           "guided_regex": "[a-z]+", "structured_outputs": {"choice": ["a", "b"]},
           "parallel_tool_calls": False, "a_vendor_extra": {"mode": "x"}}


@pytest.mark.parametrize("field", sorted(SHAPING))
def test_fields_that_shape_the_answer_change_the_key(field: str) -> None:
    value = SHAPING[field]
    assert key(with_(CHAT, **{field: value})) != key(CHAT)


@pytest.mark.parametrize("changes", [
    {"stream": True},
    {"stream_options": {"include_usage": True}},
    {"user": "someone-else"},
    {"model": "another-alias"},
    {"metadata": {"trace": "x"}},
    {"safety_identifier": "end-user-7"},
    {"prompt_cache_key": "conversation-1"},
])
def test_delivery_fields_do_not_change_the_key(changes: dict[str, Any]) -> None:
    assert key(with_(CHAT, **changes)) == key(CHAT)


def test_tenant_model_and_endpoint_change_the_key() -> None:
    base = key(CHAT)
    assert key(CHAT, tenant="t2") != base
    assert key(CHAT, model_key="m2") != base
    assert key(CHAT, chat=False) != base


def test_spellings_of_the_same_request_share_a_key() -> None:
    reordered = {k: CHAT[k] for k in reversed(list(CHAT))}
    assert key(reordered) == key(CHAT)
    assert key(with_(CHAT, stop="END")) == key(with_(CHAT, stop=["END"]))
    assert key(with_(CHAT, temperature=0.0)) == key(CHAT)
    assert key(with_(CHAT, seed=None)) == key(CHAT)  # absent == None
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are "},
                                            {"type": "text", "text": "terse."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is the capital of "
                                                                  "France?"}]}]
    assert key(with_(CHAT, messages=parts)) == key(CHAT)


def test_messages_and_prompts_change_the_key() -> None:
    other = [CHAT["messages"][0], {"role": "user", "content": "What is the capital of Spain?"}]
    assert key(with_(CHAT, messages=other)) != key(CHAT)
    image = [CHAT["messages"][0], {"role": "user", "content": [
        {"type": "text", "text": "What is the capital of France?"},
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]
    assert key(with_(CHAT, messages=image)) != key(CHAT)
    completion = {"prompt": "Once upon a time", "max_tokens": 8}
    assert key(completion, chat=False) != key({**completion, "prompt": "Once upon a tide"},
                                              chat=False)
    assert key({"prompt": [1, 2, 3]}, chat=False) != key({"prompt": [1, 2, 4]}, chat=False)


@pytest.mark.parametrize(("body", "expected"), [
    ({"temperature": 0}, True),
    ({"temperature": 0.0}, True),
    ({"temperature": 0.2, "seed": 1}, True),
    ({"seed": 0}, True),
    ({"temperature": 0.2}, False),
    ({}, False),  # the default temperature samples
    ({"temperature": False}, False),
    ({"seed": None, "temperature": 1}, False),
])
def test_is_deterministic(body: dict[str, Any], expected: bool) -> None:
    assert is_deterministic(body) is expected


def test_scope_ignores_the_question_but_not_the_context() -> None:
    other_question = with_(CHAT, messages=[CHAT["messages"][0],
                                           {"role": "user", "content": "France's capital?"}])
    assert scope(other_question) == scope(CHAT)
    other_system = with_(CHAT, messages=[{"role": "system", "content": "You are verbose."},
                                         CHAT["messages"][1]])
    assert scope(other_system) != scope(CHAT)
    developer = with_(CHAT, messages=[{"role": "developer", "content": "You are terse."},
                                      CHAT["messages"][1]])
    assert scope(developer) != scope(CHAT)
    history = with_(CHAT, messages=[CHAT["messages"][0],
                                    {"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello!"},
                                    CHAT["messages"][1]])
    assert scope(history) != scope(CHAT)


@pytest.mark.parametrize("name", OUTPUT_PARAMS)
def test_scope_includes_every_output_param(name: str) -> None:
    assert scope(with_(CHAT, **{name: CHANGED_VALUES[name]})) != scope(CHAT)


def test_scope_includes_tenant_model_and_endpoint_and_skips_delivery_fields() -> None:
    base = scope(CHAT)
    assert scope(CHAT, tenant="t2") != base
    assert scope(CHAT, model_key="m2") != base
    assert scope(CHAT, chat=False) != base
    assert scope(with_(CHAT, stream=True, user="u", model="alias")) == base
    assert scope(CHAT) != key(CHAT)  # a scope is never an exact key


def test_semantic_text_is_the_last_user_message() -> None:
    body = with_(CHAT, messages=[*CHAT["messages"], {"role": "assistant", "content": "Paris."},
                                 {"role": "user", "content": "  And of Spain?  "}])
    assert semantic_text(chat=True, body=body) == "And of Spain?"
    parts = with_(CHAT, messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}])
    assert semantic_text(chat=True, body=parts) == "Hello there"


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "system", "content": "only a system prompt"}]},
    {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
    {"messages": [{"role": "user", "content": "   "}]},
    {"messages": [{"role": "user", "content": "x" * (MAX_SEMANTIC_CHARS + 1)}]},
    {},
])
def test_semantic_text_none_for_chat_without_a_comparable_question(body: dict[str, Any]) -> None:
    assert semantic_text(chat=True, body=body) is None


def test_semantic_text_for_completions() -> None:
    assert semantic_text(chat=False, body={"prompt": "Why is the sky blue?"}) == (
        "Why is the sky blue?")
    assert semantic_text(chat=False, body={"prompt": ["Why is the sky blue?"]}) == (
        "Why is the sky blue?")
    assert semantic_text(chat=False, body={"prompt": [1, 2, 3]}) is None
    assert semantic_text(chat=False, body={"prompt": ["a", "b"]}) is None


def test_a_variant_changes_the_key_and_scope_and_none_leaves_them_as_they_were() -> None:
    """Messages' anthropic-version and anthropic-beta (`variant`) can change a native
    upstream's answer: each is another entry; without one the key is the one it always was."""
    beta = {"anthropic-version": None, "anthropic-beta": ["prompt-caching-2024-07-31"]}
    version = {"anthropic-version": "2024-10-22", "anthropic-beta": []}

    def keyed(variant: dict[str, Any] | None) -> tuple[str, str]:
        return (exact_key(tenant_id="t1", model_key="m1", chat=True, body=CHAT,
                          variant=variant),
                semantic_scope(tenant_id="t1", model_key="m1", chat=True, body=CHAT,
                               variant=variant))

    plain = (key(CHAT), scope(CHAT))
    assert keyed(None) == keyed({}) == plain
    assert keyed(dict(beta)) == keyed(dict(beta))
    both = {"anthropic-version": "2024-10-22", "anthropic-beta": beta["anthropic-beta"]}
    seen = {plain, keyed(beta), keyed(version), keyed(both),
            keyed({**beta, "anthropic-beta": [*beta["anthropic-beta"], "other-beta"]})}
    assert len({k for k, _ in seen}) == len({s for _, s in seen}) == 5
