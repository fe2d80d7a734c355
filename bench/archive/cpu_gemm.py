"""CPU projection GEMMs: PyTorch's `F.linear` (MKL for float32) vs oneDNN on the same weight.

The engine's `linear_backend` picks oneDNN on CPU (`workers/runner/linear.py`). This times both
kernels on SmolLM2-135M's projection shapes (fused q/k/v, o, fused gate/up, down, LM head) at
the row counts a step has: 1-64 decode rows, 512-2048 prefill tokens. Each pair runs
interleaved (rounds of both, median of medians), so a shared machine's drift hits both sides
alike. Also checks that both give the same product (max abs difference).

Usage: .venv/bin/python bench/archive/cpu_gemm.py [--rows 1,4,16,64,512,2048] [--rounds 5]
    [--packed HINT] [--dtype float32|bfloat16]
Prints a table last and writes bench/results/cpu_gemm-cpu.json (`cpu_gemm_packed<HINT>`,
`-bfloat16` where they apply; a narrower run writes the git-ignored ...-smoke.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make `workers` and `bench` importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common.machine import cpu_model  # noqa: E402
from bench.common.timing import interleaved  # noqa: E402
from bench.common.workload import LINEAR_SHAPES  # noqa: E402
from workers.runner.linear import onednn_available, onednn_linear  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SHAPES = LINEAR_SHAPES  # (name, in features, out features) of SmolLM2-135M's projections


def operands(rows: int, in_features: int, out_features: int, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations and a weight scaled as a trained projection's, seeded by the row count."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g) * in_features**-0.5
    return x.to(dtype), weight.to(dtype)


def compare(rows: int, in_features: int, out_features: int, rounds: int,
            dtype: torch.dtype) -> dict[str, float]:
    x, weight = operands(rows, in_features, out_features, dtype)
    mkl = lambda: F.linear(x, weight)  # noqa: E731
    dnn = lambda: onednn_linear(x, weight)  # noqa: E731
    calls = 3 if rows * out_features > 1 << 24 else 10
    torch_ms, onednn_ms = interleaved(mkl, dnn, rounds, calls)
    torch_us, onednn_us = torch_ms * 1e3, onednn_ms * 1e3
    flops = 2 * rows * in_features * out_features
    return {"torch_us": torch_us, "onednn_us": onednn_us,
            "torch_gflops": flops / torch_us / 1e3, "onednn_gflops": flops / onednn_us / 1e3,
            "max_abs_diff": float((mkl() - dnn()).float().abs().max())}


def compare_packed(rows: int, in_features: int, out_features: int, rounds: int,
                   hint: int, dtype: torch.dtype) -> dict[str, float]:
    """oneDNN on the plain weight against oneDNN on the weight reordered once into its
    blocked layout (what inductor's freezing does), packed for `hint` rows and used at any."""
    x, weight = operands(rows, in_features, out_features, dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, hint)
    plain = lambda: onednn_linear(x, weight)  # noqa: E731
    blocked = lambda: torch.ops.mkldnn._linear_pointwise(  # noqa: E731
        x, packed, None, "none", [None], "")
    calls = 3 if rows * out_features > 1 << 24 else 10
    plain_ms, packed_ms = interleaved(plain, blocked, rounds, calls)
    flops = 2 * rows * in_features * out_features
    return {"torch_us": plain_ms * 1e3, "onednn_us": packed_ms * 1e3,
            "torch_gflops": flops / plain_ms / 1e6, "onednn_gflops": flops / packed_ms / 1e6,
            "max_abs_diff": float((plain() - blocked()).float().abs().max())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,64,512,2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--packed", type=int, default=0, metavar="HINT",
                        help="instead: oneDNN plain weight (left columns) vs weight reordered "
                             "once for HINT rows (right columns)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if not onednn_available():
        print("this PyTorch has no oneDNN linear op")
        return 1
    results = []
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            for name, fan_in, fan_out in SHAPES:
                if name == "lm_head" and rows > 64:  # the head sees one row per sampled sequence
                    continue
                timed = (compare_packed(rows, fan_in, fan_out, args.rounds, args.packed, dtype)
                         if args.packed else compare(rows, fan_in, fan_out, args.rounds, dtype))
                results.append({"rows": rows, "shape": name, "in": fan_in, "out": fan_out,
                                **timed})
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "dtype": args.dtype, "rows": results,
    }
    RESULTS.mkdir(exist_ok=True)
    full = args.rows == parser.get_default("rows") and args.rounds == parser.get_default("rounds")
    kind = f"cpu_gemm_packed{args.packed}" if args.packed else "cpu_gemm"
    if args.dtype != "float32":
        kind += f"-{args.dtype}"
    out = RESULTS / f"{kind}-cpu{'' if full else '-smoke'}.json"  # a narrow run is a smoke
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"cpu_gemm  {report['date']}  {report['machine']}  threads {report['threads']}  "
          f"{args.dtype}")
    head = (f"{'rows':>5} {'shape':>8} {'torch us':>10} {'oneDNN us':>10} {'torch GF/s':>10} "
            f"{'oneDNN GF/s':>11} {'speed-up':>8} {'max diff':>9}")
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['rows']:>5} {r['shape']:>8} {r['torch_us']:>10.1f} {r['onednn_us']:>10.1f} "
              f"{r['torch_gflops']:>10.1f} {r['onednn_gflops']:>11.1f} "
              f"{r['torch_us'] / r['onednn_us']:>7.2f}x {r['max_abs_diff']:>9.1e}")
    print(f"\nwrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
