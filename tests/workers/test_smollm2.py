"""The bundled SmolLM2-135M-Instruct: the engine's greedy chat output equals HF generate()."""

from __future__ import annotations

import pytest

from tests.workers.hf_reference import hf_greedy, hf_model
from workers import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three fruits.",
    "What is 12 times 7?",
    "Tell me a joke about cats.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
    "What is photosynthesis?",
    "Name the planets of the solar system.",
    "Give me a tip for better sleep.",
    "What does a CPU do?",
    "Why is the sky blue?",
    "Summarize the story of Cinderella in one sentence.",
    "What is the boiling point of water?",
    "Suggest a name for a pet turtle.",
    "How many legs does a spider have?",
    "What is a prime number?",
    "Write one sentence about autumn.",
    "What is Python used for?",
    "Describe a rainbow.",
    "Who wrote Romeo and Juliet?",
]
MAX_NEW = 32


@pytest.mark.slow
def test_chat_prompts_token_identical_to_hf(smollm2_path, tokenizer):
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    llm = LLM(None, kv_cache_memory=256 << 20, max_num_batched_tokens=256)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    model = hf_model(smollm2_path)
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    mismatches = [
        (QUESTIONS[i], out.token_ids, exp)
        for i, (out, exp) in enumerate(zip(outputs, expected, strict=True))
        if out.token_ids != exp
    ]
    assert not mismatches
    texts = [o.text for o in outputs]
    assert "Paris" in texts[0]
    assert all(t.strip() for t in texts)


@pytest.mark.slow
def test_chat_helper_applies_the_template(smollm2_path):
    llm = LLM(None, kv_cache_memory=64 << 20)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == llm.tokenizer.eos_token_id
