"""Mixture-of-experts: how to run the routed experts on this CPU (issue 37).

    .venv/bin/python bench/moe_experts.py                     # float32 and bfloat16
    .venv/bin/python bench/moe_experts.py --dtypes bfloat16 --tokens 1,64 --rounds 20

Times `workers.runner.models.experts.routed_experts` on Qwen3-MoE-shaped experts (64 experts,
hidden 1024, intermediate 256, 8 per token: `bench/engine_throughput.py --model-config
qwen3-moe`) at several token counts, one layer, with each way of multiplying the experts:

- `grouped`: PyTorch's `_grouped_mm` over the stacked weights, one call per projection;
- `loop`: one `F.linear` per expert that has tokens (MKL for float32 on CPU);
- `loop_onednn`: the same through oneDNN's matmul (`linear.onednn_linear`) on the dense slices;
- `loop_packed`: oneDNN with each expert's weights blocked once (`linear.pack_weight`);
- `vec`: float32 only: the experts' weights packed into 16-column blocks, all experts of a
  projection in one C call (`cpu_moe.grouped_linear`);
- `upcast`: bfloat16 only: the experts widened once to float32 and run by `vec`, the layer's
  input widened and its output rounded (what the `onednn_upcast` linear backend does on a CPU
  without bfloat16 dot products);
- `amx`, `dot`: bfloat16 only, where this CPU has AMX / AVX-512 BF16: the experts' weights
  packed into AMX's tile layout, all experts of a projection in one C call
  (`cpu_amx.grouped_linear`).

The kernels run in rounds, one call of each per round in turn, so a machine whose speed drifts
(a shared VM) drifts for all of them alike; the median and the best of the rounds are printed
and written to bench/results/moe_experts.json with the CPU's model and flags.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common.machine import cpu_model, simd_flags  # noqa: E402
from workers.runner import cpu_amx, cpu_moe  # noqa: E402
from workers.runner.linear import onednn_linear, onednn_runs, pack_weight  # noqa: E402
from workers.runner.models.experts import grouped_mm_runs, routed_experts  # noqa: E402

EXPERTS, HIDDEN, INTER, TOP_K = 64, 1024, 256, 8


def activate(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(INTER, dim=-1)
    return F.silu(gate) * up


def candidates(dtype: torch.dtype) -> dict[str, object]:
    """name -> a function of (x, weights, experts) running one layer's experts."""
    gen = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.02).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.02).to(dtype)
    runs: dict[str, object] = {
        "loop": lambda x, w, e: routed_experts(x, w, e, gate_up, down, activate),
    }
    if onednn_runs(dtype):  # oneDNN's bfloat16 needs AVX-512 (or AVX-NE-CONVERT)
        runs["loop_onednn"] = lambda x, w, e: routed_experts(x, w, e, gate_up, down, activate,
                                                             linear=onednn_linear)
        packed_gu = [pack_weight(gate_up[i]) for i in range(EXPERTS)]
        packed_d = [pack_weight(down[i]) for i in range(EXPERTS)]
        runs["loop_packed"] = lambda x, w, e: routed_experts(x, w, e, packed_gu, packed_d,
                                                             activate, linear=onednn_linear)
    if grouped_mm_runs("cpu", dtype):
        runs["grouped"] = lambda x, w, e: routed_experts(x, w, e, gate_up, down, activate,
                                                         kernel="grouped")
    if dtype == torch.float32 and cpu_moe.available():
        vec = (cpu_moe.pack_experts(gate_up), cpu_moe.pack_experts(down))
        runs["vec"] = lambda x, w, e: routed_experts(x, w, e, gate_up, down, activate,
                                                     kernel="vec", tiles=vec)
    if dtype == torch.bfloat16 and cpu_moe.available():  # what `onednn_upcast` runs
        wide = (cpu_moe.pack_experts(gate_up.float()), cpu_moe.pack_experts(down.float()))
        runs["upcast"] = lambda x, w, e: routed_experts(
            x.float(), w.float(), e, (), (), activate, kernel="vec", tiles=wide).to(dtype)
    if dtype == torch.bfloat16:
        for kernel in cpu_amx.KERNELS:
            if cpu_amx.kernel_available(kernel):
                tiles = (cpu_amx.pack_experts(gate_up), cpu_amx.pack_experts(down))
                runs[kernel] = (lambda t, k: lambda x, w, e: routed_experts(
                    x, w, e, gate_up, down, activate, kernel=k, tiles=t))(tiles, kernel)
    return runs


def time_kernels(dtype: torch.dtype, tokens: int, rounds: int) -> dict[str, dict[str, float]]:
    runs = candidates(dtype)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    probs = torch.softmax(torch.randn(tokens, EXPERTS, generator=gen), dim=-1)
    weights, experts = torch.topk(probs, TOP_K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    want = runs["loop"](x, weights, experts)
    for name, run in runs.items():  # warm, and every kernel gives the same answer
        got = run(x, weights, experts)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=name)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run(x, weights, experts)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: {"median_ms": statistics.median(t), "best_ms": min(t)}
            for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tokens", default="1,8,64,256,1024",
                   help="tokens per call (decode steps: the batch; prefill: the chunk)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    p.add_argument("--results", default=str(ROOT / "bench" / "results" / "moe_experts.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    print(f"{cpu_model()} ({' '.join(simd_flags())}), {torch.get_num_threads()} threads; "
          f"{EXPERTS} experts, hidden {HIDDEN}, intermediate {INTER}, top {TOP_K}; ms per "
          "layer, median (best)")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for tokens in (int(t) for t in args.tokens.split(",")):
            result = time_kernels(dtype, tokens, args.rounds)
            fastest = min(result, key=lambda k: result[k]["median_ms"])
            rows.append({"dtype": dtype_name, "tokens": tokens, "kernels": result,
                         "fastest": fastest})
            cells = "  ".join(f"{k} {v['median_ms']:.2f} ({v['best_ms']:.2f})"
                              for k, v in result.items())
            print(f"{dtype_name:>8} {tokens:>5} tokens: {cells}  -> {fastest}", flush=True)
    report = {"benchmark": "moe_experts",
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "cpu": cpu_model(), "simd_flags": simd_flags(),
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "shape": {"experts": EXPERTS, "hidden": HIDDEN, "intermediate": INTER,
                        "top_k": TOP_K}, "rows": rows}
    out = Path(args.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
