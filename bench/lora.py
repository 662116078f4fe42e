"""Benchmark: a linear layer with a LoRA adapter (forward, forward+backward) and the adapter merge.

Layer providers (all on the same bf16 tensors; base weight and bias frozen, lora_A/lora_B trained):
  cutlass_ext   cutlass_ext.lora_linear(x, W, A, B, b, scaling=s, dropout_p=p)
  serial        the same with CUTLASS_EXT_LORA_OVERLAP=0: the backward's dA after the dx GEMM on one
                stream instead of beside it on a second one
  peft          PEFT's LoRA Linear layer (peft.tuners.lora.Linear, adapters in the base dtype), when installed
  peft_fp32     the same layer as get_peft_model makes it by default: float32 adapters over the 16-bit
                base (autocast_adapter_dtype=True), the input cast to float32 for the adapter's path
  peft_fp32_compile  torch.compile of that layer (one compile per shape)
  eager         F.linear(x, W, b) + F.linear(F.linear(dropout(x), A), B) * s   (what PEFT runs)
  compile       torch.compile of the eager formula (dynamic=True: one compile covers all shapes)
  base          the frozen base alone, F.linear(x, W, b); in fwd+bwd only dx is computed
Merge providers (each times a merge followed by an unmerge, under no_grad):
  cutlass_ext   cutlass_ext.lora_merge(W, A, B, s) then sign=-1
  peft          layer.merge() then layer.unmerge()
  peft_fp32     the same with PEFT's default float32 adapters
  eager         W += s * B @ A then W -= s * B @ A
  addmm         W.addmm_(B, A, alpha=s) then alpha=-s (torch's one-GEMM in-place form)

Shapes: r in {8, 16, 64}; (in, out) in {(4096, 4096), (4096, 11008), (11008, 4096)}; tokens in
{2048, 4096, 8192, 16384}. Median device-event timings with the L2 flushed before every call
(bench/_common.Timer). Writes bench/results/lora-<device>.json and prints one table per mode plus
the targets: fwd+bwd >= 1.8x PEFT, >= 1.4x torch.compile, <= 1.15x the frozen base; merge >= 3x PEFT.
With --graphs each layer case and merge pair is captured in a CUDA graph and replayed, which takes
the host's launch cost out of the timing (small token counts and the 4096 x 4096 merges are
host-bound without it); a provider that cannot be captured is left out with a message.

    python bench/lora.py
    python bench/lora.py --modes fwdbwd --ranks 16 --tokens 8192 --providers cutlass_ext,peft,base
    python bench/lora.py --graphs --modes fwd,fwdbwd --out bench/results/lora-graphs-h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (add_timer_arguments, geomean, graphed_cases, timer_from_args, timer_settings,  # noqa: E402
                     write_results)

import cutlass_ext  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LAYER_PROVIDERS = ("cutlass_ext", "serial", "peft", "peft_fp32", "peft_fp32_compile", "eager", "compile", "base")
MERGE_PROVIDERS = ("cutlass_ext", "peft", "peft_fp32", "eager", "addmm")
PEFT_PROVIDERS = ("peft", "peft_fp32")

# (mode, peer) -> minimum of peer time / cutlass_ext time; "base" is the other way round (ours may be
# at most 1.15x the frozen base's time).
TARGETS = {
    ("fwdbwd", "peft"): 1.8,
    ("fwdbwd", "compile"): 1.4,
    ("fwdbwd", "base"): 1 / 1.15,
    ("merge", "peft"): 3.0,
    ("fwdbwd", "peft_fp32"): 1.8,
    ("fwdbwd", "peft_fp32_compile"): 1.4,
    ("merge", "peft_fp32"): 3.0,
}


def eager_lora(x, w, b, a, bb, scaling: float, p: float):
    dropped = F.dropout(x, p) if p > 0 else x  # PEFT uses nn.Identity for p = 0
    return F.linear(x, w, b) + F.linear(F.linear(dropped, a), bb) * scaling


def make_peft_layer(w, b, a, bb, r, lora_alpha, p, fp32_adapters=False):
    """PEFT's LoRA Linear around an nn.Linear that shares w and b, adapters set to (a, bb), in
    their dtype or (fp32_adapters: PEFT's default for a 16-bit base) in float32; None when peft is
    not installed."""
    try:
        import peft
    except ImportError:
        return None

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(w.shape[1], w.shape[0], device="meta")
            self.proj.weight = nn.Parameter(w, requires_grad=False)
            self.proj.bias = nn.Parameter(b, requires_grad=False)

    config = peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=["proj"], lora_dropout=p)
    if fp32_adapters:
        model = peft.get_peft_model(Wrapper(), config)
    else:
        try:
            model = peft.get_peft_model(Wrapper(), config, autocast_adapter_dtype=False)
        except TypeError:  # peft older than autocast_adapter_dtype
            model = peft.get_peft_model(Wrapper(), config)
    layer = model.base_model.model.proj
    adapter_dtype = torch.float32 if fp32_adapters else a.dtype
    with torch.no_grad():
        layer.lora_A["default"].weight.data = a.detach().to(adapter_dtype, copy=True)
        layer.lora_B["default"].weight.data = bb.detach().to(adapter_dtype, copy=True)
    return layer


def layer_providers(wanted, scaling, p, peft_layers, compiled_eager):
    def ours(x, w, b, a, bb):
        return cutlass_ext.lora_linear(x, w, a, bb, b, scaling=scaling, dropout_p=p)

    def eager(x, w, b, a, bb):
        return eager_lora(x, w, b, a, bb, scaling, p)

    def base(x, w, b, a, bb):
        return F.linear(x, w, b)

    table = {"cutlass_ext": ours, "serial": ours, "eager": eager, "base": base}
    if "compile" in wanted:
        table["compile"] = lambda x, w, b, a, bb: compiled_eager(x, w, b, a, bb, scaling, p)
    for name, layer in peft_layers.items():
        table[name] = lambda x, w, b, a, bb, layer=layer: layer(x)
    if "peft_fp32_compile" in wanted and "peft_fp32" in peft_layers:
        compiled = torch.compile(peft_layers["peft_fp32"], dynamic=False)
        table["peft_fp32_compile"] = lambda x, w, b, a, bb: compiled(x)
    return {k: v for k, v in table.items() if k in wanted}


@contextlib.contextmanager
def lora_overlap_off(name):
    """CUTLASS_EXT_LORA_OVERLAP=0 within the block for the "serial" provider (read as the backward runs
    or is captured)."""
    if name != "serial":
        yield
        return
    previous = os.environ.get("CUTLASS_EXT_LORA_OVERLAP")
    os.environ["CUTLASS_EXT_LORA_OVERLAP"] = "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["CUTLASS_EXT_LORA_OVERLAP"]
        else:
            os.environ["CUTLASS_EXT_LORA_OVERLAP"] = previous


def layer_case(mode, name, fn, x, w, b, a, bb, grad, peft_layers):
    """A zero-argument callable: one forward (no autograd) or one forward+backward."""
    if mode == "fwd":
        def forward():
            with torch.no_grad():
                fn(x, w, b, a, bb)

        return forward
    trained = [x, a, bb]
    layer = peft_layers.get(name.removesuffix("_compile"))
    if layer is not None:
        trained = [x, layer.lora_A["default"].weight, layer.lora_B["default"].weight]

    def step():
        for t in trained:
            t.grad = None
        with lora_overlap_off(name):
            fn(x, w, b, a, bb).backward(grad)

    return step


def merge_cases(wanted, w, a, bb, scaling, peft_layers):
    def ours():
        cutlass_ext.lora_merge(w, a, bb, scaling)
        cutlass_ext.lora_merge(w, a, bb, scaling, sign=-1)

    def eager():
        w.add_(scaling * (bb @ a))
        w.sub_(scaling * (bb @ a))

    def addmm():
        w.addmm_(bb, a, alpha=scaling)
        w.addmm_(bb, a, alpha=-scaling)

    def with_no_grad(fn):
        def run():
            with torch.no_grad():
                fn()

        return run

    table = {"cutlass_ext": ours, "eager": eager, "addmm": addmm}
    for name, layer in peft_layers.items():
        table[name] = lambda layer=layer: (layer.merge(), layer.unmerge())
    return {k: with_no_grad(v) for k, v in table.items() if k in wanted}


def layer_flops(mode, m, k, n, r):
    fwd = 2 * m * n * k + 2 * m * r * (k + n)
    # backward: dx through the base (one GEMM) and the adapter's U, dx, dA, dB
    return fwd if mode == "fwd" else fwd + 2 * m * n * k + 4 * m * r * (k + n)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="fwd,fwdbwd,merge")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--ranks", default="8,16,64")
    parser.add_argument("--shapes", default="4096x4096,4096x11008,11008x4096", help="in x out")
    parser.add_argument("--tokens", default="2048,4096,8192,16384")
    parser.add_argument("--providers", default=",".join(sorted(set(LAYER_PROVIDERS + MERGE_PROVIDERS))))
    parser.add_argument("--lora-alpha", type=float, default=16)
    parser.add_argument("--dropout", type=float, default=0.0, help="lora_dropout of the layer cases")
    add_timer_arguments(parser, iters=10, flush=False)
    parser.add_argument("--graphs", action="store_true", help="time CUDA-graph replays of the layer cases and merges")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/lora.py needs a CUDA GPU")
        return 1

    dtype = DTYPES[args.dtype]
    modes = args.modes.split(",")
    ranks = [int(v) for v in args.ranks.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    tokens = [int(v) for v in args.tokens.split(",")]
    wanted = set(args.providers.split(","))
    timer = timer_from_args(args)
    # One compiled function for every case: shapes are dynamic, and the grad mode and the scaling
    # give a few recompiles, which must stay under dynamo's limit (past it, it silently runs eager).
    torch._dynamo.config.recompile_limit = 64
    compiled_eager = torch.compile(eager_lora, dynamic=True)
    rows = []
    total = len(shapes) * len(ranks) * (len(tokens) * len([m for m in modes if m != "merge"]) + ("merge" in modes))
    done = 0
    for k, n in shapes:
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5
        b = torch.randn(n, device="cuda", dtype=dtype)
        for r in ranks:
            scaling = args.lora_alpha / r
            a = (torch.randn(r, k, device="cuda", dtype=dtype) / k**0.5).requires_grad_()
            bb = (torch.randn(n, r, device="cuda", dtype=dtype) / r**0.5).requires_grad_()
            peft_layers = {}
            for name in PEFT_PROVIDERS:
                if name in wanted or (name == "peft_fp32" and "peft_fp32_compile" in wanted):
                    layer = make_peft_layer(w, b, a, bb, r, args.lora_alpha, args.dropout,
                                            fp32_adapters=name == "peft_fp32")
                    if layer is not None:  # peft installed
                        peft_layers[name] = layer.train()
            base_row = {"dtype": args.dtype, "K": k, "N": n, "r": r}
            for mode in (m for m in modes if m != "merge"):
                table = layer_providers(wanted, scaling, args.dropout, peft_layers, compiled_eager)
                for m in tokens:
                    x = torch.randn(m, k, device="cuda", dtype=dtype).requires_grad_(mode == "fwdbwd")
                    grad = torch.randn(m, n, device="cuda", dtype=dtype) if mode == "fwdbwd" else None
                    cases = {name: layer_case(mode, name, fn, x, w, b, a, bb, grad, peft_layers)
                             for name, fn in table.items()}
                    if args.graphs:
                        cases = graphed_cases(cases)
                    times = timer.median_us_many(cases)
                    flops = layer_flops(mode, m, k, n, r)
                    rows += [{**base_row, "mode": mode, "M": m, "provider": name, "median_us": us,
                              "tflops": flops / us / 1e6} for name, us in times.items()]
                    done += 1
                    print(f"[{done}/{total}] {mode} M={m} K={k} N={n} r={r}: "
                          + ", ".join(f"{p} {us:.0f}us" for p, us in times.items()), flush=True)
                    del x, grad
            if "merge" in modes:
                cases = merge_cases(wanted, w, a.detach(), bb.detach(), scaling, peft_layers)
                if args.graphs:
                    cases = graphed_cases(cases)
                times = timer.median_us_many(cases)
                rows += [{**base_row, "mode": "merge", "M": 0, "provider": name, "median_us": us,
                          "gbps": 4 * w.numel() * w.element_size() / us / 1e3}  # merge+unmerge: W read+written twice
                         for name, us in times.items()]
                done += 1
                print(f"[{done}/{total}] merge K={k} N={n} r={r}: "
                      + ", ".join(f"{p} {us:.0f}us" for p, us in times.items()), flush=True)
            del a, bb, peft_layers
        del w, b
    summary = summarize(rows)
    path = write_results("lora", {"cuda_graphs": args.graphs, **timer_settings(args), "rows": rows, "summary": summary,
                                  "targets": {f"{m}/{p}": t for (m, p), t in TARGETS.items()}}, args.out)
    print_tables(rows, summary)
    print(f"wrote {path}")
    return 0


def summarize(rows):
    """Per mode and peer: geomean and min of peer time / cutlass_ext time (> 1: cutlass_ext is faster),
    and the shapes that miss the mode's target for that peer."""
    keyed = {}
    for r in rows:
        keyed.setdefault((r["mode"], r["M"], r["K"], r["N"], r["r"]), {})[r["provider"]] = r["median_us"]
    out = {}
    for (mode, m, k, n, r), times in keyed.items():
        if "cutlass_ext" not in times:
            continue
        s = out.setdefault(mode, {"ratios": {}, "misses": []})
        for peer, t in times.items():
            if peer == "cutlass_ext":
                continue
            ratio = t / times["cutlass_ext"]
            s["ratios"].setdefault(peer, []).append(ratio)
            target = TARGETS.get((mode, peer))
            if target is not None and ratio < target:
                s["misses"].append({"peer": peer, "M": m, "K": k, "N": n, "r": r, "ratio": round(ratio, 3),
                                    "target": round(target, 3)})
    for mode, s in out.items():
        s["geomean"] = {peer: geomean(v) for peer, v in s["ratios"].items()}
        s["min"] = {peer: min(v) for peer, v in s["ratios"].items()}
        s["targets_met"] = {peer: all(m["peer"] != peer for m in s["misses"])
                            for (tm, peer) in TARGETS if tm == mode and peer in s["ratios"]}
        del s["ratios"]
    return out


def print_tables(rows, summary):
    keyed = {}
    for r in rows:
        keyed.setdefault(r["mode"], {}).setdefault((r["K"], r["N"], r["r"], r["M"]), {})[r["provider"]] = r
    for mode, cases in keyed.items():
        peers = sorted({p for by in cases.values() for p in by if p != "cutlass_ext"})
        print(f"\n== {mode}: time us (ratio = peer / cutlass_ext)")
        print(f"{'in':>6s} {'out':>6s} {'r':>3s} {'M':>6s} {'ours':>9s} " + " ".join(f"{p:>18s}" for p in peers))
        for (k, n, r, m), by in cases.items():
            ours = by.get("cutlass_ext")
            if ours is None:
                continue
            cells = " ".join(
                f"{by[p]['median_us']:10.1f} ({by[p]['median_us'] / ours['median_us']:5.2f})" if p in by else " " * 18
                for p in peers)
            print(f"{k:6d} {n:6d} {r:3d} {m:6d} {ours['median_us']:9.1f} {cells}")
    print("\ntargets: " + ", ".join(
        f"{m} {p} {'>=' if p != 'base' else '<='} {t if p != 'base' else 1 / t:.2f}x" for (m, p), t in TARGETS.items()))
    for mode, s in summary.items():
        met = ", ".join(f"{p} {'met' if ok else 'MISSED'}" for p, ok in s["targets_met"].items()) or "no targets"
        print(f"{mode}: geomean {', '.join(f'{p} {v:.3f}x' for p, v in s['geomean'].items())}; "
              f"min {', '.join(f'{p} {v:.3f}x' for p, v in s['min'].items())}; {met}; misses {len(s['misses'])}")


if __name__ == "__main__":
    sys.exit(main())
