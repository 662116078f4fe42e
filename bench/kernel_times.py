"""Kernel durations of small elementwise cases from the torch profiler: cutlass_ext against
torch.compile and eager, each call after L2 is zeroed (bench/_common.Timer's "zero" flush).

Where bench/elementwise.py's times of launch-bound shapes (a few microseconds) differ, this says
whether the kernels differ or what surrounds them. A kernel launched as a programmatic dependent
of the one before (the second stage of cutlass_ext's column sums) starts early and waits for it,
so its duration includes that wait.

    python bench/kernel_times.py
    python bench/kernel_times.py --shapes 1024x1024,4096x128 --ops softmax
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_results  # noqa: E402

import cutlass_ext  # noqa: E402

CASES = {
    "softmax": (lambda x: cutlass_ext.softmax(x, -1), lambda x: torch.softmax(x, -1)),
    "sum_dim0": (lambda x: cutlass_ext.sum(x, 0), lambda x: x.sum(0)),
    "sum_dim1": (lambda x: cutlass_ext.sum(x, -1), lambda x: x.sum(-1)),
}


def kernel_times(fn, x, dy, backward: bool, flush, reps: int = 20) -> dict:
    """{kernel name: (launches per call, median duration in us)} over ``reps`` calls."""
    def once():
        xx = x.detach().requires_grad_(backward)
        y = fn(xx)
        if backward:
            y.backward(dy)
    for _ in range(3):
        once()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            once()
        torch.cuda.synchronize()
    times = {}
    for e in prof.events():
        name = e.name.lower()
        if e.device_type == torch.autograd.DeviceType.CUDA and "fill" not in name and "zero" not in name:
            times.setdefault(e.name[:120], []).append(e.device_time)
    return {k: (len(v) // reps, statistics.median(v)) for k, v in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(CASES))
    parser.add_argument("--shapes", default="1024x1024,4096x128", help="rows x cols, comma-separated")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    rows = []
    for op in args.ops.split(","):
        ours, peer = CASES[op]
        compiled = torch.compile(peer, dynamic=False)
        for shape in args.shapes.split(","):
            r, c = (int(v) for v in shape.lower().split("x"))
            x = torch.randn(r, c, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn_like(peer(x))
            for backward in (False, True):
                for provider, fn in (("cutlass_ext", ours), ("compile", compiled), ("eager", peer)):
                    kernels = kernel_times(fn, x, dy, backward, flush)
                    mode = "fwdbwd" if backward else "fwd"
                    rows.append(dict(op=op, rows=r, cols=c, mode=mode, provider=provider,
                                     kernels={k: {"per_call": n, "median_us": t} for k, (n, t) in kernels.items()}))
                    print(op, r, c, mode, provider, {k[:60]: round(t, 2) for k, (n, t) in kernels.items()}, flush=True)
    print(f"wrote {write_results('kernel-times', {'rows': rows}, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
