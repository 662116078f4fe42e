"""How a GEMM config's time depends on how long it has run alone: the power cap's regime.

A large bf16 product drawn back to back runs into the GPU's power cap within 100-200 ms, and
from then on each kernel runs at the clock the cap leaves it, which differs between tiles by
10-15% (bench/NOTES.md sections 44 and 72). A timing of a few calls measures the boost clock
instead. Two experiments, linear + bias + ReLU (x @ W.T), bf16, with the config forced:

    python bench/tuning_regime.py warm     # each config alone for 0..1600 ms, then 10 timed calls
    python bench/tuning_regime.py tuner    # the autotuner's quick timing against a sustained one
    python bench/tuning_regime.py tuner --set mid   # the same on another bench/gemm_configs.py set
    python bench/tuning_regime.py configs --set small --rotate   # every config's verdict

``warm``: for each shape, warm-up length and config (the 128x128 ping-pong tile, the cooperative
128x256 one and the heuristic's pick): 0.4 s idle, back-to-back calls for the warm-up length,
then the median of 10 calls, with the SM clock and board power (NVML, when importable) read
right after. ``tuner``: every built config timed as the autotuner does (one warm-up call, the
median of 5 back to back) and the candidates within 15% of the quickest again, each alone for
200 ms before its 5 calls, and the package's autotuner (``cutlass_ext.tune()``) on an empty
table; then a verdict of the heuristic's config (found by the kernel it launches) and the three
picks, each distinct config once, as CUDA graphs of 20 calls (so that no product waits on the
host's launches), each replayed alone for 800 ms and then the median of 10 replays, in order and
reversed, averaged. ``configs``: that verdict for every built config that runs the shape (each
alone for --alone-ms, default 200), the heuristic's among them; with --rotate each call of a graph
takes the next of enough operand copies to hold twice L2 (bench/_common.operand_copies), so that
the weights stream from memory as in a model's step and in bench/linear.py's flushed timings.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import graphed, operand_copies, write_results  # noqa: E402
from gemm_configs import SHAPE_SETS  # noqa: E402

import cutlass_ext  # noqa: E402

WARM_SHAPES = [(16384, 4096, 11008), (4096, 4096, 11008), (16384, 4096, 4096), (8192, 8192, 8192)]
WARM_MS = [0, 25, 50, 100, 200, 400, 800, 1600]
WARM_CONFIGS = ["128x128_1x2_pp", "128x256_2x1_coop", None]  # None: the heuristic


def call_times_us(fn, reps: int, while_running=None) -> tuple:
    """The times of ``reps`` back-to-back calls, each between two events, sorted, and what
    ``while_running()`` returned: it runs after the calls are queued and before the wait for
    them (to read the GPU while it works)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    during = while_running() if while_running is not None else None
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) * 1e3 for s, e in events), during


def median_us(fn, reps: int) -> float:
    """Median of ``reps`` back-to-back calls."""
    times, _ = call_times_us(fn, reps)
    return times[reps // 2]


def run_alone(fn, ms: float) -> int:
    """Back-to-back calls of ``fn`` for ``ms`` milliseconds of wall time; returns how many."""
    start, calls = time.perf_counter(), 0
    while (time.perf_counter() - start) * 1e3 < ms:
        for _ in range(4):
            fn()
        calls += 4
        torch.cuda.synchronize()
    return calls


GRAPH_CALLS = 20  # calls in one captured graph of the verdict


def graphed_calls(name: str, fn, calls: int = GRAPH_CALLS):
    """The replay of a CUDA graph of ``calls`` back-to-back calls of ``fn`` (_common.graphed): its
    replays keep the GPU busy however short the kernel, where calls from Python leave it idle
    between kernels shorter than their own launch cost (a 256 x 4096 -> 4096 product read 81.6 us
    that way, several times its kernel)."""
    def calls_of_fn():
        for _ in range(calls):
            fn()
    replay = graphed(name, calls_of_fn)
    if replay is None:
        raise RuntimeError(f"config {name} could not be captured in a CUDA graph")
    return replay


def graph_median_us(replay, reps: int, calls: int = GRAPH_CALLS) -> float:
    """Median over ``reps`` back-to-back replays of a graphed_calls() graph of one call's time."""
    times, _ = call_times_us(replay, reps)
    return times[reps // 2] / calls


def clock_and_power():
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return (pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                pynvml.nvmlDeviceGetPowerUsage(handle) / 1000)
    except Exception:  # no NVML: the times alone
        return None, None


def kernel_names(fn) -> tuple:
    """The CUDA kernels one call of ``fn`` launches, from the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return tuple(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def operands(m: int, k: int, n: int):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    return x, w, b


def call(x, w, b, config, activation="relu"):
    return lambda: cutlass_ext.linear(x, w.t(), b, activation=activation, config=config)


def forward_configs(ext) -> list:
    """The built bf16 configs of the forward against a weight (bias + activation, no aux output)."""
    return [cfg for name, cfg in ext.kernels() if name.startswith("sm90_bf16_kk_bias_act_") and "_aux_" not in name]


def warm_experiment() -> list:
    rows = []
    for m, k, n in WARM_SHAPES:
        x, w, b = operands(m, k, n)
        for warm in WARM_MS:
            for config in WARM_CONFIGS:
                fn = call(x, w, b, config)
                fn()
                torch.cuda.synchronize()
                time.sleep(0.4)
                calls = run_alone(fn, warm)
                times, (clock, watts) = call_times_us(fn, 10, clock_and_power)
                row = dict(M=m, K=k, N=n, warm_ms=warm, config=config or "heuristic", median_us=times[5],
                           min_us=times[0], max_us=times[-1], sm_mhz=clock, watts=watts, warm_calls=calls)
                rows.append(row)
                print(row, flush=True)
    return rows


def tuner_experiment(shapes) -> list:
    ext = cutlass_ext.build()
    ext._configure_tuning("", False)  # an empty in-memory table: no config is tuned behind our back
    configs = forward_configs(ext)
    rows = []
    for m, k, n in shapes:
        x, w, b = operands(m, k, n)
        fns = {}
        for config in configs:
            fn = call(x, w, b, config)
            try:
                fn()
                fns[config] = fn
            except RuntimeError:  # not usable for this shape
                pass
        fns["heuristic"] = call(x, w, b, None)
        torch.cuda.synchronize()
        start = time.perf_counter()
        quick = {}
        for config, fn in fns.items():
            fn()
            quick[config] = median_us(fn, 5)
        quick_s = time.perf_counter() - start
        quickest = min(t for c, t in quick.items() if c != "heuristic")
        finalists = [c for c, t in quick.items() if c != "heuristic" and t <= 1.15 * quickest]
        start = time.perf_counter()
        sustained = {}
        for config in finalists:
            run_alone(fns[config], 200)
            sustained[config] = median_us(fns[config], 5)
        sustained_s = time.perf_counter() - start
        pick_quick = min((c for c in quick if c != "heuristic"), key=quick.get)
        pick_sustained = min(sustained, key=sustained.get)
        # The package's own autotuner on this bucket, from an empty table.
        start = time.perf_counter()
        with cutlass_ext.tune():
            fns["heuristic"]()
        torch.cuda.synchronize()
        package_s = time.perf_counter() - start
        entries = cutlass_ext.tuning.entries()
        # No entry: the package did not tune this bucket (its heuristic's kernel is a hand-written
        # one, outside the CUTLASS configs the autotuner chooses among, or there is one candidate).
        pick_package = next(iter(entries.values())) if entries else None
        ext._clear_tuning()
        # The heuristic's own config, by the kernel it launches, so that the verdict times each
        # kernel once: timed twice under two names, one kernel read up to 5.6% apart by its place
        # in the order (the first and last timings of the verdict).
        launched = {config: kernel_names(fn) for config, fn in fns.items()}
        pick_heuristic = next((c for c, names in launched.items()
                               if c != "heuristic" and names == launched["heuristic"]), "heuristic")
        pick_package = pick_package or pick_heuristic
        # Each config as CUDA graphs of GRAPH_CALLS calls, so that the GPU never waits on the
        # host: alone for 800 ms, then the median of 10 replays.
        verdict = {}
        names = list(dict.fromkeys([pick_heuristic, pick_quick, pick_sustained, pick_package]))
        replays = {config: graphed_calls(config, fns[config]) for config in names}
        for order in (names, names[::-1]):
            for config in order:
                run_alone(replays[config], 800)
                verdict.setdefault(config, []).append(graph_median_us(replays[config], 10))
        del replays
        verdict = {c: sum(v) / len(v) for c, v in verdict.items()}
        rows.append(dict(M=m, K=k, N=n, quick=quick, sustained=sustained, pick_heuristic=pick_heuristic,
                         pick_quick=pick_quick,
                         pick_sustained=pick_sustained, pick_package=pick_package, quick_s=quick_s,
                         sustained_s=sustained_s, package_s=package_s, verdict_us=verdict))
        print(m, k, n, "heuristic", pick_heuristic, "pick quick", pick_quick, "sustained", pick_sustained, "package", pick_package,
              f"({package_s:.2f} s)", "verdict",
              {c: round(t, 1) for c, t in verdict.items()}, f"cost {quick_s:.2f} + {sustained_s:.2f} s", flush=True)
    return rows


def configs_experiment(shapes, alone_ms: float, rotate: bool, activation: str = "relu") -> list:
    ext = cutlass_ext.build()
    ext._configure_tuning("", False)  # an empty in-memory table: the heuristic's own picks
    configs = forward_configs(ext)
    rows = []
    epilogue = None if activation == "none" else activation
    for m, k, n in shapes:
        first = operands(m, k, n)
        sets = operand_copies(*first) if rotate else [first]
        calls = min(max(GRAPH_CALLS, len(sets)), 128)

        def rotating(config):
            turn = itertools.cycle([call(*operand_set, config, epilogue) for operand_set in sets])
            return lambda: next(turn)()

        def once(config):
            return call(*first, config, epilogue)
        fns = {}
        for config in configs:
            try:
                once(config)()
                fns[config] = rotating(config)
            except RuntimeError:  # not usable for this shape
                pass
        torch.cuda.synchronize()
        launched = {config: kernel_names(once(config)) for config in fns}
        heuristic_kernels = kernel_names(once(None))
        pick_heuristic = next((c for c, names in launched.items() if names == heuristic_kernels), None)
        if pick_heuristic is None:  # a hand-written kernel outside the CUTLASS configs
            pick_heuristic = "heuristic"
            fns["heuristic"] = rotating(None)
        replays = {config: graphed_calls(config, fn, calls) for config, fn in fns.items()}
        names = list(replays)
        verdict = {}
        for order in (names, names[::-1]):
            for config in order:
                run_alone(replays[config], alone_ms)
                verdict.setdefault(config, []).append(graph_median_us(replays[config], 10, calls))
        del replays
        verdict = {c: sum(v) / len(v) for c, v in verdict.items()}
        best = min(verdict, key=verdict.get)
        rows.append(dict(M=m, K=k, N=n, activation=activation, operand_sets=len(sets), graph_calls=calls, pick_heuristic=pick_heuristic,
                         heuristic_kernels=list(heuristic_kernels), best=best,
                         heuristic_over_best=verdict[pick_heuristic] / verdict[best], verdict_us=verdict))
        print(m, k, n, "heuristic", pick_heuristic, f"{verdict[pick_heuristic]:.1f} us", "best", best,
              f"{verdict[best]:.1f} us", {c: round(t, 1) for c, t in sorted(verdict.items(), key=lambda i: i[1])},
              flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", choices=["warm", "tuner", "configs"])
    parser.add_argument("--set", default="large", choices=sorted(SHAPE_SETS),
                        help="the tuner experiment's shapes: a bench/gemm_configs.py set (default large)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", default=None,
                        help="the tuner experiment's shapes as MxKxN,... (instead of --set)")
    parser.add_argument("--alone-ms", type=float, default=200.0,
                        help="configs: how long each config's graph replays alone before its timing")
    parser.add_argument("--activation", default="relu", choices=["none", "relu", "gelu", "gelu_tanh", "silu"],
                        help="configs: the epilogue's activation (the forward without the aux output)")
    parser.add_argument("--rotate", action="store_true",
                        help="configs: each call takes the next of operand copies holding twice L2")
    args = parser.parse_args(argv)
    shapes = SHAPE_SETS[args.set]
    if args.shapes:
        shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    if args.experiment == "warm":
        rows, name = warm_experiment(), "gemm-tuning-regime"
    elif args.experiment == "tuner":
        rows, name = tuner_experiment(shapes), "gemm-tuning-sustained-prototype"
    else:
        rows, name = configs_experiment(shapes, args.alone_ms, args.rotate, args.activation), "gemm-configs-verdict"
    print(f"wrote {write_results(name, {'rows': rows}, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
