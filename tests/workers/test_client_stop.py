"""Stop strings matched in the client's output processor, outside the engine step, give the
same answers as the engine's own matching (the offline `LLM`): the same text, finish reason
and token count, a stop string that spans tokens included, and with n=2 a sample that stops
early is ended in the engine while its sibling runs on."""

from __future__ import annotations

import pytest

from tests.workers.test_llm_tiny import random_prompts
from workers import LLM, AsyncLLMEngine, LLMEngine, SamplingParams
from workers.client import EmbeddedClient

PROMPTS = random_prompts(4, seed=31, lo=8, hi=24)


@pytest.fixture(scope="module")
def offline(tiny_llama_path):
    return LLM(str(tiny_llama_path), kv_cache_memory=8 << 20)


@pytest.fixture
async def client(tiny_llama_path):
    engine = AsyncLLMEngine.from_engine(
        LLMEngine.from_args(model=str(tiny_llama_path), kv_cache_memory=8 << 20))
    await engine.start()
    yield EmbeddedClient(engine, "tiny")
    await engine.shutdown()


def stops_in(text: str) -> list[str]:
    """Stop strings that occur in `text`: a short one early, one spanning the middle."""
    middle = len(text) // 2
    return [text[3:5], text[middle - 2:middle + 3]]


async def test_stop_strings_end_answers_as_the_engine_would(client, offline):
    free = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24,
                                                     ignore_eos=True))
    for prompt, unstopped in zip(PROMPTS, free, strict=True):
        for stop in stops_in(unstopped.text):
            params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
            expected = offline.generate([prompt], params)[0]
            assert expected.finish_reason == "stop"
            call = client.prepare({"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                   "ignore_eos": True, "stop": [stop]}, chat=False)
            got = await client.complete(call, request_id=f"s-{len(stop)}-{prompt[0]}")
            choice = got["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == (expected.text, "stop")
            assert got["usage"]["completion_tokens"] == len(expected.token_ids)


async def test_a_sample_that_stops_early_is_ended_while_its_sibling_runs(client, offline):
    """n=2, seeded: each sample as the offline engine samples it; the engine frees the
    stopped sample's blocks at once and nothing is left behind."""
    body = {"prompt": PROMPTS[0], "max_tokens": 32, "temperature": 1.0, "seed": 7, "n": 2,
            "ignore_eos": True}
    free = offline.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=7, n=2,
                                                          max_tokens=32, ignore_eos=True))[0]
    first, second = (o.text for o in free.outputs)
    stop = next(first[i:i + 3] for i in range(2, len(first)) if first[i:i + 3] not in second)
    expected = offline.generate([PROMPTS[0]], SamplingParams(
        temperature=1.0, seed=7, n=2, max_tokens=32, ignore_eos=True, stop=[stop]))[0]
    stopped = []
    stop_sample = client.engine.stop_sample
    client.engine.stop_sample = lambda *a: (stopped.append(a), stop_sample(*a))
    got = await client.complete(client.prepare({**body, "stop": [stop]}, chat=False),
                                request_id="n2")
    assert stopped == [("n2", 0, stop)]  # the engine was told; sample 1 ran on
    texts = [(c["text"], c["finish_reason"]) for c in got["choices"]]
    assert texts == [(o.text, o.finish_reason) for o in expected.outputs]
    assert texts[0][1] == "stop"
    assert got["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in expected.outputs)
    core = client.engine.engine
    assert not core._requests  # the request ended and was cleaned up
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
