"""Timing and reporting shared by the benchmarks: median of CUDA-event timings with the L2 cache
flushed before every timed call, and a JSON record with device, torch version and commit."""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def warm_up_gpu(seconds: float = 1.0) -> None:
    """Keeps the GPU busy for ``seconds`` so that its clocks have ramped up before the first
    timing: from idle, an H200 timed the first shapes of a sweep up to 2.7x slow (cuBLAS at
    M = 1, 4096x4096: 53.7 us in the first row, 19 us once warm)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


FLUSH_MODES = ("zero", "read")
# What runs (untimed) before each timed call's flush: nothing, or a 4096^3 bf16 GEMM.
PRECEDE_MODES = ("none", "gemm")


class Timer:
    """``flush`` says how L2 is emptied before every timed call: "zero" writes a buffer larger than
    L2, which leaves L2 full of dirty lines whose write-back lands on the timed call; "read" reads
    it, which leaves clean lines. Memory-bound calls read 10-25% slower after "zero" (bench/NOTES.md
    sections 32 and 33), and not by the same amount for every kernel."""

    def __init__(self, warmup: int = 5, iters: int = 30, flush: str = "zero", sustain: float = 0.0,
                 precede: str = "none"):
        """``sustain`` > 0 times each provider in blocks of its own instead of round-robin
        (``block_order``): ``sustain`` seconds of untimed calls, then its samples.

        ``precede`` = "gemm" runs a 4096^3 bf16 GEMM (untimed) before each timed call's flush, so
        that every sample follows the same kind of kernel. In round-robin order a sample follows
        the previous provider's call, and a compute-bound call ran up to 9% slower right after a
        power-hungry GEMM (cuBLAS's product of the same shape, or a 4096^3 one) than after an
        elementwise kernel or itself (H200, 1024 x 4096 -> 1024: 23.4-23.7 against 21.5-21.6 us;
        bench/NOTES.md section 51). An order in which every provider follows a GEMM (the benches'
        own) is not biased by it; an A/B whose providers follow different kinds of kernels is."""
        if flush not in FLUSH_MODES:
            raise ValueError(f"flush must be one of {FLUSH_MODES}, got {flush!r}")
        if sustain < 0:
            raise ValueError(f"sustain must be >= 0 seconds, got {sustain}")
        if precede not in PRECEDE_MODES:
            raise ValueError(f"precede must be one of {PRECEDE_MODES}, got {precede!r}")
        self.warmup = warmup
        self.iters = iters
        self.flush = flush
        self.sustain = sustain
        self._precede_operands = None
        if precede == "gemm":
            self._precede_operands = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16),
                                      torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16))
        # Larger than any Hopper L2 (50-60 MB): writing or reading it evicts the previous call's inputs.
        self._flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        if flush == "read":
            self._flush.fill_(1)
        self._warm = False

    def _empty_l2(self) -> None:
        if self.flush == "zero":
            self._flush.zero_()
        else:
            torch.amax(self._flush)

    def median_us(self, fn) -> float:
        return self.median_us_many({"fn": fn})["fn"]

    def _sample(self, fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if self._precede_operands is not None:
            torch.mm(*self._precede_operands)
        self._empty_l2()
        start.record()
        fn()
        end.record()
        return start, end

    def median_us_many(self, fns: dict) -> dict:
        """Median time of each callable. Round-robin by default (one call of each per round), so
        that clock changes during the run affect every provider alike. With ``sustain``, in
        blocks: under a power cap round-robin times each provider in the heat of the others,
        which flatters the one that draws more (bench/NOTES.md section 44)."""
        if not self._warm:
            warm_up_gpu()
            self._warm = True
        for fn in fns.values():
            for _ in range(self.warmup):
                fn()
        events = {name: [] for name in fns}
        if self.sustain > 0:
            for name, samples in block_order(list(fns), self.iters):
                fn = fns[name]
                start = time.perf_counter()
                while time.perf_counter() - start < self.sustain:
                    for _ in range(4):
                        self._empty_l2()
                        fn()
                    torch.cuda.synchronize()
                events[name] += [self._sample(fn) for _ in range(samples)]
                torch.cuda.synchronize()
        else:
            for _ in range(self.iters):
                for name, fn in fns.items():
                    events[name].append(self._sample(fn))
        torch.cuda.synchronize()
        out = {}
        for name, pairs in events.items():
            times = sorted(s.elapsed_time(e) * 1e3 for s, e in pairs)
            out[name] = times[len(times) // 2]
        return out


def operand_copies(*operands) -> list:
    """``operands`` and fresh copies of them, enough sets that together they hold twice L2: in a
    chain of calls over the sets in turn, no call finds its operands in L2 from an earlier one."""
    l2 = torch.cuda.get_device_properties(operands[0].device).L2_cache_size
    per_set = sum(t.numel() * t.element_size() for t in operands)
    count = max(2, -(-2 * l2 // per_set))
    return [tuple(operands)] + [tuple(t.clone() for t in operands) for _ in range(count - 1)]


def add_timer_arguments(parser, iters: int, flush: bool = True) -> None:
    """The timing options of a benchmark's command line (``timer_from_args`` reads them):
    --iters, --flush (where ``flush``) and --sustain."""
    parser.add_argument("--iters", type=int, default=iters)
    if flush:
        parser.add_argument("--flush", default="zero", choices=FLUSH_MODES,
                            help="how L2 is emptied before each timed call (zero: write a buffer, read: read it)")
    parser.add_argument("--precede", default="none", choices=PRECEDE_MODES,
                        help="what runs untimed before each timed call's flush (gemm: a 4096^3 bf16 GEMM, so that "
                             "every sample follows the same kind of kernel; default none)")
    parser.add_argument("--sustain", type=float, default=0.0,
                        help="seconds of untimed calls before each provider's block of samples; the providers "
                             "then run in blocks (in order, then in reverse) instead of taking turns, which times "
                             "each at its own clock under the GPU's power cap (default 0: take turns)")


def timer_from_args(args) -> Timer:
    return Timer(iters=args.iters, flush=getattr(args, "flush", "zero"), sustain=args.sustain,
                 precede=getattr(args, "precede", "none"))


def timer_settings(args) -> dict:
    """The timing options of ``add_timer_arguments`` as a benchmark's JSON records them (flush only
    where the command line has it)."""
    settings = {"flush": args.flush} if hasattr(args, "flush") else {}
    return {**settings, "sustain_s": args.sustain, "precede": args.precede}


def block_order(names: list, iters: int) -> list:
    """(name, samples) blocks for sustained timing: the providers in order and then in reverse,
    ``iters`` samples each split over its two blocks, so that a drift linear in time (the GPU
    warming up) weighs on every provider alike."""
    first = (iters + 1) // 2
    return [(n, first) for n in names] + [(n, iters - first) for n in reversed(names) if iters - first > 0]


def graphed(name, fn):
    """``fn`` captured in a CUDA graph after warm-up runs on a side stream (one-time work such as
    compilation and allocator growth stays out of the graph); returns its replay, or None when
    the provider cannot be captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # noqa: BLE001 - a provider that cannot be captured is left out, not fatal
        torch.cuda.synchronize()
        print(f"  {name}: not captured in a CUDA graph ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
        return None
    return graph.replay


def with_plain_launch(cases: dict, switch) -> dict:
    """``cases`` and a "plain_launch" case: the "cutlass_ext" case inside ``switch(False)`` (one of
    cutlass_ext.ops._runtime's dependent-launch switches), read as its kernels are launched or
    captured, so that one run times both launches in turn."""
    ours = cases["cutlass_ext"]

    def plain():
        with switch(False):
            ours()
    return {**cases, "plain_launch": plain}


def graphed_cases(cases: dict) -> dict:
    """Each case's replay from graphed(); a provider that cannot be captured is left out (graphed()
    says which)."""
    replays = {name: graphed(name, fn) for name, fn in cases.items()}
    return {name: replay for name, replay in replays.items() if replay is not None}


def commit() -> str:
    env = os.environ.get("CUTLASS_EXT_COMMIT")
    if env:
        return env
    try:
        root = Path(__file__).resolve().parent.parent
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_slug() -> str:
    return torch.cuda.get_device_name().replace("NVIDIA ", "").replace(" ", "-").lower()


def geomean(values) -> float:
    values = [v for v in values if v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def write_results(name: str, payload: dict, out: str | None = None) -> Path:
    record = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **payload,
    }
    path = Path(out) if out else RESULTS_DIR / f"{name}-{device_slug()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    return path
