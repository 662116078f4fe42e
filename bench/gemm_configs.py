"""Config sweep: times cutlass_ext.linear (bias + ReLU epilogue, x @ W.T) with every built GEMM
config and tile swizzle, next to cuBLASLt's fused torch._addmm_activation, and prints the best
config per shape. Used to set the heuristic in csrc/bindings/gemm.cpp.

    python bench/gemm_configs.py --dtype bf16
    python bench/gemm_configs.py --set large --swizzles 1 --sustain 0.5   # each provider in blocks of its own
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_timer_arguments, geomean, timer_from_args, timer_settings, write_results  # noqa: E402

import cutlass_ext  # noqa: E402

LLM = ((4096, 4096), (4096, 11008), (11008, 4096))
SHAPE_SETS = {
    "large": [(m, k, n) for k, n in LLM for m in (2048, 4096, 8192, 16384)] + [(4096, 4096, 4096), (8192, 8192, 8192)],
    "small": [(m, k, n) for k, n in LLM for m in (1, 8, 16, 32, 64, 128, 256, 512)],
    # Between the transposed small-M kernels and two waves of 128x128 tiles.
    "mid": [(m, k, n) for k, n in LLM for m in (256, 512, 768, 1024, 1536, 2048)],
    # Short K: LoRA's rank-r products (K = r) and narrow input layers.
    "shortk": [(m, k, n) for k, n in ((16, 4096), (64, 4096), (16, 11008), (64, 11008), (16, 512))
               for m in (2048, 8192, 32768)],
    # bench/linear.py's DLRM MLP layers (13-512-256-64-16 and 512-256-1): narrow K or N.
    "dlrm": [(m, k, n) for k, n in ((13, 512), (512, 256), (256, 64), (64, 16), (256, 1))
             for m in (2048, 8192, 32768, 65536)],
    # Few columns (the hand-written dot-product kernel's range, N <= 16) against K.
    "fewcols": [(m, k, n) for n in (1, 4, 8, 16) for k in (64, 256, 1024, 4096) for m in (2048, 65536)],
    # Between one and two rounds of 128x128 tiles on 132 SMs, over K = 1024-11008: the products
    # that one round of 128x144, 128x192 or 128x256 tiles covers (bench/NOTES.md sections 53-54).
    "rounds": [(1024, 4096, 3072), (768, 4096, 4096), (1536, 4096, 2048), (1536, 4096, 1536), (1536, 1536, 1536),
               (1024, 4096, 4096), (2048, 2048, 1536), (1536, 3072, 2048), (1536, 2048, 2048), (2048, 1024, 1536),
               (1024, 3072, 3072), (512, 2048, 6144), (768, 11008, 4096), (768, 8192, 4096), (1024, 8192, 3072),
               (2048, 8192, 1536), (1536, 8192, 1536)],
    # bench/linear.py's squares below a few waves of 128x128 tiles, and products of that size with
    # one long side.
    "square": [(s, s, s) for s in (512, 1024, 1536, 2048, 3072)] + [(1024, 4096, 1024), (1024, 1024, 4096),
                                                                     (2048, 2048, 1024), (2048, 1024, 2048)],
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--set", default="large", choices=sorted(SHAPE_SETS))
    parser.add_argument("--swizzles", default="1,2,4,8")
    add_timer_arguments(parser, iters=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    # The Hopper CUTLASS kernels and the hand-written short-K and few-column ones for this layout.
    configs = [cfg for name, cfg in cutlass_ext.build().kernels()
               if any(name.startswith(f"{family}_{args.dtype}_kk_bias_act_") for family in ("sm90", "lowk", "gemv"))
               and "_aux_" not in name]
    timer = timer_from_args(args)
    ext = cutlass_ext.build()
    ext._configure_tuning("", False)  # an empty in-memory table: "default" is the heuristic
    rows = []
    for m, k, n in SHAPE_SETS[args.set]:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
        b = torch.randn(n, device="cuda", dtype=dtype)

        def ours(cfg, swizzle):
            def run():
                os.environ["CUTLASS_EXT_GEMM_SWIZZLE"] = swizzle
                cutlass_ext.linear(x, w.t(), b, relu=True, config=cfg)
            return run

        def default():
            os.environ.pop("CUTLASS_EXT_GEMM_SWIZZLE", None)
            cutlass_ext.linear(x, w.t(), b, relu=True)

        fns = {"cublaslt": lambda: torch._addmm_activation(b, x, w.t()), "default": default,
               "eager": lambda: torch.relu(torch.nn.functional.linear(x, w, b))}
        # A config that cannot run this shape raises when forced and is left out: the short-K
        # kernel holds K <= 64 in shared memory, the few-column one N <= 16 columns of B.
        usable = []
        for cfg in configs:
            try:
                ours(cfg, "1")()
                usable.append(cfg)
            except RuntimeError:
                pass
        fns.update({f"{cfg}/s{s}": ours(cfg, s) for cfg in usable for s in args.swizzles.split(",")})
        with torch.no_grad():
            results = timer.median_us_many(fns)
        os.environ.pop("CUTLASS_EXT_GEMM_SWIZZLE", None)
        peer, default, eager = results.pop("cublaslt"), results.pop("default"), results.pop("eager")
        best = min(results, key=results.get)
        # What the autotuner picks for this bucket (its own timing), priced by this sweep's timings.
        with cutlass_ext.tune():
            cutlass_ext.linear(x, w.t(), b, relu=True)
        entries = cutlass_ext.tuning.entries()  # empty when only one config is built: nothing to tune
        tuned = next(iter(entries.values())) if entries else best.split("/")[0]
        ext._clear_tuning()
        tuned_us = min(t for name, t in results.items() if name.startswith(tuned + "/"))
        rows.append({"M": m, "K": k, "N": n, "cublaslt_us": peer, "eager_us": eager, "default_us": default,
                     "tuned_config": tuned, "tuned_us": tuned_us, "best_config": best, "configs": results})
        top = sorted(results.items(), key=lambda kv: kv[1])[:3]
        print(f"{m:6d} {k:6d} {n:6d}  cublaslt {peer:8.1f}  eager {eager:8.1f}  default {default:8.1f} ({peer / default:4.2f})  best "
              f"{best} {results[best]:8.1f} ({peer / results[best]:4.2f})  next: "
              + ", ".join(f"{c} {t:.1f}" for c, t in top[1:]), flush=True)
    summary = {
        "heuristic_over_best_max": max(r["default_us"] / r["configs"][r["best_config"]] for r in rows),
        "heuristic_over_tuned_max": max(r["default_us"] / r["tuned_us"] for r in rows),
        "heuristic_over_tuned_geomean": geomean([r["default_us"] / r["tuned_us"] for r in rows]),
        "cublaslt_over_heuristic_min": min(r["cublaslt_us"] / r["default_us"] for r in rows),
    }
    print("summary: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    path = write_results(f"gemm_configs-{args.set}-{args.dtype}",
                         {**timer_settings(args), "rows": rows, "summary": summary}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
