"""Speculative decoding (prompt lookup) on the real engine with a tiny random Llama.

A random model does not quote its prompt, so the tests narrow its choice with logit_bias to a
few tokens: it still picks among them by context, its outputs repeat, and prompt lookup's
proposals are sometimes kept and sometimes rejected, which is what the tests need to cover.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tests.devices import DEVICES, exact
from tests.workers.lora.helpers import ALL_MODULES, make_peft_adapter
from workers import LLM, SamplingParams
from workers.engine.sampling_params import InvalidRequestError

CPU32 = exact("cpu")
ALPHABET = [1000, 2000, 3000, 4000]
NGRAM = {"method": "ngram", "num_tokens": 4}


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        motif = [rng.choice(ALPHABET) for _ in range(rng.randint(3, 8))]
        out.append([rng.randrange(100, 40000) for _ in range(rng.randint(2, 20))] + motif * 3)
    return out


def params(**overrides) -> SamplingParams:
    settings = dict(temperature=0.0, max_tokens=48, ignore_eos=True,
                    logit_bias={t: 100.0 for t in ALPHABET})
    return SamplingParams(**(settings | overrides))


def run(path, batch, sampling, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), **(CPU32 | {"kv_cache_memory": 8 << 20} | kwargs))
    outputs = llm.generate(batch, sampling)
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks  # nothing leaked, rollbacks included
    return [o.token_ids for o in outputs], llm


REGIMES = {
    "plain": {},
    "chunked_prefill": {"max_num_batched_tokens": 7},
    "preemption": {"block_size": 16, "kv_cache_memory": 10 * 16 * 2 * 3 * 2 * 16 * 4},
    "torch_attention": {"attention_backend": "torch"},
    "no_prefix_cache": {"enable_prefix_caching": False},
}


@pytest.fixture(scope="module")
def expected(tiny_llama_path) -> list[list[int]]:
    """Plain greedy tokens of prompts(10): the same in every regime (test_llm_tiny.py)."""
    return run(tiny_llama_path, prompts(10), params())[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("regime", REGIMES)
def test_greedy_tokens_are_identical_with_proposals_kept_and_rejected(
        tiny_llama_path, expected, regime, device):
    """On CUDA too (float32, so the CPU's plain tokens are the reference): proposals are
    scored by the Triton kernel (or the torch path) in the same flattened batch."""
    batch = prompts(10)
    got, llm = run(tiny_llama_path, batch, params(), speculative=NGRAM, **exact(device),
                   **REGIMES[regime])
    assert got == expected
    stats = llm.engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    assert stats["spec_position_1_proposed"] >= stats["spec_position_4_proposed"] > 0
    if regime == "preemption":
        assert stats["num_preemptions"] > 0


def test_repeated_prompts_reuse_the_prefix_cache_and_keep_identical_output(tiny_llama_path):
    batch = prompts(4)
    expected, _ = run(tiny_llama_path, batch, params())
    llm = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20, speculative=NGRAM, **CPU32)
    for _ in range(2):  # the second round starts from the blocks the first one named
        assert [o.token_ids for o in llm.generate(batch, params())] == expected
    assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0
    assert llm.engine.stats()["spec_accepted_tokens"] > 0


def test_stop_tokens_and_max_tokens_end_inside_a_kept_run(tiny_llama_path):
    batch = prompts(8, seed=3)
    for sampling in (params(max_tokens=7), params(stop_token_ids=[ALPHABET[0]], max_tokens=40)):
        expected, _ = run(tiny_llama_path, batch, sampling)
        got, _ = run(tiny_llama_path, batch, sampling, speculative=NGRAM)
        assert got == expected


def test_logprobs_match_the_plain_path(tiny_llama_path):
    batch = prompts(3, seed=5)
    sampling = params(logprobs=2, max_tokens=20)
    plain = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20, **CPU32).generate(batch, sampling)
    spec = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20, speculative=NGRAM,
               **CPU32).generate(batch, sampling)
    for a, b in zip(plain, spec, strict=True):
        assert a.token_ids == b.token_ids
        got = b.outputs[0].logprobs
        want = a.outputs[0].logprobs
        assert [lp.token_id for lp in got] == [lp.token_id for lp in want]
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want],
                                                           abs=1e-4)
        assert [[t for t, _ in lp.top] for lp in got] == [[t for t, _ in lp.top] for lp in want]


def test_lora_rows_speculate_with_their_own_adapter(tmp_path, tiny_llama_path, draft_path):
    """Prompt lookup, and a draft model proposing from the base weights: the adapted target
    verifies, so each row's tokens are its adapter's."""
    adapters = [make_peft_adapter(tiny_llama_path, tmp_path / f"a{i}", seed=i, r=8,
                                  target_modules=ALL_MODULES) for i in range(2)]
    batch = prompts(6, seed=11)
    names = [None, "a0", "a1"] * 2
    outputs = {}
    for name, spec in (("plain", None), ("ngram", NGRAM), ("draft", draft(draft_path))):
        llm = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20, enable_lora=True, max_loras=2,
                  speculative=spec, **CPU32)
        for i, adapter in enumerate(adapters):
            llm.add_lora(f"a{i}", str(adapter))
        outputs[name] = [o.token_ids for o in llm.generate(batch, params(), lora=names)]
        if spec:
            assert llm.engine.stats()["spec_accepted_tokens"] > 0
    assert outputs["ngram"] == outputs["plain"] == outputs["draft"]


def test_a_request_can_lower_k_or_turn_it_off_but_not_raise_it(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20, speculative=NGRAM, **CPU32)
    batch = prompts(4, seed=2)
    llm.generate(batch, params(speculative_tokens=0))
    assert llm.engine.stats()["spec_proposed_tokens"] == 0
    llm.generate(batch, params(speculative_tokens=2))
    stats = llm.engine.stats()
    assert stats["spec_proposed_tokens"] > 0 and "spec_position_3_proposed" not in stats
    with pytest.raises(InvalidRequestError, match="speculative_tokens"):
        llm.generate(batch, params(speculative_tokens=5))
    plain = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20, **CPU32)
    with pytest.raises(InvalidRequestError, match="off"):
        plain.generate(batch, params(speculative_tokens=1))


def test_no_proposals_above_max_batch(tiny_llama_path):
    batch = prompts(12, seed=4)  # all twelve decode side by side from the first step to the end
    for max_batch, proposes in ((11, False), (12, True)):
        _, llm = run(tiny_llama_path, batch, params(max_tokens=12),
                     speculative=NGRAM | {"max_batch": max_batch})
        assert (llm.engine.stats()["spec_proposed_tokens"] > 0) is proposes


def chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic over the categories seen, and its degrees of freedom."""
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    keys = set(a) | set(b)
    for key in keys:
        total = a[key] + b[key]
        ea, eb = total * na / (na + nb), total * nb / (na + nb)
        stat += (a[key] - ea) ** 2 / ea + (b[key] - eb) ** 2 / eb
    return stat, len(keys) - 1


# chi-square critical values at p = 0.001 by degrees of freedom (a 1-in-1000 false alarm)
CRITICAL_0_001 = {d: c for d, c in zip(range(1, 64), [
    10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53,
    36.12, 37.70, 39.25, 40.79, 42.31, 43.82, 45.31, 46.80, 48.27, 49.73, 51.18, 52.62, 54.05,
    55.48, 56.89, 58.30, 59.70, 61.10, 62.49, 63.87, 65.25, 66.62, 67.99, 69.35, 70.70, 72.05,
    73.40, 74.74, 76.08, 77.42, 78.75, 80.08, 81.40, 82.72, 84.04, 85.35, 86.66, 87.97, 89.27,
    90.57, 91.87, 93.17, 94.46, 95.75, 97.04, 98.32, 99.61, 100.89, 102.17, 103.44], strict=True)}


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory, tokenizer):
    """A smaller random Llama of the same vocabulary: one layer, narrower."""
    from tests.conftest import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), tokenizer, hidden_size=32,
                            intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1)


def draft(path, k: int = 3) -> dict:
    return {"method": "draft", "draft_model": str(path), "num_tokens": k}


@pytest.mark.parametrize("regime", ["plain", "chunked_prefill", "preemption"])
def test_a_draft_model_keeps_greedy_output_identical(tiny_llama_path, draft_path, expected,
                                                     regime):
    got, llm = run(tiny_llama_path, prompts(10), params(), speculative=draft(draft_path),
                   **REGIMES[regime])
    assert got == expected
    stats = llm.engine.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]


def test_the_model_as_its_own_draft_keeps_every_proposal(tiny_llama_path, expected):
    got, llm = run(tiny_llama_path, prompts(10), params(), speculative=draft(tiny_llama_path))
    assert got == expected
    stats = llm.engine.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0


def test_a_draft_of_another_vocabulary_is_refused(tmp_path, tiny_llama_path, tokenizer):
    from tests.conftest import build_tiny_llama

    other = build_tiny_llama(tmp_path / "other", tokenizer, vocab_size=1000)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(str(tiny_llama_path), kv_cache_memory=8 << 20, speculative=draft(other), **CPU32)


SAMPLED_PROMPT = [500, 600] + [ALPHABET[0], ALPHABET[1], ALPHABET[2]] * 4
SAMPLED_COUNT = 800


def sampled_histogram(path, speculative: dict | None) -> tuple[Counter, dict]:
    """Whole 4-token outputs of SAMPLED_COUNT seeded requests from one prompt."""
    sampling = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=i,
                               logit_bias={t: 100.0 for t in ALPHABET[:3]}, detokenize=False)
                for i in range(SAMPLED_COUNT)]
    llm = LLM(str(path), kv_cache_memory=16 << 20, max_num_seqs=256, speculative=speculative,
              **CPU32)
    outs = llm.generate([SAMPLED_PROMPT] * SAMPLED_COUNT, sampling)
    return Counter(tuple(o.token_ids) for o in outs), llm.engine.stats()


@pytest.fixture(scope="module")
def plain_histogram(tiny_llama_path) -> Counter:
    return sampled_histogram(tiny_llama_path, None)[0]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_outputs_follow_the_target_distribution(tiny_llama_path, draft_path,
                                                        plain_histogram, method):
    """Histograms of whole outputs, speculative against plain sampling, from the same prompt:
    the rejection rule must leave the distribution unchanged, whoever proposes."""
    config = NGRAM if method == "ngram" else draft(draft_path)
    hist, stats = sampled_histogram(tiny_llama_path, config | {"max_batch": 256})
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    stat, dof = chi_square(hist, plain_histogram)
    assert dof >= 8  # the outputs vary: the test has something to compare
    assert stat < CRITICAL_0_001[min(dof, 63)]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_grammar_rows_speculate_and_keep_identical_output(tiny_llama_path, draft_path,
                                                          tokenizer, method):
    """Under a grammar each position is masked as if the proposals before it were kept; the
    matcher reads ahead and is rolled back, so the output is the plain path's, and it still
    matches the grammar."""
    import re

    from workers.engine.structured import StructuredOutputs

    pattern = r"(cat |dog |bird ){3,30}\."
    prompt = tokenizer.encode("cat dog bird cat dog bird cat dog bird", add_special_tokens=False)
    batch = [prompt, prompt[2:], prompt[:5]]
    sampling = SamplingParams(temperature=0.0, max_tokens=60,
                              structured=StructuredOutputs(regex=pattern))
    config = NGRAM if method == "ngram" else draft(draft_path)
    plain = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20, **CPU32).generate(batch, sampling)
    llm = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20, speculative=config, **CPU32)
    spec = llm.generate(batch, sampling)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(re.fullmatch(pattern, o.text) for o in spec)
    stats = llm.engine.stats()
    assert stats["spec_proposed_tokens"] > 0
    if method == "ngram":  # the grammar narrows the choice: the output repeats its words
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
