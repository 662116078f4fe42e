"""Benchmark: the hand-written memory-bound ops (softmax, fused ReLU+LayerNorm(+dropout), bias_act,
sum, add), forward and forward+backward, in GB/s and as a share of a device copy measured in the
same run.

Providers:
  cutlass_ext   cutlass_ext.<op>
  eager         the same math in PyTorch eager (torch.softmax, F.layer_norm(F.relu(x)), ...)
  compile       torch.compile of the eager function (default mode, one static compile per shape)
  plain_launch  with --plain-launch: cutlass_ext.<op> with the split reductions' second kernels
                launched the usual way instead of as programmatic dependents of the first

Bandwidth counts the bytes an op must move at least (each input read once, each output written
once; the backward reads what it needs, e.g. softmax's y and dy); "copy" is x.copy_ of a tensor
of the same size, whose bytes are read + written.

With --graphs each provider's call is captured in a CUDA graph and replayed, which takes the
host's launch and autograd cost out of the times (a forward+backward step of a small shape is
otherwise mostly host time); a provider that cannot be captured is timed without a graph, and the
record lists the captured ones under "graphed".

    python bench/elementwise.py                          # everything, bf16
    python bench/elementwise.py --ops softmax --modes fwd --dtypes bf16,fp32
    python bench/elementwise.py --graphs --modes fwdbwd --out bench/results/elementwise-graphs-h200.json
    python bench/elementwise.py --graphs --ops bias_relu,sum_dim0 --modes fwdbwd --plain-launch
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Timer, geomean, graphed, with_plain_launch, write_results  # noqa: E402

import cutlass_ext  # noqa: E402
from cutlass_ext.ops import _runtime  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# rows x cols: the two reference shapes (32768x4096 and 65536x512), rows from 128 to
# 262144 columns at about 2^25..2^27 elements, a width that is no power of two (3000 columns: the
# kernels' remainders of vectors a thread; sums over such rows ran at 0.68x torch.compile where the
# bench set had none, bench/NOTES.md section 64), and two small launch-bound shapes.
SHAPES = [
    (65536, 128), (65536, 512), (32768, 1024), (32768, 4096), (8192, 16384),
    (2048, 65536), (512, 262144), (8192, 3000), (4096, 128), (1024, 1024),
]
LARGE = 2**25  # elements from which the bandwidth targets apply

DROPOUT_P = 0.1


class Case:
    """One op: the function of each provider, the tensors it needs, and the bytes it moves."""

    def __init__(self, name, ours, eager, inputs, fwd_bytes, bwd_bytes):
        self.name, self.ours, self.eager = name, ours, eager
        self.inputs, self.fwd_bytes, self.bwd_bytes = inputs, fwd_bytes, bwd_bytes


def cases(rows, cols, dtype):
    """Cases for one shape; ``inputs(requires_grad)`` makes fresh tensors. Byte counts are in
    elements of ``dtype`` (x-sized tensors) and are multiplied out by the caller."""
    dev = "cuda"

    def x_only(requires_grad):
        return (torch.randn(rows, cols, device=dev, dtype=dtype, requires_grad=requires_grad),)

    def x_wb(requires_grad):
        x = torch.randn(rows, cols, device=dev, dtype=dtype, requires_grad=requires_grad)
        w = (1 + 0.1 * torch.randn(cols, device=dev, dtype=dtype)).requires_grad_(requires_grad)
        b = (0.1 * torch.randn(cols, device=dev, dtype=dtype)).requires_grad_(requires_grad)
        return x, w, b

    def x_b(requires_grad):
        x, _, b = x_wb(requires_grad)
        return x, b

    def x_res(requires_grad):
        x, _, b = x_wb(requires_grad)
        r = torch.randn(rows, cols, device=dev, dtype=dtype, requires_grad=requires_grad)
        return x, b, r

    def two(requires_grad):
        return x_only(requires_grad) + x_only(requires_grad)

    return [
        # softmax: fwd reads x, writes y; bwd reads y and dy, writes dx.
        Case("softmax", lambda x: cutlass_ext.softmax(x, -1), lambda x: torch.softmax(x, -1), x_only, 2, 3),
        # layer_norm: fwd reads x, writes y; bwd reads x, dy, writes dx (weight/bias grads are small).
        Case("layer_norm", lambda x, w, b: cutlass_ext.layer_norm(x, w, b),
             lambda x, w, b: F.layer_norm(x, (cols,), w, b), x_wb, 2, 3),
        Case("relu_layer_norm", lambda x, w, b: cutlass_ext.layer_norm(x, w, b, relu=True),
             lambda x, w, b: F.layer_norm(F.relu(x), (cols,), w, b), x_wb, 2, 3),
        # Dropout in torch stores a mask (eager) or regenerates it (compile); we regenerate it.
        Case("relu_layer_norm_dropout",
             lambda x, w, b: cutlass_ext.layer_norm(x, w, b, relu=True, dropout_p=DROPOUT_P),
             lambda x, w, b: F.dropout(F.layer_norm(F.relu(x), (cols,), w, b), DROPOUT_P), x_wb, 2, 3),
        # bias_act: fwd reads x, writes y; bwd reads x and dy, writes dx (bias grad is small). These
        # nominal counts serve every provider; relu's backward reads a saved mask in place of x
        # (and the residual) in ours and in torch.compile's.
        Case("bias_relu", lambda x, b: cutlass_ext.bias_act(x, b, "relu"), lambda x, b: F.relu(x + b), x_b, 2, 3),
        Case("bias_relu_residual", lambda x, b, r: cutlass_ext.bias_act(x, b, "relu", residual=r),
             lambda x, b, r: F.relu(x + b + r), x_res, 3, 4),
        Case("bias_gelu_residual", lambda x, b, r: cutlass_ext.bias_act(x, b, "gelu", residual=r),
             lambda x, b, r: F.gelu(x + b + r), x_res, 3, 4),
        Case("bias_silu", lambda x, b: cutlass_ext.bias_act(x, b, "silu"), lambda x, b: F.silu(x + b), x_b, 2, 3),
        # sum over rows (a bias gradient) and over columns; backward is a broadcast write.
        Case("sum_dim0", lambda x: cutlass_ext.sum(x, 0), lambda x: x.sum(0), x_only, 1, 1),
        Case("sum_dim1", lambda x: cutlass_ext.sum(x, -1), lambda x: x.sum(-1), x_only, 1, 1),
        # add: reads two, writes one; bwd passes dy through (no kernel in either provider).
        Case("add", lambda a, b: cutlass_ext.add(a, b), lambda a, b: a + b, two, 3, 0),
    ]


def run(args):
    torch.manual_seed(0)
    torch._dynamo.config.cache_size_limit = 1024
    timer = Timer(warmup=args.warmup, iters=args.iters)
    records = []
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        esize = torch.finfo(dtype).bits // 8
        for rows, cols in args.shapes:
            n = rows * cols
            src = torch.randn(rows, cols, device="cuda", dtype=dtype)
            dst = torch.empty_like(src)
            copy_us = timer.median_us(lambda: dst.copy_(src))
            copy_gbs = 2 * n * esize / copy_us * 1e-3
            for case in cases(rows, cols, dtype):
                if case.name not in args.ops:
                    continue
                for mode in args.modes:
                    if mode == "fwdbwd" and case.bwd_bytes == 0:
                        continue
                    rec = time_case(timer, case, mode, args.graphs, args.plain_launch)
                    bytes_moved = (case.fwd_bytes + (case.bwd_bytes if mode == "fwdbwd" else 0)) * n * esize
                    rec.update(dtype=dname, rows=rows, cols=cols, copy_gbs=copy_gbs,
                               gbs={p: bytes_moved / t * 1e-3 for p, t in rec["us"].items()})
                    rec["pct_copy"] = rec["gbs"]["cutlass_ext"] / copy_gbs
                    records.append(rec)
                    # Written after every case, so that an interrupted sweep keeps what it measured.
                    write_results("elementwise", {"cuda_graphs": args.graphs, "records": records,
                                                  "summary": summarize(records)["table"]}, args.out)
                    us = rec["us"]
                    print(f"{dname} {case.name:24s} {mode:6s} {rows:6d}x{cols:<6d} "
                          f"ours {us['cutlass_ext']:8.1f} us {rec['gbs']['cutlass_ext']:6.0f} GB/s "
                          f"({100 * rec['pct_copy']:3.0f}% of copy) | eager x{us['eager'] / us['cutlass_ext']:.2f} "
                          f"compile x{us['compile'] / us['cutlass_ext']:.2f}"
                          + (f" plain_launch x{us['plain_launch'] / us['cutlass_ext']:.2f}" if "plain_launch" in us else ""),
                          flush=True)
            del src, dst
            torch.cuda.empty_cache()
    summary = summarize(records)
    for line in summary["lines"]:
        print(line)
    payload = {"cuda_graphs": args.graphs, "records": records, "summary": summary["table"]}
    path = write_results("elementwise", payload, args.out)
    print(f"wrote {path}")


def time_case(timer, case, mode, graphs, plain_launch=False):
    grad_mode = mode == "fwdbwd"
    inputs = case.inputs(grad_mode)
    compiled = torch.compile(case.eager, dynamic=False)
    fns = {"cutlass_ext": case.ours, "eager": case.eager, "compile": compiled}
    with torch.no_grad():
        dy = torch.randn_like(case.eager(*inputs))

    def call(fn):
        if not grad_mode:
            def forward():
                with torch.no_grad():
                    fn(*inputs)
            return forward

        def step():
            for t in inputs:
                t.grad = None
            fn(*inputs).backward(dy)
        return step

    callables = {name: call(fn) for name, fn in fns.items()}
    if plain_launch:
        callables = with_plain_launch(callables, _runtime.dependent_launch)
    captured = []
    if graphs:
        for name, fn in callables.items():
            replay = graphed(name, fn)
            if replay is not None:
                callables[name] = replay
                captured.append(name)
    return {"op": case.name, "mode": mode, "graphed": captured, "us": timer.median_us_many(callables)}


def summarize(records):
    """Per op and mode: the worst and geometric-mean ratio against each peer (peer time / ours),
    and the share of copy bandwidth at large shapes."""
    table, lines = {}, ["", "op / mode / dtype: peer time / ours (min, geomean); % of copy at >= 2^25 elements"]
    keys = sorted({(r["op"], r["mode"], r["dtype"]) for r in records})
    for key in keys:
        rs = [r for r in records if (r["op"], r["mode"], r["dtype"]) == key]
        entry = {}
        for peer in ("eager", "compile"):
            ratios = [r["us"][peer] / r["us"]["cutlass_ext"] for r in rs]
            entry[f"vs_{peer}_min"], entry[f"vs_{peer}_geomean"] = min(ratios), geomean(ratios)
        large = [r["pct_copy"] for r in rs if r["rows"] * r["cols"] >= LARGE]
        entry["pct_copy_large_min"] = min(large) if large else None
        table["/".join(key)] = entry
        pct = f"{100 * entry['pct_copy_large_min']:.0f}%" if large else "-"
        lines.append(f"{'/'.join(key):40s} eager {entry['vs_eager_min']:.2f} {entry['vs_eager_geomean']:.2f} | "
                     f"compile {entry['vs_compile_min']:.2f} {entry['vs_compile_geomean']:.2f} | copy {pct}")
    return {"table": table, "lines": lines}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    all_ops = [c.name for c in cases(1, 1, torch.float32)]
    parser.add_argument("--ops", default=",".join(all_ops))
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--shapes", default=None, help="rowsxcols,... (default: the built-in set)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--graphs", action="store_true", help="time CUDA-graph replays of each call")
    parser.add_argument("--plain-launch", action="store_true",
                        help="also time cutlass_ext with its second kernels launched the usual way (provider plain_launch)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/elementwise-<device>.json)")
    args = parser.parse_args()
    args.ops = args.ops.split(",")
    args.modes = args.modes.split(",")
    args.dtypes = args.dtypes.split(",")
    unknown = [o for o in args.ops if o not in all_ops]
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {all_ops}")
    args.shapes = SHAPES if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    run(args)


if __name__ == "__main__":
    main()
