"""Config sweep: times cutlass_ext.linear (bias + ReLU epilogue, x @ W.T) with every built GEMM
config and tile swizzle, next to cuBLASLt's fused torch._addmm_activation, and prints the best
config per shape. Used to set the heuristic in csrc/bindings/gemm.cpp.

    python bench/gemm_configs.py --dtype bf16
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Timer, write_results  # noqa: E402

import cutlass_ext  # noqa: E402

SHAPES = [(m, k, n) for k, n in ((4096, 4096), (4096, 11008), (11008, 4096)) for m in (2048, 4096, 8192, 16384)]
SHAPES += [(4096, 4096, 4096), (8192, 8192, 8192)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--swizzles", default="1,2,4,8")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    prefix = f"sm90_{args.dtype}_kk_bias_act_"
    configs = [cfg for name, cfg in cutlass_ext.build().kernels() if name.startswith(prefix) and "_aux_" not in name]
    timer = Timer(iters=args.iters)
    rows = []
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
        b = torch.randn(n, device="cuda", dtype=dtype)

        def ours(cfg, swizzle):
            def run():
                os.environ["CUTLASS_EXT_GEMM_CONFIG"] = cfg
                os.environ["CUTLASS_EXT_GEMM_SWIZZLE"] = swizzle
                cutlass_ext.linear(x, w.t(), b, relu=True)
            return run

        def default():
            os.environ.pop("CUTLASS_EXT_GEMM_CONFIG", None)
            os.environ.pop("CUTLASS_EXT_GEMM_SWIZZLE", None)
            cutlass_ext.linear(x, w.t(), b, relu=True)

        fns = {"cublaslt": lambda: torch._addmm_activation(b, x, w.t()), "default": default}
        fns.update({f"{cfg}/s{s}": ours(cfg, s) for cfg in configs for s in args.swizzles.split(",")})
        with torch.no_grad():
            results = timer.median_us_many(fns)
        os.environ.pop("CUTLASS_EXT_GEMM_CONFIG", None)
        os.environ.pop("CUTLASS_EXT_GEMM_SWIZZLE", None)
        peer, default = results.pop("cublaslt"), results.pop("default")
        best = min(results, key=results.get)
        rows.append({"M": m, "K": k, "N": n, "cublaslt_us": peer, "default_us": default, "configs": results})
        top = sorted(results.items(), key=lambda kv: kv[1])[:3]
        print(f"{m:6d} {k:6d} {n:6d}  cublaslt {peer:8.1f}  default {default:8.1f} ({peer / default:4.2f})  best "
              f"{best} {results[best]:8.1f} ({peer / results[best]:4.2f})  next: "
              + ", ".join(f"{c} {t:.1f}" for c, t in top[1:]), flush=True)
    path = write_results(f"gemm_configs-{args.dtype}", {"rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
