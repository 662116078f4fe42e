"""``python -m cutlass_ext.info``: what is built, for which arch, where the cache is, which ops
and kernel configs exist, and why CUDA ops would fall back to the PyTorch reference."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from . import __version__, _build, _kernel_table, tuning


def _try(fn):
    try:
        return fn(), None
    except _build.BuildError as exc:
        return None, str(exc)


def report(build: bool = False, list_kernels: bool = False) -> str:
    lines = [f"cutlass_ext {__version__}", f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
             f"Python {sys.version.split()[0]}"]
    capability = None
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        lines.append(f"GPU: {torch.cuda.get_device_name()} (sm_{capability[0]}{capability[1]})")
    else:
        lines.append("GPU: none visible (CUDA ops unavailable; CPU tensors use the reference kernels)")

    cutlass, err = _try(_build.find_cutlass)
    lines.append(f"CUTLASS: {cutlass.include_dirs[0]} (from {cutlass.origin})" if cutlass else f"CUTLASS: {err}")
    cuda_home, err = _try(_build.find_cuda_home)
    lines.append(f"nvcc: {cuda_home}/bin/nvcc ({_build.nvcc_version(cuda_home)})" if cuda_home else f"nvcc: {err}")
    archs, err = _try(lambda: _build.target_archs(capability or (9, 0)))
    lines.append(f"target archs: {', '.join('sm_' + a for a in archs)}" if archs else f"target archs: {err}")
    lines.append(f"cache dir: {_build.cache_root()}")
    lines.append(f"parallel jobs: {_build.default_jobs()}")
    kernel_filter = os.environ.get("CUTLASS_EXT_KERNELS", "")
    selected = _kernel_table.select_kernels(kernel_filter)
    lines.append(f"kernel filter (CUTLASS_EXT_KERNELS): {kernel_filter or '(none)'} -> "
                 f"{len(selected)} of {len(_kernel_table.all_kernels())} GEMM kernels")
    shipped = _build.aot_library()
    lines.append(f"ahead-of-time build: {shipped[0]} for {shipped[1]['archs']}" if shipped
                 else "ahead-of-time build: none (JIT on first CUDA use)")
    if cutlass and cuda_home and archs:
        config, err = _try(lambda: _build.BuildConfig.from_environment(capability or (9, 0)))
        if config:
            built = (config.build_dir() / _build.LIBRARY_FILE).is_file()
            lines.append(f"build dir: {config.build_dir()} ({'built' if built else 'not built yet'})")
    if build:
        try:
            _build.load()
        except _build.BuildError:
            pass
    lines.append(f"extension: {_build.status()}")
    if capability is not None:
        _, err = _try(lambda: _build.arch_of_capability(*capability))
        lines.append("CUDA tensors run: " + ("CUTLASS kernels" if err is None and cutlass and cuda_home
                                             else "the PyTorch reference (see the lines above)"))
    ops = sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("cutlass_ext::"))
    lines.append("ops: " + ", ".join(ops))
    tuned = tuning.tuning_file()
    count = len({line.split("\t")[0] for line in tuned.read_text().splitlines() if "\t" in line}) if tuned.is_file() else 0
    lines.append(f"GEMM tuning table: {tuned} ({count} buckets); autotune (CUTLASS_EXT_AUTOTUNE): "
                 f"{'on' if os.environ.get('CUTLASS_EXT_AUTOTUNE') == '1' else 'off'}")
    waiting = sum(k.waits_at_start for k in selected)
    if os.environ.get("CUTLASS_EXT_GEMM_DEPENDENT") != "0":
        lines.append(f"GEMM launch (CUTLASS_EXT_GEMM_DEPENDENT): on Hopper, {waiting} of the {len(selected)} kernels "
                     "(CUTLASS's sm90 ones but the stream-K and extended-K kernels) wait for the kernel before them "
                     "at their start and launch as its programmatic dependents where the binding's rule takes them "
                     "(dependent_launch_pays in csrc/bindings/gemm_select.h)")
    else:
        lines.append("GEMM launch (CUTLASS_EXT_GEMM_DEPENDENT): off, every GEMM launches the usual way")
    lines.append("GEMM configs:")
    for cfg in _kernel_table.all_configs():
        lines.append(f"  {cfg.name:24s} {cfg.use}")
    if list_kernels:
        lines.append("GEMM kernels in this build:")
        lines += [f"  {k.name}" + ("  (waits for the kernel before it at its start)" if k.waits_at_start else "")
                  for k in selected]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cutlass_ext.info", description=__doc__)
    parser.add_argument("--build", action="store_true", help="build (or load) the extension now")
    parser.add_argument("--kernels", action="store_true", help="list every GEMM kernel of the build")
    args = parser.parse_args(argv)
    print(report(build=args.build, list_kernels=args.kernels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
