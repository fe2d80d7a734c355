"""The CPU KV pool in memory advised for huge pages: zeroed, aligned, alive with its tensor,
and (where Linux offers huge pages on request) in a mapping eligible for them."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from workers import LLM, SamplingParams
from workers.runner import huge_pages
from workers.runner.kv_cache import KVCacheSpec, allocate

needs_madvise = pytest.mark.skipif(not huge_pages.supported(), reason="no MADV_HUGEPAGE here")
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _smaps_entry(address: int) -> str:
    """This process's smaps entry of the mapping holding `address`."""
    entry: list[str] = []
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = start <= address < end
        if inside:
            entry.append(line)
    return "\n".join(entry)


@needs_madvise
def test_a_pool_is_zeroed_aligned_and_lives_with_its_tensor():
    t = huge_pages.zeros((5, 3, 16, 8192), torch.bfloat16)  # 3.75 MiB
    assert t.shape == (5, 3, 16, 8192) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert int(torch.count_nonzero(t)) == 0
    gc.collect()  # nothing but the tensor holds the mapping now
    t[4, 2, 15, -1] = 3.0
    t.add_(1)
    assert float(t.float().sum()) == t.numel() + 3.0


@needs_madvise
@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(),
                    reason="this kernel offers no transparent huge pages")
def test_the_mapping_is_eligible_for_huge_pages():
    t = huge_pages.zeros((4 << 20,), torch.float32)  # 16 MiB
    t.fill_(1.0)
    entry = _smaps_entry(t.data_ptr())
    assert "THPeligible:    1" in entry or "THPeligible: 1" in " ".join(entry.split())


def _rss_kib(entry: str) -> int:
    return next(int(line.split()[1]) for line in entry.splitlines() if line.startswith("Rss:"))


@needs_madvise
def test_the_pool_is_resident_before_its_first_write():
    t = huge_pages.zeros((8 << 20,), torch.uint8)  # 8 MiB, nothing written by the caller
    assert _rss_kib(_smaps_entry(t.data_ptr())) >= 8 << 10


def test_under_one_huge_page_is_plain_torch_memory():
    t = huge_pages.zeros((16, 16), torch.float32)
    assert t.shape == (16, 16) and int(torch.count_nonzero(t)) == 0


@pytest.mark.parametrize("huge", [True, False])
def test_allocate_gives_zeroed_k_and_v_per_layer_either_way(huge):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16,
                       dtype=torch.bfloat16)
    caches = allocate(spec, 700, torch.device("cpu"), huge_pages=huge)
    assert len(caches) == 2
    for k, v in caches:
        assert k.shape == v.shape == (700, 3, 16, 64) and k.dtype == torch.bfloat16
        assert int(torch.count_nonzero(k)) == int(torch.count_nonzero(v)) == 0
        assert k.data_ptr() != v.data_ptr()
        if huge and huge_pages.supported():
            assert k.data_ptr() % huge_pages.HUGE_PAGE == 0


def test_the_engine_gives_the_same_tokens_with_and_without_huge_pages(tiny_llama_path):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 301, 44, 9], [7, 8, 9] * 20]
    outs = []
    for huge in (True, False):
        llm = LLM(str(tiny_llama_path), device="cpu", dtype="float32", kv_cache_memory=8 << 20,
                  kv_huge_pages=huge)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1] and all(len(t) == 12 for t in outs[0])
