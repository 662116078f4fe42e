"""One lora_merge (or cuBLAS addmm_) call at a time, under three L2 states before each call.

    python bench/merge_timing.py [--shapes 4096x4096,4096x11008] [--ranks 8,16,64] [--out PATH]

bench/lora.py times merge+unmerge pairs behind its usual 256 MB `zero_` flush; this script
separates the kernel from the host and the cache state: each call is preceded by a 256 MB
`zero_` (leaves dirty lines in L2), a 256 MB read (leaves clean lines), or nothing (calls back to
back: then the time is the host's, whenever the host is slower than the kernel). The `copy`
provider copies the weight into another buffer of its size: the same bytes read and written as a
merge, the rate a merge can reach; `gemm` is lora_merge as a GEMM with the weight as its C operand
(CUTLASS_EXT_LORA_MERGE_PASS=0), as it ran before the rank-r update pass; `pass128x64` and
`pass256x256` run the pass on that block tile whatever its rule picks. Writes
bench/results/merge_timing-<device>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import warm_up_gpu, write_results  # noqa: E402

import cutlass_ext  # noqa: E402


PROVIDERS = ("cutlass_ext", "gemm", "pass128x64", "pass256x256", "addmm", "copy")
PASS_SETTING = {"gemm": "0", "pass128x64": "128x64", "pass256x256": "256x256"}


def time_calls(fn, flush, n):
    pairs = []
    for i in range(n):
        flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) * 1e3 for s, e in pairs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4096x4096", help="comma-separated out x in")
    parser.add_argument("--ranks", default="8,16,64")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--flushes", default="zero,read,none")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    unknown = set(args.providers.split(",")) - set(PROVIDERS)
    if unknown:
        parser.error(f"unknown providers {sorted(unknown)}; choose from {', '.join(PROVIDERS)}")
    if not torch.cuda.is_available():
        print("bench/merge_timing.py needs a CUDA GPU")
        return 1
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    warm_up_gpu()
    buf = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    flushes = {"zero": lambda: buf.zero_(), "read": lambda: buf.sum(dtype=torch.int64), "none": lambda: None}
    flushes = {k: v for k, v in flushes.items() if k in args.flushes.split(",")}
    wanted = args.providers.split(",")
    rows = []
    for out_f, in_f in shapes:
        copy_dst = torch.empty(out_f, in_f, device="cuda", dtype=torch.bfloat16)
        for r in (int(v) for v in args.ranks.split(",")):
            w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16) / in_f**0.5
            a = torch.randn(r, in_f, device="cuda", dtype=torch.bfloat16) / in_f**0.5
            b = torch.randn(out_f, r, device="cuda", dtype=torch.bfloat16) / r**0.5
            # Alternate merge and unmerge so that the weight stays where it started.
            def merge(i):
                cutlass_ext.lora_merge(w, a, b, 2.0, sign=1 if i % 2 == 0 else -1)

            providers = {
                "cutlass_ext": merge, "gemm": merge, "pass128x64": merge, "pass256x256": merge,
                "addmm": lambda i: w.addmm_(b, a, alpha=2.0 if i % 2 == 0 else -2.0),
                "copy": lambda i: copy_dst.copy_(w),
            }
            for flush_name, flush in flushes.items():
                for name in wanted:
                    fn = providers[name]
                    os.environ["CUTLASS_EXT_LORA_MERGE_PASS"] = PASS_SETTING.get(name, "1")
                    times = time_calls(fn, flush, args.calls)
                    median = times[len(times) // 2]
                    rows.append({"out": out_f, "in": in_f, "r": r, "flush": flush_name, "provider": name,
                                 "median_us": median, "min_us": times[0]})
                    print(f"{out_f}x{in_f} r={r:3d} flush={flush_name:4s} {name:11s} median {median:7.1f} us  "
                          f"min {times[0]:7.1f}", flush=True)
    path = write_results("merge_timing", {"shapes": shapes, "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
