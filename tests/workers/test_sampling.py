"""Sampling features end to end on a tiny Llama: seeds, n > 1, logprobs, stops, penalties."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.workers.hf_reference import hf_model
from tests.workers.test_llm_tiny import random_prompts
from workers import LLM, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(str(tiny_llama_path), kv_cache_memory=16 << 20, max_num_batched_tokens=256,
               max_num_seqs=32)


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(llm):
    prompt = random_prompts(1, seed=5)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20,
                            ignore_eos=True)
    alone = llm.generate([prompt], params)[0].token_ids
    busy_prompts = random_prompts(15, seed=6)
    noise = SamplingParams(temperature=1.2, max_tokens=30, ignore_eos=True)
    outputs = llm.generate([*busy_prompts[:7], prompt, *busy_prompts[7:]],
                           [noise] * 7 + [params] + [noise] * 8)
    assert outputs[7].token_ids == alone
    other_seed = llm.generate([prompt], dataclasses.replace(params, seed=99))
    assert other_seed[0].token_ids != alone


def test_unseeded_sampling_varies_and_temperature_zero_is_greedy(llm):
    prompt = random_prompts(1, seed=8)[0]
    hot = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    runs = {tuple(o.token_ids) for o in llm.generate([prompt] * 4, hot)}
    assert len(runs) > 1
    cold = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert len({tuple(o.token_ids) for o in llm.generate([prompt] * 3, cold)}) == 1


def test_top_k_one_equals_greedy(llm):
    prompt = random_prompts(1, seed=9)[0]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                   ignore_eos=True))[0]
    top1 = llm.generate([prompt], SamplingParams(temperature=0.8, top_k=1, max_tokens=12,
                                                 ignore_eos=True))[0]
    assert top1.token_ids == greedy.token_ids


def test_n_samples_share_prompt_blocks_and_differ(llm):
    prompt = random_prompts(1, seed=10, lo=40, hi=40)[0]  # 40 tokens: 2.5 blocks
    engine = llm.engine
    free_before = engine.block_manager.num_free_blocks
    engine.add_request("fork", prompt, SamplingParams(n=4, temperature=1.0, seed=7,
                                                      max_tokens=8, ignore_eos=True))
    engine.step()  # prefill + 4 first tokens
    # 3 prompt blocks; the 4 samples share them until their first write
    assert engine.block_manager.num_free_blocks == free_before - 3
    first = next(iter(engine._seqs.values()))
    assert engine.block_manager.ref_counts[first.block_table[0]] == 4
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and len(final.outputs) == 4
    assert [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1
    assert engine.block_manager.num_free_blocks == free_before


def test_logprobs_match_hf_log_softmax(llm, tiny_llama_path):
    prompt = random_prompts(1, seed=12)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                ignore_eos=True))[0]
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == 5
    model = hf_model(tiny_llama_path)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    for i, lp in enumerate(lps):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == out.token_ids[i]
        assert math.isclose(lp.logprob, row[lp.token_id].item(), abs_tol=1e-4)
        top_ids = row.topk(3).indices.tolist()
        assert [t for t, _ in lp.top] == top_ids
        assert lp.top[0][0] == lp.token_id  # greedy picks the top token


def test_max_tokens_and_stop_token_ids(llm):
    prompt = random_prompts(1, seed=13)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10,
                                                 ignore_eos=True))[0]
    assert len(free.token_ids) == 10 and free.finish_reason == "length"
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10,
                                                    stop_token_ids=[stop_id]))[0]
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == stop_id


def test_stop_string_truncates_text_and_ends_request(llm, tokenizer):
    prompt = random_prompts(1, seed=14)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20,
                                                 ignore_eos=True))[0]
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=[stop],
                                                ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text
    assert len(out.token_ids) < 20


def test_min_p_and_top_p_restrict_to_likely_tokens(llm):
    prompt = random_prompts(1, seed=16)[0]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                   ignore_eos=True))[0].token_ids
    tight = SamplingParams(temperature=1.0, min_p=1.0, max_tokens=8, ignore_eos=True, seed=3)
    assert llm.generate([prompt], tight)[0].token_ids == greedy
    nucleus = SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8, ignore_eos=True)
    assert llm.generate([prompt], nucleus)[0].token_ids == greedy


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -1}, {"top_p": 0}, {"n": 0}, {"max_tokens": 0}, {"logprobs": 50},
     {"presence_penalty": 3}, {"min_tokens": 5, "max_tokens": 2}],
)
def test_invalid_sampling_params_are_refused(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_prompts_that_cannot_fit_are_refused(llm):
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        engine.add_request("long", [5] * engine.max_model_len, SamplingParams())
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        engine.add_request("long2", [5] * 10, SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("oob", [10**9], SamplingParams())
    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        engine.add_request("wide", [5, 6], SamplingParams(n=engine.args.max_num_seqs + 1))
    with pytest.raises(InvalidRequestError):  # one bad prompt: nothing of the batch is queued
        llm.generate([[5, 6, 7], []], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()
