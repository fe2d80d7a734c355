"""Prefix caching on the real engine (tiny random Llama): hits give the same tokens as misses."""

from __future__ import annotations

import random

from workers import LLM, SamplingParams


def shared_prefix_prompts(count: int, prefix_len: int = 70, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 1000) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 20))]
            for _ in range(count)]


def run(llm: LLM, prompts: list[list[int]], salts: list[str | None]) -> dict[str, tuple]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    done: dict[str, tuple] = {}
    for i, (prompt, salt) in enumerate(zip(prompts, salts, strict=True)):
        llm.engine.add_request(f"r{i}", prompt, params, cache_salt=salt)
        # One at a time, so each later request can hit what the earlier ones computed.
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                if out.finished:
                    done[out.request_id] = (tuple(out.token_ids), out.num_cached_tokens)
    return done


def test_hits_match_misses_and_blocks_return(tiny_llama_path):
    prompts = shared_prefix_prompts(6)
    cold = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20, enable_prefix_caching=False)
    warm = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20)
    misses = run(cold, prompts, [None] * 6)
    hits = run(warm, prompts, [None] * 6)
    assert [hits[k][0] for k in sorted(hits)] == [misses[k][0] for k in sorted(misses)]
    assert [misses[k][1] for k in sorted(misses)] == [0] * 6
    cached = [hits[f"r{i}"][1] for i in range(6)]
    assert cached[0] == 0 and all(c >= 64 for c in cached[1:])  # four 16-token blocks
    bm = warm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert warm.engine.stats()["prefix_cache_hit_rate"] > 0.5


def test_salts_never_share(tiny_llama_path):
    prompts = shared_prefix_prompts(4, seed=1)
    llm = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20)
    out = run(llm, prompts, ["tenant-a", "tenant-b", "tenant-a", "tenant-b"])
    assert [out[f"r{i}"][1] for i in range(4)] == [0, 0, 64, 64]


def test_batched_hits_with_preemption_match(tiny_llama_path):
    """Many requests at once on a small pool: sharing, eviction and recompute together."""
    prompts = shared_prefix_prompts(12, prefix_len=40, seed=2)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    cold = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20, enable_prefix_caching=False)
    block_bytes = 16 * 2 * 3 * 2 * 16 * 4  # tokens x (K, V) x layers x kv heads x dim x fp32
    small = LLM(str(tiny_llama_path), kv_cache_memory=12 * block_bytes,
                max_num_batched_tokens=48)
    assert small.engine.block_manager.num_blocks == 12
    expected = [o.token_ids for o in cold.generate(prompts, params)]
    assert [o.token_ids for o in small.generate(prompts, params)] == expected
    assert [o.token_ids for o in small.generate(prompts, params)] == expected  # warm now
    bm = small.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.stats()["prefix_cache_hit_rate"] > 0


def test_stats_report_the_kv_working_set_for_routing(tiny_llama_path):
    """`kv_hot_tokens`: the cached blocks finished requests let go of within
    `prefix_hot_window_s`; `kv_capacity_tokens`: the whole pool."""
    prompts = [list(range(3 + 100 * i, 43 + 100 * i)) for i in range(2)]  # nothing shared
    hot = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20)
    cold = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20, prefix_hot_window_s=0.0)
    for llm in (hot, cold):
        run(llm, prompts, [None, None])
    bm = hot.engine.block_manager
    assert hot.engine.stats()["kv_capacity_tokens"] == bm.num_blocks * 16
    # 40 prompt + 12 output tokens: 51 computed, three full blocks named per request
    assert hot.engine.stats()["kv_hot_tokens"] == 2 * 3 * 16
    assert cold.engine.stats()["kv_hot_tokens"] == 0
    no_cache = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20, enable_prefix_caching=False)
    assert "kv_hot_tokens" not in no_cache.engine.stats()
