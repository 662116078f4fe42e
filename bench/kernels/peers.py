"""The peers of the kernel-level benchmarks, timed the same way (README.md here): each call after
a 512 MB fill of a flush buffer, events around the call alone, median over the rounds.

    python bench/kernels/peers.py gemm 4096x4096x4096 ...       # cuBLAS mm, cuBLASLt bias+ReLU
    python bench/kernels/peers.py gemm --chain 20 4096x4096x4096 # 20 calls back to back a sample
    python bench/kernels/peers.py layer_norm 65536x512 ...      # torch eager and torch.compile
    python bench/kernels/peers.py add 134217728 ...             # a + b: eager, torch.compile; x.copy_
    python bench/kernels/peers.py cublas-path                   # the libcublas torch loads, for
                                                                # gemm_variants --cublas=PATH
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import operand_copies  # noqa: E402


def median_us(fns: dict, rounds: int, calls: int = 1) -> dict:
    """Median over ``rounds`` of each fn's time after a flush; ``calls`` > 1 times that many calls
    of it back to back (fn(i) for i in range(calls)) and returns a call's share."""
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    for fn in fns.values():
        fn(0)
        fn(1)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name, fn in fns.items():
            flush.fill_(r & 0xFF)
            start.record()
            for i in range(calls):
                fn(i)
            stop.record()
            stop.synchronize()
            times[name].append(start.elapsed_time(stop) * 1000 / calls)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def gemm(shape: str, rounds: int, chain: int = 0) -> None:
    """With ``chain`` > 0, as gemm_variants --chain: that many calls back to back a sample, over
    copies of A and W that together hold at least twice L2."""
    M, N, K = map(int, shape.split("x"))
    A = torch.rand(M, K, device="cuda", dtype=torch.bfloat16) * 2 - 1
    W = torch.rand(N, K, device="cuda", dtype=torch.bfloat16) * 2 - 1
    bias = torch.rand(N, device="cuda", dtype=torch.bfloat16) * 2 - 1
    sets = operand_copies(A, W) if chain > 0 else [(A, W)]

    def matmul(i):
        a, w = sets[i % len(sets)]
        return torch.mm(a, w.t())

    def bias_relu(i):
        a, w = sets[i % len(sets)]
        return torch._addmm_activation(bias, a, w.t())

    fns = {"cublas_matmul": matmul, "cublaslt_bias_relu": bias_relu}
    label = " a call, chained" if chain > 0 else ""
    for name, us in median_us(fns, rounds, max(chain, 1)).items():
        print(f"{shape} {name:20s} {us:8.1f} us {2 * M * N * K / us * 1e-6:6.0f} TFLOP/s{label}")


def layer_norm(shape: str, rounds: int) -> None:
    rows, cols = map(int, shape.split("x"))
    x = torch.rand(rows, cols, device="cuda", dtype=torch.bfloat16) * 4 - 1.5
    w = torch.rand(cols, device="cuda", dtype=torch.bfloat16)
    b = torch.rand(cols, device="cuda", dtype=torch.bfloat16)
    for relu in (0, 1):
        def fn(t):
            return F.layer_norm(torch.relu(t) if relu else t, (cols,), w, b)
        compiled = torch.compile(fn)
        for name, us in median_us({"eager": lambda i: fn(x), "compile": lambda i: compiled(x)}, rounds).items():
            print(f"{shape} relu={relu} {name:8s} {us:8.2f} us {4 * rows * cols / us * 1e-3:6.0f} GB/s")


def add(shape: str, rounds: int) -> None:
    n = int(shape)
    a = torch.rand(n, device="cuda", dtype=torch.bfloat16) * 4 - 2
    b = torch.rand(n, device="cuda", dtype=torch.bfloat16) * 4 - 2
    out = torch.empty_like(a)
    compiled = torch.compile(lambda x, y: x + y, dynamic=False)
    fns = {"copy_": lambda i: out.copy_(a), "eager": lambda i: torch.add(a, b, out=out), "compile": lambda i: compiled(a, b)}
    for name, us in median_us(fns, rounds).items():
        moved = (4 if name == "copy_" else 6) * n
        print(f"n={n} {name:8s} {us:8.1f} us {moved / us * 1e-3:6.0f} GB/s")


def cublas_path() -> str:
    """The file of the libcublas this process's torch calls (read from /proc/self/maps after a
    product on the GPU has loaded it)."""
    a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, a)
    torch.cuda.synchronize()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/libcublas.so" in path:
                return path
    raise SystemExit("cublas-path: torch's product loaded no libcublas.so (a CPU build of torch?)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["gemm", "layer_norm", "add", "cublas-path"])
    parser.add_argument("shapes", nargs="*")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--chain", type=int, default=0, help="gemm: calls back to back a sample (0: one)")
    args = parser.parse_args()
    if args.what == "cublas-path":
        print(cublas_path())
        return
    if not args.shapes:
        parser.error(f"{args.what}: give at least one shape")
    print("device", torch.cuda.get_device_name(), "torch", torch.__version__)
    for shape in args.shapes:
        if args.what == "gemm":
            gemm(shape, args.rounds, args.chain)
        else:
            {"layer_norm": layer_norm, "add": add}[args.what](shape, args.rounds)


if __name__ == "__main__":
    main()
