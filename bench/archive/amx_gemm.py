"""One step's projections on CPU, bfloat16: oneDNN's blocked weights vs a tile-layout kernel
(AMX, or AVX-512 BF16 dot products with `--kernel dot`).

A decode step multiplies a few rows by every layer's weights once, so what it costs is
reading 212 MB of SmolLM2-135M's projection weights from memory, not FLOPs. This times all
120 projections of a step (30 layers of fused q/k/v, o, fused gate/up, down, each layer its own
weight so nothing stays in cache) at each row count, both kernels interleaved (rounds of
both, median of medians), with the weight-read rate and the machine's plain read rate beside
them, and GFLOP/s where rows make it compute-bound. `cpu_amx.MAX_ROWS` (where the tile
backends hand over to oneDNN) comes from this table.

Usage: .venv/bin/python bench/archive/amx_gemm.py [--kernel amx|dot]
       [--rows 1,16,32,64,128,512,2048] [--rounds 5]
Writes bench/results/amx_gemm-cpu.json (`dot_gemm-cpu.json` for dot). Needs a CPU with AMX
bfloat16 (amx) or AVX-512 BF16 (dot).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common.machine import cpu_model, simd_flags  # noqa: E402
from bench.common.timing import interleaved  # noqa: E402
from workers.runner import cpu_amx  # noqa: E402
from workers.runner.linear import onednn_linear, pack_weight  # noqa: E402

# (in features, out features) of one SmolLM2-135M layer's projections
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
LAYERS = 30


def read_rate(nbytes: int, rounds: int) -> float:
    """GB/s of a plain sum over `nbytes` of float32: what this machine's memory gives."""
    data = torch.randn(nbytes // 4)
    ms, _ = interleaved(data.sum, data.sum, rounds, 3)
    return nbytes / ms / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,32,64,128,512,2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kernel", choices=cpu_amx.KERNELS, default="amx")
    args = parser.parse_args()
    if not cpu_amx.kernel_available(args.kernel):
        print(f"this CPU cannot run the {args.kernel} kernel (AMX bfloat16 refused or absent, "
              "or no AVX-512 BF16)")
        return 1
    gen = torch.Generator().manual_seed(0)
    dense = [[(torch.randn(n, k, generator=gen) * k**-0.5).bfloat16() for k, n in SHAPES]
             for _ in range(LAYERS)]
    blocked = [[pack_weight(w) for w in layer] for layer in dense]
    tiled = [[cpu_amx.pack(w) for w in layer] for layer in dense]
    weight_bytes = sum(w.numel() * 2 for layer in dense for w in layer)
    rows_out = []
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k, _ in SHAPES}

            def onednn_step(xs: dict[int, torch.Tensor] = xs) -> None:
                for layer in blocked:
                    for w, (k, _) in zip(layer, SHAPES, strict=True):
                        onednn_linear(xs[k], w)

            def amx_step(xs: dict[int, torch.Tensor] = xs) -> None:
                for layer in tiled:
                    for w, (k, n) in zip(layer, SHAPES, strict=True):
                        cpu_amx.amx_linear(xs[k], w, n, kernel=args.kernel)

            onednn_ms, amx_ms = interleaved(onednn_step, amx_step, args.rounds, 3)
            flops = 2 * rows * weight_bytes / 2  # 2 x rows x parameters
            rows_out.append({"rows": rows, "onednn_ms": onednn_ms, "amx_ms": amx_ms,
                             "onednn_gbps": weight_bytes / onednn_ms / 1e6,
                             "amx_gbps": weight_bytes / amx_ms / 1e6,
                             "onednn_gflops": flops / onednn_ms / 1e6,
                             "amx_gflops": flops / amx_ms / 1e6})
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": cpu_model(), "simd": simd_flags(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "kernel": args.kernel, "weight_mb": weight_bytes / 1e6,
        "plain_read_gbps": read_rate(weight_bytes, args.rounds), "rows": rows_out,
    }
    out = ROOT / "bench" / "results" / f"{args.kernel}_gemm-cpu.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"amx_gemm  {report['date']}  {report['machine']}  threads {report['threads']}  "
          f"{report['weight_mb']:.0f} MB of weights a step, plain read "
          f"{report['plain_read_gbps']:.1f} GB/s")
    name = args.kernel  # the tile kernel's columns ("amx_*" in the JSON for either)
    print(f"{'rows':>5} {'oneDNN ms':>10} {name + ' ms':>8} {'oneDNN GB/s':>12} "
          f"{name + ' GB/s':>9} {'oneDNN GFLOP/s':>15} {name + ' GFLOP/s':>12} {'speed-up':>8}")
    for r in rows_out:
        print(f"{r['rows']:>5} {r['onednn_ms']:>10.2f} {r['amx_ms']:>8.2f} "
              f"{r['onednn_gbps']:>12.1f} {r['amx_gbps']:>9.1f} {r['onednn_gflops']:>15.0f} "
              f"{r['amx_gflops']:>12.0f} {r['onednn_ms'] / r['amx_ms']:>7.2f}x")
    print(f"\nwrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
