"""Multi-LoRA on the real engine (tiny random Llama, peft-made adapters).

The yardstick is peft's own PeftModel with HF greedy generate: every adapter's output must
equal it, alone, in a mixed batch, after eviction and reload, and while others hot-load.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from tests.devices import DEVICES, exact
from tests.workers.hf_reference import hf_greedy
from tests.workers.lora.helpers import ALL_MODULES, make_peft_adapter, peft_model
from workers import LLM, SamplingParams
from workers.async_engine import AsyncLLMEngine
from workers.engine.sampling_params import InvalidRequestError
from workers.lora.adapter import AdapterError
from workers.lora.manager import AdapterBusyError, UnknownAdapterError

MAX_TOKENS = 12
SPECS = [
    dict(r=4, target_modules=ALL_MODULES),
    dict(r=8, target_modules=["q_proj", "v_proj"]),
    dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    dict(r=8, use_rslora=True, target_modules=["k_proj", "o_proj"]),
    dict(r=16, target_modules=ALL_MODULES),
    dict(r=2, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj"]),
    dict(r=12, target_modules=["up_proj", "o_proj"]),
    dict(r=8, lora_alpha=4, use_rslora=True, target_modules=ALL_MODULES),
]
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(rng.randrange(4, 30))] for _ in range(count)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_path) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [make_peft_adapter(tiny_llama_path, root / f"a{i}", seed=i, **spec)
            for i, spec in enumerate(SPECS)]


@pytest.fixture(scope="module")
def reference(tiny_llama_path, adapters) -> dict[tuple[str | None, int], list[int]]:
    """(adapter name or None, prompt index) -> peft greedy tokens, for prompts(3, seed=7)."""
    from tests.workers.hf_reference import hf_model

    refs = {}
    models = {None: hf_model(tiny_llama_path)}
    models.update({f"a{i}": peft_model(tiny_llama_path, path) for i, path in enumerate(adapters)})
    for name, model in models.items():
        for j, prompt in enumerate(prompts(3, seed=7)):
            refs[(name, j)] = hf_greedy(model, prompt, MAX_TOKENS, eos=False)
    return refs


def lora_llm(path: Path, adapters: list[Path], device: str = "cpu", **kwargs) -> LLM:
    """float32 on either device: outputs are compared with peft's float32 greedy tokens."""
    args = dict(kv_cache_memory=8 << 20, enable_lora=True, max_loras=8, max_lora_rank=16,
                **exact(device))
    llm = LLM(str(path), **(args | kwargs))
    for i, adapter in enumerate(adapters):
        llm.add_lora(f"a{i}", str(adapter))
    return llm


@pytest.mark.parametrize("device", DEVICES)
def test_each_adapter_alone_equals_peft(tiny_llama_path, adapters, reference, device):
    llm = lora_llm(tiny_llama_path, adapters, device)
    for name in [None] + [f"a{i}" for i in range(len(adapters))]:
        for j, prompt in enumerate(prompts(3, seed=7)):
            out = llm.generate(prompt, PARAMS, lora=name)[0]
            assert out.outputs[0].token_ids == reference[(name, j)], (name, j)
    # the adapters really change the output, so equality above is not the base model's
    differs = sum(reference[(f"a{i}", 0)] != reference[(None, 0)] for i in range(len(SPECS)))
    assert differs >= len(SPECS) - 1


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_of_eight_adapters_and_base_equals_each_alone(
        tiny_llama_path, adapters, reference, device):
    llm = lora_llm(tiny_llama_path, adapters, device)
    names = [None] + [f"a{i}" for i in range(len(adapters))]
    jobs = [(name, j) for j in range(3) for name in names]
    random.Random(3).shuffle(jobs)
    outs = llm.generate([prompts(3, seed=7)[j] for _, j in jobs], PARAMS,
                        lora=[name for name, _ in jobs])
    for (name, j), out in zip(jobs, outs, strict=True):
        assert out.outputs[0].token_ids == reference[(name, j)], (name, j)
    stats = llm.engine.stats()
    assert stats["num_loras_on_device"] == 8 and stats["lora_device_evictions"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_eviction_and_reload_under_pressure_keep_outputs(tiny_llama_path, adapters, reference,
                                                         device):
    llm = lora_llm(tiny_llama_path, adapters, device, max_loras=2, max_cpu_loras=3)
    jobs = [(f"a{i}", j) for j in range(3) for i in range(len(adapters))]
    outs = llm.generate([prompts(3, seed=7)[j] for _, j in jobs], PARAMS,
                        lora=[name for name, _ in jobs])
    for (name, j), out in zip(jobs, outs, strict=True):
        assert out.outputs[0].token_ids == reference[(name, j)], (name, j)
    stats = llm.engine.stats()
    assert stats["lora_device_evictions"] > 0 and stats["lora_cpu_evictions"] > 0
    tiers = {s.name: s.tier for s in llm.engine.list_loras()}
    assert list(tiers.values()).count("device") == 2
    assert list(tiers.values()).count("cpu") <= 1 and "disk" in tiers.values()
    on_disk = next(name for name, tier in tiers.items() if tier == "disk")
    again = llm.generate(prompts(3, seed=7)[1], PARAMS, lora=on_disk)[0]
    assert again.outputs[0].token_ids == reference[(on_disk, 1)]
    assert not any(s.num_requests for s in llm.engine.list_loras())


def test_pinned_adapter_stays_on_device(tiny_llama_path, adapters):
    llm = lora_llm(tiny_llama_path, adapters[:1], max_loras=2, max_cpu_loras=2)
    llm.add_lora("pinned", str(adapters[1]), pinned=True)
    for i in range(2, 6):
        llm.add_lora(f"a{i}", str(adapters[i]))
    llm.generate(prompts(1, seed=1), PARAMS, lora="pinned")
    for i in range(2, 6):
        llm.generate(prompts(2, seed=i), PARAMS, lora=f"a{i}")
    tiers = {s.name: (s.tier, s.pinned) for s in llm.engine.list_loras()}
    assert tiers["pinned"] == ("device", True)
    with pytest.raises(InvalidRequestError, match="pinning leaves fewer than one"):
        llm.add_lora("a2", str(adapters[2]), pinned=True)


def test_prefix_cache_never_crosses_adapters(tiny_llama_path, adapters):
    llm = lora_llm(tiny_llama_path, adapters[:2])
    cold = lora_llm(tiny_llama_path, adapters[:2], enable_prefix_caching=False)
    prompt = prompts(1, seed=11)[0] * 4  # long enough for full blocks
    order = ["a0", None, "a1", "a0", None, "a1"]
    cached, tokens = [], []
    for name in order:
        out = llm.generate(prompt, PARAMS, lora=name)[0]
        cached.append(out.num_cached_tokens)
        tokens.append(out.outputs[0].token_ids)
        assert tokens[-1] == cold.generate(prompt, PARAMS, lora=name)[0].outputs[0].token_ids
    full = (len(prompt) - 1) // 16 * 16
    assert cached == [0, 0, 0, full, full, full]
    # a re-registered adapter is a new adapter to the cache, even under the same name
    llm.remove_lora("a0")
    llm.add_lora("a0", str(adapters[0]))
    assert llm.generate(prompt, PARAMS, lora="a0")[0].num_cached_tokens == 0


def test_registration_rules(tiny_llama_path, adapters, tmp_path):
    llm = lora_llm(tiny_llama_path, adapters[:1], max_lora_rank=8)
    llm.add_lora("a0", str(adapters[0]))  # idempotent
    with pytest.raises(InvalidRequestError, match="another path"):
        llm.add_lora("a0", str(adapters[1]))
    with pytest.raises(AdapterError, match="exceeds max_lora_rank=8"):
        llm.add_lora("big", str(adapters[2]))
    with pytest.raises(UnknownAdapterError, match="'nope' is not loaded"):
        llm.generate(prompts(1, seed=0), PARAMS, lora="nope")
    assert llm.engine.has_unfinished_requests() is False
    llm.engine.add_request("busy", prompts(1, seed=0)[0], PARAMS, lora="a0")
    with pytest.raises(AdapterBusyError, match="1 requests in flight"):
        llm.remove_lora("a0")
    llm.engine.abort_request("busy")
    llm.remove_lora("a0")
    assert llm.engine.list_loras() == []
    base_only = LLM(str(tiny_llama_path), kv_cache_memory=8 << 20)
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        base_only.generate(prompts(1, seed=0), PARAMS, lora="a0")


async def collect(engine: AsyncLLMEngine, prompt: list[int], lora: str | None,
                  started: asyncio.Event | None = None, params: SamplingParams = PARAMS,
                  ) -> list[int]:
    out = None
    async for item in engine.generate(prompt, params, lora=lora):
        out = item
        if started is not None:
            started.set()
    assert out is not None and out.finished
    return out.outputs[0].token_ids


async def test_hot_load_during_generation_changes_nothing_else(
        tiny_llama_path, adapters, reference):
    llm = lora_llm(tiny_llama_path, adapters[:1], max_loras=2, max_cpu_loras=2)
    engine = AsyncLLMEngine.from_engine(llm.engine)
    await engine.start()
    try:
        started = asyncio.Event()
        first = [asyncio.create_task(collect(engine, p, name, started))
                 for p, name in zip(prompts(3, seed=7), [None, "a0", "a0"], strict=True)]
        await started.wait()
        for i in range(1, 4):  # loads while the first requests decode
            await engine.add_lora(f"a{i}", str(adapters[i]))
        later = [asyncio.create_task(collect(engine, prompts(3, seed=7)[j], f"a{i}"))
                 for i in range(1, 4) for j in range(3)]
        assert await asyncio.gather(*first) == [
            reference[(None, 0)], reference[("a0", 1)], reference[("a0", 2)]]
        results = await asyncio.gather(*later)
        assert results == [reference[(f"a{i}", j)] for i in range(1, 4) for j in range(3)]
        # four adapters over two slots and two CPU copies: some were read back from disk
        assert engine.stats()["lora_cpu_evictions"] > 0
    finally:
        await engine.shutdown()


async def test_unload_waits_for_in_flight_requests(tiny_llama_path, adapters):
    llm = lora_llm(tiny_llama_path, adapters[:1])
    engine = AsyncLLMEngine.from_engine(llm.engine)
    await engine.start()
    try:
        started = asyncio.Event()
        long = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
        running = asyncio.create_task(
            collect(engine, prompts(1, seed=2)[0], "a0", started, long))
        await started.wait()
        with pytest.raises(AdapterBusyError, match="requests in flight"):
            await engine.remove_lora("a0")
        unload = asyncio.create_task(engine.remove_lora("a0", wait_s=30))
        await asyncio.sleep(0.05)
        with pytest.raises(UnknownAdapterError, match="being unloaded"):
            await collect(engine, prompts(1, seed=3)[0], "a0")
        assert not unload.done()
        assert len(await running) == 600  # the in-flight request finishes whole
        await unload
        assert await engine.list_loras() == []
        await engine.add_lora("a0", str(adapters[0]))  # and it can come back
        assert [s.name for s in await engine.list_loras()] == ["a0"]
    finally:
        await engine.shutdown()


def test_smollm2_with_a_generated_adapter_equals_peft(smollm2_path, tokenizer, tmp_path):
    adapter = make_peft_adapter(smollm2_path, tmp_path / "smol-lora", seed=5, r=8,
                                target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    chat = [[{"role": "user", "content": "Name a colour of the sky."}],
            [{"role": "user", "content": "What is two plus three?"}]]
    prompts_ = [tokenizer.apply_chat_template(c, tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"] for c in chat]
    reference = peft_model(smollm2_path, adapter)
    expected = [hf_greedy(reference, p, MAX_TOKENS, eos=False) for p in prompts_]
    llm = LLM(str(smollm2_path), kv_cache_memory=64 << 20, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    llm.add_lora("smol", str(adapter))
    outs = llm.generate(prompts_ + prompts_, PARAMS, lora=["smol", "smol", None, None])
    assert [o.outputs[0].token_ids for o in outs[:2]] == expected
    assert [o.outputs[0].token_ids for o in outs[2:]] != expected  # the adapter matters
