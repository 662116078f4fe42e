"""Benchmark: plain matmul, cutlass_ext.matmul vs cuBLAS (torch.matmul) in the same run.

Shapes: squares 1024..8192, LLM-like products (M = 1..16384 rows against 4096x4096 and
4096x11008 weights), batched products (attention-like [B, M, K] @ [B, K, N]), and 1-256 rows
against 1024x1024 and 2048x2048 matrices.
dtypes bf16, fp16 and tf32 (fp32 inputs with TF32 allowed for both providers).
Writes bench/results/matmul-<device>.json; ratios are cuBLAS time / ours (>1: we are faster).

    python bench/matmul.py
    python bench/matmul.py --dtypes bf16 --sets square
    python bench/matmul.py --graphs          # CUDA-graph replays: the GPU time without the host's
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import FLUSH_MODES, Timer, geomean, graphed, write_results  # noqa: E402

import cutlass_ext  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}


def shape_sets():
    """(batch, M, K, N); batch 0 means a plain 2-D product."""
    square = [(0, s, s, s) for s in (1024, 2048, 4096, 6144, 8192)]
    llm = [(0, m, 4096, n) for n in (4096, 11008) for m in (1, 16, 128, 512, 2048, 8192, 16384)]
    batched = [(b, m, k, n) for b, m, k, n in ((32, 2048, 128, 2048), (32, 2048, 2048, 128), (8, 4096, 4096, 1024))]
    small = [(0, m, s, s) for s in (1024, 2048) for m in (1, 16, 128, 256)]
    return {"square": square, "llm": llm, "batched": batched, "small": small}


def providers(a, b, config):
    return {"cutlass_ext": lambda: cutlass_ext.matmul(a, b, config=config), "cublas": lambda: torch.matmul(a, b)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bf16,fp16,tf32")
    parser.add_argument("--sets", default="square,llm,batched,small")
    parser.add_argument("--config", default=None, help="force one GEMM config of ours (default: the heuristic)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--graphs", action="store_true", help="time CUDA-graph replays of each case")
    parser.add_argument("--flush", default="zero", choices=FLUSH_MODES,
                        help="how L2 is emptied before each timed call (zero: write a buffer, read: read it)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = True
    timer = Timer(iters=args.iters, flush=args.flush)
    sets = shape_sets()
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        print(f"\n== {dtype_name}: time us (ratio = cuBLAS / cutlass_ext), TFLOP/s of ours")
        for set_name in args.sets.split(","):
            for batch, m, k, n in sets[set_name]:
                lead = (batch,) if batch else ()
                a = torch.randn(*lead, m, k, device="cuda", dtype=dtype)
                b = torch.randn(*lead, k, n, device="cuda", dtype=dtype) / k**0.5
                cases = providers(a, b, args.config)
                with torch.no_grad():
                    if args.graphs:
                        cases = {name: graphed(name, fn) for name, fn in cases.items()}
                    if None in cases.values():  # graphed() said which provider could not be captured
                        continue
                    times = timer.median_us_many(cases)
                flops = 2 * max(batch, 1) * m * n * k
                ratio = times["cublas"] / times["cutlass_ext"]
                rows.append({"dtype": dtype_name, "set": set_name, "batch": batch, "M": m, "K": k, "N": n,
                             "times_us": times, "ratio_vs_cublas": ratio,
                             "tflops": flops / times["cutlass_ext"] / 1e6})
                print(f"{set_name:8s} {batch:3d} {m:6d} {k:6d} {n:6d}  ours {times['cutlass_ext']:9.1f}  "
                      f"cublas {times['cublas']:9.1f}  ({ratio:4.2f})  {flops / times['cutlass_ext'] / 1e6:6.1f}",
                      flush=True)
                del a, b, cases
    summary = {}
    for dtype_name in args.dtypes.split(","):
        mine = [r for r in rows if r["dtype"] == dtype_name]
        big = [r["ratio_vs_cublas"] for r in mine if r["batch"] == 0 and min(r["M"], r["K"], r["N"]) >= 4096]
        summary[dtype_name] = {"geomean_vs_cublas": geomean([r["ratio_vs_cublas"] for r in mine]),
                               "min_at_4096_cubed_and_up": min(big) if big else None,
                               "misses": [{k: r[k] for k in ("set", "batch", "M", "K", "N", "ratio_vs_cublas")}
                                          for r in mine if r["ratio_vs_cublas"] < 1.0]}
        s = summary[dtype_name]
        print(f"{dtype_name}: geomean {s['geomean_vs_cublas']:.3f}x cuBLAS; min at >= 4096^3: "
              f"{s['min_at_4096_cubed_and_up']}; shapes below 1.0x: {len(s['misses'])}")
    path = write_results("matmul", {"config": args.config, "cuda_graphs": args.graphs, "flush": args.flush,
                                    "rows": rows, "summary": summary}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
