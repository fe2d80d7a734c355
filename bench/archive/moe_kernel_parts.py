"""The Qwen3-MoE-shaped kernel parts session 5 changed, each timed alone (medians of rounds):

    .venv/bin/python bench/archive/moe_kernel_parts.py

- prefill attention for heads of 128 (16 query, 8 K/V heads), fresh chunks of 16-2,048 tokens
  and 512 after 1,536 cached: the AMX kernel (`amx_prefill`, where this CPU has AMX) against
  the vector kernel (`vec_prefill`);
- the experts' grouped matmuls of one layer (gate/up and down, 64 experts of 1024 -> 2 x 256,
  8 per token), at 1-2,048 tokens: bfloat16 tiles (`cpu_amx.grouped_linear`, AMX and dot
  where they run) and float32 blocks (`cpu_moe.grouped_linear`), over three layers' weights
  so each call reads its weights from memory as a decode step does;
- the element-wise parts around them: the weighted sum of the pairs (`cpu_fused.moe_sum`) and
  SiLU-and-multiply, bfloat16 and float32; and each layer's residual add with RMSNorm over
  the hidden rows and RoPE over the q and k heads (16 + 8 of 128), as many tokens.

Prints one line per measurement with the CPU's model and flags; writes nothing. Figures quoted
in docs/benchmarks-history.md ("Session 5") were taken alternating builds of the C sources.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common.machine import cpu_model, simd_flags  # noqa: E402
from workers.runner import amx_prefill, cpu_amx, cpu_fused, cpu_moe, vec_prefill  # noqa: E402

EXPERTS, HIDDEN, INTER, TOP_K = 64, 1024, 256, 8
HEADS, KV_HEADS, DIM = 16, 8, 128


def median_ms(fn: Callable[[], object], rounds: int = 9) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def attention() -> None:
    kernels = {"vec": vec_prefill.prefill_attention}
    if cpu_amx.available():
        kernels["amx"] = amx_prefill.prefill_attention
    for q_len, ctx in ((16, 0), (138, 0), (256, 0), (2048, 0), (512, 1536)):
        q = torch.randn(q_len, HEADS, DIM).bfloat16()
        k, v = (torch.randn(q_len, KV_HEADS, DIM).bfloat16() for _ in range(2))
        k_ctx = torch.randn(KV_HEADS, ctx, DIM).bfloat16() if ctx else None
        v_ctx = torch.randn(KV_HEADS, ctx, DIM).bfloat16() if ctx else None
        times = {name: median_ms(functools.partial(f, q, k, v, k_ctx, v_ctx, DIM**-0.5))
                 for name, f in kernels.items()}
        print(f"attention {q_len:5d} tokens after {ctx:5d}: "
              + "  ".join(f"{n} {t:.3f} ms" for n, t in times.items()))


def layers(weights: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor, h: torch.Tensor,
           offsets: torch.Tensor, kernel: str | None) -> None:
    """Both projections of each layer: tiles by `kernel`, or float32 blocks (None)."""
    for gate_up, down in weights:
        if kernel is None:
            cpu_moe.grouped_linear(x, gate_up, offsets, 2 * INTER)
            cpu_moe.grouped_linear(h, down, offsets, HIDDEN)
        else:
            cpu_amx.grouped_linear(x, gate_up, offsets, 2 * INTER, kernel=kernel)
            cpu_amx.grouped_linear(h, down, offsets, HIDDEN, kernel=kernel)


def experts(tokens_list: tuple[int, ...]) -> None:
    tile_kernels = [k for k in cpu_amx.KERNELS if cpu_amx.kernel_available(k)]
    bf16 = [(cpu_amx.pack_experts(torch.randn(EXPERTS, 2 * INTER, HIDDEN).bfloat16()),
             cpu_amx.pack_experts(torch.randn(EXPERTS, HIDDEN, INTER).bfloat16()))
            for _ in range(3)] if tile_kernels else []
    f32 = [(cpu_moe.pack_experts(torch.randn(EXPERTS, 2 * INTER, HIDDEN)),
            cpu_moe.pack_experts(torch.randn(EXPERTS, HIDDEN, INTER))) for _ in range(3)]
    for tokens in tokens_list:
        pairs = tokens * TOP_K
        counts = torch.bincount(torch.randint(0, EXPERTS, (pairs,)), minlength=EXPERTS)
        offsets = torch.zeros(EXPERTS + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        line = []
        for kernel in tile_kernels:
            x, h = torch.randn(pairs, HIDDEN).bfloat16(), torch.randn(pairs, INTER).bfloat16()
            run = functools.partial(layers, bf16, x, h, offsets, kernel)
            line.append(f"{kernel} {median_ms(run, 7) / len(bf16):.2f}")
        x, h = torch.randn(pairs, HIDDEN), torch.randn(pairs, INTER)
        run = functools.partial(layers, f32, x, h, offsets, None)
        line.append(f"vec(float32) {median_ms(run, 7) / len(f32):.2f}")
        print(f"experts {tokens:5d} tokens, ms a layer: " + "  ".join(line))


def elementwise() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in (64, 2048):
            rows = torch.randn(tokens * TOP_K, HIDDEN).to(dtype)
            index = torch.randperm(tokens * TOP_K).view(tokens, TOP_K)
            weights = torch.rand(tokens, TOP_K)
            gate_up = torch.randn(tokens * TOP_K, 2 * INTER).to(dtype)
            x, residual = (torch.randn(tokens, HIDDEN).to(dtype) for _ in range(2))
            norm_weight = torch.randn(HIDDEN).to(dtype)
            qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM).to(dtype)
            cos, sin = torch.randn(4096, DIM // 2), torch.randn(4096, DIM // 2)
            positions = torch.arange(tokens)
            summed = median_ms(functools.partial(cpu_fused.moe_sum, rows, index, weights))
            gated = median_ms(functools.partial(cpu_fused.silu_mul, gate_up))
            normed = median_ms(functools.partial(cpu_fused.add_rms_norm, x, residual,
                                                 norm_weight, 1e-6))
            rotated = median_ms(functools.partial(cpu_fused.rope_, qkv, positions, cos, sin,
                                                  HEADS + KV_HEADS, DIM))
            print(f"element-wise {str(dtype)[6:]:8s} {tokens:5d} tokens: moe_sum "
                  f"{summed:.3f} ms  silu_mul {gated:.3f} ms  add_rms_norm {normed:.3f} ms  "
                  f"rope {rotated:.3f} ms")


def main() -> None:
    print(f"{cpu_model()} ({' '.join(simd_flags())}), {torch.get_num_threads()} threads")
    attention()
    experts((1, 8, 64, 256, 2048))
    elementwise()


if __name__ == "__main__":
    main()
