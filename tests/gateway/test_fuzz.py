"""Fuzzed request bodies never get a 5xx, and every refusal is in OpenAI's error shape.

Hypothesis drives /v1/chat/completions and /v1/completions of one in-process gateway that
serves a mock provider (`mock-model`) and an embedded tiny Llama (`tiny`, context capped so
that a lucky huge max_tokens stays cheap). The app lives on an event loop in a background
thread for the whole module; the sync hypothesis tests hand requests to it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Iterator
from contextlib import AsyncExitStack
from typing import Any, TypeVar

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenancy.migrate import upgrade
from tests.conftest import build_tiny_llama
from tests.gateway import support
from workers.async_engine import AsyncLLMEngine

T = TypeVar("T")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
MODELS = ("mock-model", "tiny")
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CHAT_MESSAGES = [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
                 {"role": "assistant", "content": "Hi", "name": "bot"},
                 {"role": "user", "content": "Again"}]


class LoopThread:
    """An event loop running in a daemon thread; `run` executes a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> LoopThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


class Gateway:
    """The in-process app, driven synchronously from hypothesis examples."""

    def __init__(self, loop: LoopThread, client: httpx.AsyncClient, key: str) -> None:
        self._loop = loop
        self._client = client
        self._auth = support.bearer(key)

    def post(self, path: str, content: bytes, content_type: str | None = "application/json"
             ) -> httpx.Response:
        headers = dict(self._auth)
        if content_type is not None:
            headers["content-type"] = content_type
        return self._loop.run(self._client.post(path, content=content, headers=headers))


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, tokenizer, mock_upstream) -> Iterator[Gateway]:
    tmp_path = tmp_path_factory.mktemp("fuzz")
    model = build_tiny_llama(tmp_path / "tiny", tokenizer, max_position_embeddings=128)
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'fuzz.db'}"
    upgrade(db_url)
    cfg = support.settings(db_url, tmp_path, embedded={"name": "tiny"},
                           deployments_file=support.write_deployments(
                               tmp_path, [support.mock_deployment(mock_upstream.base_url)]))
    with LoopThread() as loop:
        tenant = loop.run(support.seed_tenant(db_url, tmp_path, name="fuzzer"))
        engine = AsyncLLMEngine(str(model), device="cpu", kv_cache_memory=16 << 20,
                                max_num_seqs=16)
        stack = AsyncExitStack()
        client = loop.run(stack.enter_async_context(support.gateway_client(cfg, engine=engine)))
        try:
            yield Gateway(loop, client, tenant.key)
        finally:
            loop.run(stack.aclose())


def check(response: httpx.Response) -> None:
    """The property: no 5xx; a request id always; an OpenAI-shaped error on every non-2xx.

    Successes are checked too: a stream must run to its end, a plain answer must have choices.
    """
    assert response.status_code < 500, response.text
    assert response.headers.get("x-request-id")
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]
        else:
            assert response.json()["choices"], response.text
    if response.status_code >= 300:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)
        assert error["param"] is None or isinstance(error["param"], str)
        assert error["code"] is None or isinstance(error["code"], str)


# --- strategies ---------------------------------------------------------------------------

surrogates = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
texts = st.text(st.characters() | surrogates, max_size=40)  # lone surrogates become \ud8xx
extreme_ints = st.sampled_from([0, -1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1,
                                2**64, 10**100, -(10**400)])
scalars = (st.none() | st.booleans() | st.integers() | extreme_ints | texts
           | st.floats(allow_nan=False, allow_infinity=False))
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(texts, inner, max_size=5),
    max_leaves=20,
)
# Token-id prompts: in and out of the vocabulary, negative, beyond 64 bits.
token_ids = st.lists(st.integers(min_value=-2, max_value=60_000) | extreme_ints, max_size=8)


def encode(value: Any) -> bytes:
    return json.dumps(value).encode()


def valid_chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": CHAT_MESSAGES, "max_tokens": 3,
            "max_completion_tokens": 3, "temperature": 0.7, "top_p": 0.9, "n": 2,
            "stop": ["\n\n"], "seed": 7, "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "logprobs": True, "top_logprobs": 2, "user": "u-1", "stream": False,
            "stream_options": {"include_usage": True}}


def valid_completion(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0,
            "top_p": 1, "n": 1, "stop": "\n", "seed": 1, "logprobs": 2, "user": "u-2",
            "stream": True, "stream_options": {"include_usage": True}}


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every location inside a JSON value (dict keys and list indexes), outermost first."""
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += paths(item, (*prefix, index))
    return found


def replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    """A copy of `value` with the item at `path` replaced by `new`."""
    if not path:
        return new
    head, *rest = path
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[head] = replaced(value[head], tuple(rest), new)
    return copy


@st.composite
def nearly_valid(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid body for the endpoint with one thing broken: a value, a new key, a lost key."""
    path = draw(st.sampled_from(ENDPOINTS))
    make = valid_chat if path == ENDPOINTS[0] else valid_completion
    body = make(draw(st.sampled_from(MODELS)))
    mutation = draw(st.sampled_from(["replace", "replace", "add", "drop"]))
    if mutation == "replace":
        body = replaced(body, draw(st.sampled_from(paths(body))), draw(json_values | token_ids))
    elif mutation == "add":
        body[draw(texts)] = draw(json_values)
    else:
        del body[draw(st.sampled_from(sorted(body)))]
    return path, encode(body)


@st.composite
def invalid_utf8_inside_json(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid body whose prompt or message text carries raw, possibly invalid, bytes."""
    path = draw(st.sampled_from(ENDPOINTS))
    model = draw(st.sampled_from(MODELS)).encode()
    raw = draw(st.binary(min_size=1, max_size=30)).replace(b'"', b"").replace(b"\\", b"")
    if path == ENDPOINTS[0]:
        body = (b'{"model": "' + model + b'", "max_tokens": 2, "messages": [{"role": "user", '
                b'"content": "' + raw + b'"}]}')
    else:
        body = b'{"model": "' + model + b'", "max_tokens": 2, "prompt": "' + raw + b'"}'
    return path, body


# --- properties ---------------------------------------------------------------------------


def test_arbitrary_json_bodies(gateway):
    @FUZZ
    @given(path=st.sampled_from(ENDPOINTS), value=json_values)
    def run(path: str, value: Any) -> None:
        check(gateway.post(path, encode(value)))

    run()


def test_nearly_valid_bodies(gateway):
    @FUZZ
    @given(case=nearly_valid())
    def run(case: tuple[str, bytes]) -> None:
        check(gateway.post(*case))

    run()


def test_random_bytes(gateway):
    @FUZZ
    @given(path=st.sampled_from(ENDPOINTS), raw=st.binary(max_size=300))
    def run(path: str, raw: bytes) -> None:
        check(gateway.post(path, raw))

    run()


def test_invalid_utf8_inside_json(gateway):
    @FUZZ
    @given(case=invalid_utf8_inside_json())
    def run(case: tuple[str, bytes]) -> None:
        check(gateway.post(*case))

    run()


def test_wrong_content_types(gateway):
    content_types = st.none() | st.sampled_from([
        "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
        "application/json; charset=latin-1", "application/octet-stream", "",
    ]) | st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
    bodies = st.sampled_from([
        encode(valid_chat("mock-model")), encode(valid_completion("mock-model")),
        b"model=mock-model&prompt=hi", b"--x\r\nContent-Disposition: form-data\r\n\r\nhi\r\n--x--",
    ])

    @FUZZ
    @given(path=st.sampled_from(ENDPOINTS), body=bodies, content_type=content_types)
    def run(path: str, body: bytes, content_type: str | None) -> None:
        check(gateway.post(path, body, content_type))

    run()


def test_valid_bodies_succeed(gateway):
    """The generators' starting points are really valid, so mutations test one break each."""
    for model in MODELS:
        for path, body in ((ENDPOINTS[0], valid_chat(model)),
                           (ENDPOINTS[1], valid_completion(model))):
            response = gateway.post(path, encode(body))
            check(response)
            assert response.status_code == 200, response.text
