"""Benchmark: plain matmul, cutlass_ext.matmul vs cuBLAS (torch.matmul) in the same run.

Shapes: squares 1024..8192, LLM-like products (M = 1..16384 rows against 4096x4096 and
4096x11008 weights), batched products (attention-like [B, M, K] @ [B, K, N]), and 1-256 rows
against 1024x1024 and 2048x2048 matrices.
dtypes bf16, fp16 and tf32 (fp32 inputs with TF32 allowed for both providers).
Writes bench/results/matmul-<device>.json; ratios are cuBLAS time / ours (>1: we are faster).

    python bench/matmul.py
    python bench/matmul.py --dtypes bf16 --sets square
    python bench/matmul.py --graphs          # CUDA-graph replays: the GPU time without the host's
    python bench/matmul.py --graphs --chain 20   # 20 products back to back a sample (a call's share)
    python bench/matmul.py --graphs --chain 20 --plain-launch   # also ours launched the usual way

--chain N times N products back to back after each flush, each on the next of several copies of
the operands that together hold at least twice L2, and reports a call's share: the regime of a
training step, where the GPU stays busy and power holds its clock below the boost that one call
after an idle flush gets (bench/NOTES.md sections 43-44). The providers take turns, or with
--sustain S run in blocks of their own, each at its own clock under the power cap.
--plain-launch adds the provider plain_launch: ours with its GEMMs launched the usual way instead of
as programmatic dependents of the kernel before them (the chain's products follow each other).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (add_timer_arguments, geomean, graphed, operand_copies, timer_from_args,  # noqa: E402
                     timer_settings, with_plain_launch, write_results)

import cutlass_ext  # noqa: E402
from cutlass_ext.ops import _runtime  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}


def shape_sets():
    """(batch, M, K, N); batch 0 means a plain 2-D product."""
    square = [(0, s, s, s) for s in (1024, 2048, 4096, 6144, 8192)]
    llm = [(0, m, 4096, n) for n in (4096, 11008) for m in (1, 16, 128, 512, 2048, 8192, 16384)]
    batched = [(b, m, k, n) for b, m, k, n in ((32, 2048, 128, 2048), (32, 2048, 2048, 128), (8, 4096, 4096, 1024))]
    small = [(0, m, s, s) for s in (1024, 2048) for m in (1, 16, 128, 256)]
    return {"square": square, "llm": llm, "batched": batched, "small": small}


def products(config) -> dict:
    return {"cutlass_ext": lambda a, b: cutlass_ext.matmul(a, b, config=config), "cublas": torch.matmul}


def chained(fns: dict, chain: int, sets: list) -> dict:
    """Each provider as ``chain`` products back to back over the operand sets in turn (one
    product of the first set for chain = 1)."""
    def run(fn):
        def go():
            for i in range(chain):
                fn(*sets[i % len(sets)])
        return go
    return {name: run(fn) for name, fn in fns.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bf16,fp16,tf32")
    parser.add_argument("--sets", default="square,llm,batched,small")
    parser.add_argument("--config", default=None, help="force one GEMM config of ours (default: the heuristic)")
    add_timer_arguments(parser, iters=30)
    parser.add_argument("--graphs", action="store_true", help="time CUDA-graph replays of each case")
    parser.add_argument("--chain", type=int, default=0,
                        help="time this many products back to back over rotating operand copies (0: one)")
    parser.add_argument("--plain-launch", action="store_true",
                        help="also time ours with its GEMMs launched the usual way (provider plain_launch)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = True
    timer = timer_from_args(args)
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
                operands = operand_copies(a, b) if args.chain > 0 else [(a, b)]
                cases = chained(products(args.config), max(args.chain, 1), operands)
                if args.plain_launch:
                    cases = with_plain_launch(cases, _runtime.gemm_dependent_launch)
                with torch.no_grad():
                    if args.graphs:
                        cases = {name: graphed(name, fn) for name, fn in cases.items()}
                    if None in cases.values():  # graphed() said which provider could not be captured
                        continue
                    times = timer.median_us_many(cases)
                    if args.chain > 0:
                        times = {name: t / args.chain for name, t in times.items()}
                flops = 2 * max(batch, 1) * m * n * k
                ratio = times["cublas"] / times["cutlass_ext"]
                rows.append({"dtype": dtype_name, "set": set_name, "batch": batch, "M": m, "K": k, "N": n,
                             "times_us": times, "ratio_vs_cublas": ratio,
                             "tflops": flops / times["cutlass_ext"] / 1e6})
                ours = times["cutlass_ext"]
                plain = (f"  plain launch {times['plain_launch']:9.1f} ({times['plain_launch'] / ours:4.2f})"
                         if "plain_launch" in times else "")
                print(f"{set_name:8s} {batch:3d} {m:6d} {k:6d} {n:6d}  ours {ours:9.1f}  "
                      f"cublas {times['cublas']:9.1f}  ({ratio:4.2f})  {flops / ours / 1e6:6.1f}{plain}", flush=True)
                del a, b, operands, cases
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
    path = write_results("matmul", {"config": args.config, "cuda_graphs": args.graphs, "chain": args.chain,
                                    **timer_settings(args), "rows": rows, "summary": summary}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
