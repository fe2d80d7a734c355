"""Freed host memory stays in the heap (`host_heap.keep_freed_memory`): a second block of the
same size reuses the first's pages instead of faulting fresh ones in, and the engine sets it
on CPU unless told not to."""

from __future__ import annotations

import subprocess
import sys

import pytest

from workers import LLM
from workers.runner import host_heap

# Three 20 MB blocks in turn, each written whole and freed; prints each one's minor faults.
PROBE = """
import ctypes, resource, sys
from workers.runner import host_heap
if sys.argv[1] == "keep":
    assert host_heap.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(20 << 20)
    libc.memset(block, 1, 20 << 20)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""
PAGES = (20 << 20) // 4096

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def faults(mode: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                          check=True, timeout=120)
    return [int(n) for n in done.stdout.split()]


@glibc
def test_a_freed_block_is_reused_without_faulting_its_pages_in_again():
    first, second, third = faults("keep")
    assert first >= PAGES // 2  # the first block's pages are new
    assert second < PAGES // 20 and third < PAGES // 20


@glibc
def test_by_default_glibc_maps_the_second_block_afresh():
    """What the setting changes: glibc returns a freed large block to the OS at once, so the
    next one faults its pages in again."""
    first, second, _ = faults("default")
    assert first >= PAGES // 2 and second >= PAGES // 2


@pytest.mark.parametrize("keep", [True, False])
def test_the_engine_keeps_the_heap_on_cpu_unless_told_not_to(tiny_llama_path, monkeypatch,
                                                            keep):
    calls = []
    monkeypatch.setattr(host_heap, "keep_freed_memory", lambda: calls.append(1) or True)
    LLM(str(tiny_llama_path), device="cpu", dtype="float32", kv_cache_memory=8 << 20,
        keep_host_heap=keep)
    assert calls == ([1] if keep else [])
