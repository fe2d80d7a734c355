"""Which attention kernels a runner uses: for decode rows, an in-place kernel where one
fits; for prefill chunks after cached context, a fused kernel where one fits.

`auto` picks the Triton kernel on CUDA and the C kernel on CPU for decodes, and the flash
split for prefills on CPU (docs/engine.md, "Attention"); an explicit choice that cannot run
is refused by name rather than silently replaced.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from workers.runner import amx_prefill, cpu_decode, flash_prefill, vec_prefill
from workers.runner.attention import PREFILL_KERNELS

ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
PREFILL_ATTENTION = ("auto", *PREFILL_KERNELS)


def pick_attention_backend(
    name: str, device: torch.device, block_size: int, head_dim: int, *, group: int = 1,
    dtype: torch.dtype = torch.float32, kv_cache_dtype: str = "auto",
) -> str:
    """`auto` is an in-place decode kernel where one fits: Triton on CUDA when Triton is
    there, the C kernel on CPU (float32, or bfloat16 with a bfloat16 pool) when it builds (it
    is built here); else torch.

    Asking for a kernel where it cannot run is an error, not a silent fallback. Triton runs on
    CPU only under its interpreter (`TRITON_INTERPRET=1`), which is for tests.
    Both kernels read an int8 pool (`kv_cache_dtype`) in place.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}")
    if name == "torch":
        return "torch"
    has_triton = importlib.util.find_spec("triton") is not None
    triton_fits = block_size & (block_size - 1) == 0 and 0 < head_dim <= 256
    cpu_fits = cpu_decode.fits(group, head_dim, block_size, dtype,
                               int8_pool=kv_cache_dtype == "int8")
    if name == "auto":
        if device.type == "cuda":
            return "triton" if has_triton and triton_fits else "torch"
        return "cpu" if device.type == "cpu" and cpu_fits and cpu_decode.available() else "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("attention_backend 'cpu' needs a CPU device")
        if not cpu_fits:
            raise ValueError("attention_backend 'cpu' needs float32 (or bfloat16 with a "
                             "bfloat16 pool), a GQA group <= "
                             f"{cpu_decode.MAX_GROUP}, head_dim <= {cpu_decode.MAX_DIM} and "
                             f"block_size <= {cpu_decode.MAX_BLOCK}")
        cpu_decode.load_library()  # RuntimeError with the reason: no compiler, a failed build
        return "cpu"
    if not has_triton:
        raise ValueError("attention_backend 'triton' needs the triton package")
    if not triton_fits:
        raise ValueError("attention_backend 'triton' needs a power-of-two block_size "
                         "and head_dim <= 256")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend 'triton' needs a CUDA device "
                         "(or TRITON_INTERPRET=1, for tests)")
    return "triton"


def pick_prefill_attention(name: str, device: torch.device, *,
                           dtype: torch.dtype = torch.float32, head_dim: int = 0) -> str:
    """How a prefill chunk after cached context attends: `flash` (two fused-kernel calls
    merged by log-sum-exp, `flash_prefill`), `masked` (one SDPA call with an explicit
    causal mask over the gathered context; on CPU, SDPA's unfused math path), `causal` (one
    SDPA call with a lower-right causal bias over the same: on CUDA a flash or
    memory-efficient kernel with no mask in memory; on CPU the math path), `amx` (every
    prefill chunk, cached context or not, through one AMX kernel call, `amx_prefill`) or `vec`
    (the same through one AVX-512 or AVX2 kernel call, `vec_prefill`).

    `auto` is `amx` for bfloat16 heads of 64 or 128 on a CPU with AMX, else `vec` on AVX-512
    (heads of 64 or 128: 1.5-2.9x the flash split on a Zen 4; bfloat16 widened to float32 where the
    CPU lacks AVX-512 BF16, 1.1-1.4x on a Xeon without it; docs/benchmarks.md; its AVX2
    build is explicit only), else `flash` where it
    runs (CPU, with the kernel in this torch); `causal` on CUDA (since issue 41, not yet run
    on a GPU: `masked` is the known-good fallback there), else `masked`.
    """
    if name not in PREFILL_ATTENTION:
        raise ValueError(f"prefill_attention must be one of {', '.join(PREFILL_ATTENTION)}")
    if name == "auto":
        if amx_prefill.fits(dtype, head_dim, device):
            return "amx"
        if vec_prefill.preferred(dtype, head_dim, device):
            return "vec"
        if flash_prefill.fits(device):
            return "flash"
        return "causal" if device.type == "cuda" else "masked"
    if name == "amx" and not amx_prefill.fits(dtype, head_dim, device):
        raise ValueError("prefill_attention 'amx' needs bfloat16, heads of 64 or 128 and a "
                         "CPU with AMX that Linux lets this process use")
    if name == "vec" and not vec_prefill.fits(dtype, head_dim, device):
        raise ValueError("prefill_attention 'vec' needs heads of 64 or 128 and a CPU with "
                         "AVX-512 or AVX2")
    if name == "flash" and not flash_prefill.fits(device):
        raise ValueError("prefill_attention 'flash' needs a CPU device and torch's "
                         "_scaled_dot_product_flash_attention_for_cpu")
    return name
