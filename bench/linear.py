"""Benchmark: fused linear (bias + activation) forward, and linear + bias + GELU forward+backward.

Providers:
  cutlass_ext   cutlass_ext.linear(x, w.t(), b, activation=...)
  eager         act(F.linear(x, w, b))
  cublaslt      torch._addmm_activation(b, x, w.t()) (cuBLASLt's fused bias+ReLU epilogue; forward only)
  compile       torch.compile(act(F.linear(x, w, b)), dynamic=True) (one compile covers all shapes)
  plain_launch  with --plain-launch: cutlass_ext with its GEMMs launched the usual way instead of as
                programmatic dependents of the kernel before them

Shapes (M tokens/batch, K in, N out): LLM projections, DLRM MLP layers, squares.
Writes bench/results/linear-<device>.json and prints one table per mode. With --graphs each case
is captured in a CUDA graph and replayed, which leaves the host's launch and autograd cost out:
the small rows of the forward+backward mode otherwise measure host time.

    python bench/linear.py                       # everything
    python bench/linear.py --dtypes bf16 --modes fwd --sets llm
    python bench/linear.py --dtypes bf16 --modes fwdbwd --graphs
    python bench/linear.py --modes fwd --sets llm --max-rows 16 --config t64x16k128_pp --graphs
    python bench/linear.py --modes fwdbwd --graphs --providers cutlass_ext,eager --plain-launch
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (add_timer_arguments, geomean, graphed_cases, timer_from_args, timer_settings,  # noqa: E402
                     with_plain_launch, write_results)

import cutlass_ext  # noqa: E402
from cutlass_ext.ops import _runtime  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}


def shape_sets():
    llm = [(m, k, n) for k, n in ((4096, 4096), (4096, 11008), (11008, 4096))
           for m in (1, 16, 128, 512, 2048, 4096, 8192, 16384)]
    dlrm = [(m, k, n) for k, n in ((13, 512), (512, 256), (256, 64), (64, 16), (256, 1))
            for m in (2048, 8192, 32768, 65536)]
    squares = [(s, s, s) for s in (1024, 2048, 4096, 8192)]
    return {"llm": llm, "dlrm": dlrm, "square": squares}


def targeted(m, k, n) -> bool:
    """The shapes the forward/backward targets apply to: M >= 2048 and N or K >= 4096."""
    return m >= 2048 and max(n, k) >= 4096


ACT_FN = {"relu": torch.relu, "gelu": F.gelu}


def providers(mode: str, act: str, config: str | None = None):
    act_fn = ACT_FN[act]

    def ours(x, w, b):
        return cutlass_ext.linear(x, w.t(), b, activation=act, config=config)

    def eager(x, w, b):
        return act_fn(F.linear(x, w, b))

    compiled = torch.compile(eager, dynamic=True)
    table = {"cutlass_ext": ours, "eager": eager, "compile": compiled}
    if mode == "fwd" and act == "relu":
        table["cublaslt"] = lambda x, w, b: torch._addmm_activation(b, x, w.t())
    return table


def case_fn(mode, fn, x, w, b, grad):
    """A zero-argument callable running one forward (no autograd) or one forward+backward."""
    if mode == "fwd":
        def forward():
            with torch.no_grad():
                fn(x, w, b)

        return forward

    def step():
        for t in (x, w, b):
            t.grad = None
        fn(x, w, b).backward(grad)

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bf16,fp16,tf32")
    parser.add_argument("--modes", default="fwd,fwdbwd", help="fwd (bias+ReLU) and/or fwdbwd (bias+GELU)")
    parser.add_argument("--sets", default="llm,dlrm,square")
    parser.add_argument("--providers", default="cutlass_ext,eager,cublaslt,compile")
    parser.add_argument("--bwd-dtypes", default="bf16,tf32",
                        help="dtypes for fwdbwd (the slow mode): bf16 and TF32 by default, whose backward "
                             "GEMMs take different kernels (fp16 takes bf16's configs)")
    add_timer_arguments(parser, iters=30)
    parser.add_argument("--graphs", action="store_true", help="time CUDA-graph replays of each case")
    parser.add_argument("--config", default=None, help="force one GEMM config of ours (default: the heuristic)")
    parser.add_argument("--max-rows", type=int, default=None, help="only shapes with at most this many rows")
    parser.add_argument("--plain-launch", action="store_true",
                        help="also time ours with its GEMMs launched the usual way (provider plain_launch)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    torch.backends.cuda.matmul.allow_tf32 = True  # the tf32 rows compare TF32 against TF32
    timer = timer_from_args(args)
    sets = shape_sets()
    wanted = set(args.providers.split(","))
    rows = []
    for mode in args.modes.split(","):
        act = "relu" if mode == "fwd" else "gelu"
        dtypes = args.dtypes.split(",") if mode == "fwd" else args.bwd_dtypes.split(",")
        table = {k: v for k, v in providers(mode, act, args.config).items() if k in wanted}
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            for set_name in args.sets.split(","):
                for m, k, n in sets[set_name]:
                    if args.max_rows is not None and m > args.max_rows:
                        continue
                    needs_grad = mode == "fwdbwd"
                    x = torch.randn(m, k, device="cuda", dtype=dtype).requires_grad_(needs_grad)
                    w = (torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5).requires_grad_(needs_grad)
                    b = torch.randn(n, device="cuda", dtype=dtype).requires_grad_(needs_grad)
                    grad = torch.randn(m, n, device="cuda", dtype=dtype) if needs_grad else None
                    flops = 2 * m * n * k * (3 if needs_grad else 1)
                    cases = {name: case_fn(mode, fn, x, w, b, grad) for name, fn in table.items()}
                    if args.plain_launch and "cutlass_ext" in cases:
                        cases = with_plain_launch(cases, _runtime.gemm_dependent_launch)
                    if args.graphs:
                        cases = graphed_cases(cases)
                    times = timer.median_us_many(cases)
                    for name, us in times.items():
                        rows.append({"mode": mode, "activation": act, "dtype": dtype_name, "set": set_name,
                                     "M": m, "K": k, "N": n, "provider": name, "median_us": us,
                                     "tflops": flops / us / 1e6})
                    del x, w, b, grad
    summary = summarize(rows)
    path = write_results("linear", {"cuda_graphs": args.graphs, **timer_settings(args), "rows": rows,
                                    "summary": summary}, args.out)
    print_tables(rows, summary)
    print(f"wrote {path}")
    return 0


def summarize(rows):
    """Ratios (peer time / our time: >1 means cutlass_ext is faster) per mode and dtype."""
    out = {}
    keyed = {}
    for r in rows:
        keyed.setdefault((r["mode"], r["dtype"], r["set"], r["M"], r["K"], r["N"]), {})[r["provider"]] = r["median_us"]
    for (mode, dtype, set_name, m, k, n), times in keyed.items():
        if "cutlass_ext" not in times:
            continue
        s = out.setdefault(f"{mode}/{dtype}", {"ratios": {}, "targeted_min": {}, "misses": []})
        for peer, t in times.items():
            if peer == "cutlass_ext":
                continue
            ratio = t / times["cutlass_ext"]
            s["ratios"].setdefault(peer, []).append(ratio)
            if targeted(m, k, n):
                s["targeted_min"][peer] = min(s["targeted_min"].get(peer, float("inf")), ratio)
                if ratio < 1.0:
                    s["misses"].append({"peer": peer, "M": m, "K": k, "N": n, "ratio": round(ratio, 3)})
    for s in out.values():
        s["geomean"] = {peer: geomean(r) for peer, r in s["ratios"].items()}
        del s["ratios"]
    return out


def print_tables(rows, summary):
    keyed = {}
    for r in rows:
        keyed.setdefault((r["mode"], r["dtype"], r["set"], r["M"], r["K"], r["N"]), {})[r["provider"]] = r
    current = None
    for (mode, dtype, set_name, m, k, n), by_provider in keyed.items():
        if (mode, dtype) != current:
            current = (mode, dtype)
            peers = [p for p in by_provider if p != "cutlass_ext"]
            print(f"\n== {mode} {dtype} ({by_provider[next(iter(by_provider))]['activation']}): "
                  f"time us (ratio = peer / cutlass_ext)")
            print(f"{'set':7s} {'M':>6s} {'K':>6s} {'N':>6s} {'ours':>9s} {'TF/s':>6s} " +
                  " ".join(f"{p:>16s}" for p in peers))
        ours = by_provider.get("cutlass_ext")
        if ours is None:
            continue
        cells = " ".join(f"{by_provider[p]['median_us']:9.1f} ({by_provider[p]['median_us'] / ours['median_us']:4.2f})"
                         for p in peers if p in by_provider)
        mark = "*" if targeted(m, k, n) else " "
        print(f"{set_name:7s}{mark}{m:6d} {k:6d} {n:6d} {ours['median_us']:9.1f} {ours['tflops']:6.1f} {cells}")
    print("\n(* = targeted shape: M >= 2048 and N or K >= 4096)")
    for key, s in summary.items():
        print(f"{key}: geomean {', '.join(f'{p} {v:.3f}x' for p, v in s['geomean'].items())}; "
              f"min on targeted {', '.join(f'{p} {v:.3f}x' for p, v in s['targeted_min'].items())}; "
              f"misses {len(s['misses'])}")


if __name__ == "__main__":
    sys.exit(main())
