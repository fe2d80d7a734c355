"""Keep freed host memory in the process's heap, so the next step's tensors reuse it.

A prefill step's activations are tens of megabytes each (a 2,048-token chunk's projections,
its experts' rows). glibc's malloc hands blocks that large out as fresh mappings and returns
them to the OS when freed, or trims the heap's freed top, so the next step faults every page
in again, zeroed by the kernel. On a 2-core Xeon (family 6 model 207) the first 9,674-token
burst after load took 326,000 page faults and 5.4 s against 21,000 and 4.2 s with the heap
kept (`bench/engine_throughput.py --model-config qwen3-moe`, docs/benchmarks.md). glibc
raises its own threshold after the first free, but only for the size it saw, and trims again.

`keep_freed_memory` sets the mapping threshold to glibc's largest (32 MB: blocks below it come
from the heap) and the trim threshold to 1 GiB (a freed top up to that stays mapped). The cost
is that the process's resident size stays at its peak, as a serving engine's does anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's upper bound for it on 64-bit
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Once per process; whether glibc took both settings (False elsewhere: musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        logger.info("malloc settings not changed: no glibc mallopt in %s", name)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    taken = (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
             and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    if not taken:
        logger.info("malloc settings not taken by this C library (%s)", name)
    return taken
