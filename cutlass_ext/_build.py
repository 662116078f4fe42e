"""Builds and loads the CUDA extension.

On first CUDA use the extension is compiled with ninja into a cache directory keyed by everything
that changes the binary (sources, kernel list, flags, torch, nvcc, CUTLASS, target archs); later
processes find the finished build and load it directly. ``pip install .`` with
``CUTLASS_EXT_BUILD_AOT=1`` runs the same build ahead of time and ships the result in the package.

Environment knobs (also listed by ``python -m cutlass_ext.info``):

=========================  ======================================================================
``CUTLASS_PATH``           a CUTLASS checkout (its ``include/`` is used first)
``CUDA_HOME``              the CUDA toolkit holding ``bin/nvcc`` (else ``CUDA_PATH``, ``PATH``)
``CUTLASS_EXT_ARCH``       target archs: ``90a`` (Hopper), ``80`` (Ampere, CUTLASS 2.x kernels only),
                           or both, e.g. ``90a,80`` (default: the current GPU's)
``CUTLASS_EXT_CACHE_DIR``  where builds are cached (default ``~/.cache/cutlass_ext``)
``MAX_JOBS``               parallel compile jobs (default: by cores and memory)
``CUTLASS_EXT_KERNELS``    selective build: comma-separated substrings of kernel names to keep
``CUTLASS_EXT_DEBUG``      ``1`` adds line info to device code and ``-g`` to host code
``CUTLASS_EXT_BUILD_AOT``  ``1`` makes ``pip install .`` build the extension into the package
=========================  ======================================================================
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from types import ModuleType

from . import _kernel_table

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
CSRC_DIR = PACKAGE_DIR / "csrc" if (PACKAGE_DIR / "csrc").is_dir() else REPO_DIR / "csrc"
MODULE_NAME = "cutlass_ext._C"
LIBRARY_FILE = "_C.so"
AOT_STAMP = "_C_build.json"
SUPPORTED_ARCHS = ("90a", "80")


def static_sources() -> tuple[str, ...]:
    """The hand-written translation units: every .cu and .cpp under csrc/ (the GEMM
    instantiations are generated from _kernel_table)."""
    return tuple(
        sorted(str(p.relative_to(CSRC_DIR)) for p in CSRC_DIR.rglob("*") if p.suffix in (".cu", ".cpp"))
    )


class BuildError(RuntimeError):
    """The extension cannot be built here; the message says what to install or set."""


# ------------------------------------------------------------------------------------------------
# Locating the toolchain and CUTLASS


@dataclasses.dataclass(frozen=True)
class CutlassLocation:
    include_dirs: tuple[str, ...]
    origin: str  # "CUTLASS_PATH", "third_party/cutlass" or "nvidia-cutlass wheel"


def _cutlass_checkout(root: Path) -> tuple[str, ...] | None:
    include = root / "include"
    if (include / "cutlass" / "cutlass.h").is_file():
        util = root / "tools" / "util" / "include"
        return (str(include),) + ((str(util),) if util.is_dir() else ())
    return None


def find_cutlass() -> CutlassLocation:
    """CUTLASS headers, looked up in order: ``$CUTLASS_PATH``, ``third_party/cutlass`` (a user
    checkout beside the package), then the ``nvidia-cutlass`` wheel."""
    env = os.environ.get("CUTLASS_PATH")
    if env:
        found = _cutlass_checkout(Path(env))
        if found is None:
            raise BuildError(
                f"CUTLASS_PATH={env} has no include/cutlass/cutlass.h; point it at a CUTLASS "
                "checkout or unset it to use the nvidia-cutlass wheel"
            )
        return CutlassLocation(found, "CUTLASS_PATH")
    found = _cutlass_checkout(REPO_DIR / "third_party" / "cutlass")
    if found is not None:
        return CutlassLocation(found, "third_party/cutlass")
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0]) / "source"
        found = _cutlass_checkout(root)
        if found is not None:
            return CutlassLocation(found, "nvidia-cutlass wheel")
    raise BuildError(
        "CUTLASS headers not found: `pip install nvidia-cutlass==4.2.0.0`, or set CUTLASS_PATH to a "
        "CUTLASS checkout, or clone CUTLASS into third_party/cutlass"
    )


def _is_toolkit(root: Path) -> bool:
    return (root / "bin" / "nvcc").is_file() and (root / "include" / "cuda_runtime_api.h").is_file()


def find_cuda_home() -> Path:
    """The CUDA toolkit: ``$CUDA_HOME``, ``$CUDA_PATH``, the one holding ``nvcc`` on PATH, or
    ``/usr/local/cuda``."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            if not _is_toolkit(Path(value)):
                raise BuildError(
                    f"{var}={value} has no bin/nvcc and include/cuda_runtime_api.h; point it at a CUDA "
                    "toolkit (12.3 or newer)"
                )
            return Path(value)
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    for root in candidates:
        if _is_toolkit(root):
            return root
    raise BuildError(
        "nvcc not found: install the CUDA toolkit (12.3 or newer, matching torch's CUDA major version) "
        "and set CUDA_HOME or put nvcc on PATH"
    )


def nvcc_version(cuda_home: Path) -> str:
    out = subprocess.run([str(cuda_home / "bin" / "nvcc"), "--version"], capture_output=True, text=True, check=True)
    match = re.search(r"release (\d+\.\d+), V([\d.]+)", out.stdout)
    return match.group(2) if match else out.stdout.strip().splitlines()[-1]


def parse_archs(spec: str) -> tuple[str, ...]:
    """``"90a"``, ``"sm_90a"``, ``"9.0a"`` and lists separated by ``;``, ``,`` or spaces."""
    archs = []
    for item in re.split(r"[;,\s]+", spec.strip()):
        if not item:
            continue
        arch = item.lower().removeprefix("sm_").removeprefix("compute_").replace(".", "")
        if not re.fullmatch(r"\d+[af]?", arch):
            raise BuildError(f"CUTLASS_EXT_ARCH entry {item!r} is not an arch like 90a")
        if arch == "90":
            arch = "90a"  # wgmma and setmaxnreg exist only in the arch-specific target
        if arch not in SUPPORTED_ARCHS:
            raise BuildError(
                f"CUTLASS_EXT_ARCH={spec!r}: arch {arch} is not supported; cutlass_ext builds for "
                "90a (Hopper) and 80 (Ampere; its code also runs on other 8.x GPUs)"
            )
        archs.append(arch)
    if not archs:
        raise BuildError(f"CUTLASS_EXT_ARCH={spec!r} names no arch")
    return tuple(dict.fromkeys(archs))


def arch_of_capability(major: int, minor: int) -> str:
    """The build target for a GPU: 90a for Hopper; 80 for every 8.x GPU (A100, A10, L4, RTX 30xx
    and 40xx run sm_80 code)."""
    arch = f"{major}{minor}"
    if arch == "90":
        return "90a"
    if major == 8:
        return "80"
    raise BuildError(
        f"this GPU is sm_{arch}; cutlass_ext's CUTLASS kernels need a Hopper (sm_90: H100, H200, GH200) "
        "or Ampere-generation (sm_8x) GPU. Other GPUs run the PyTorch reference path."
    )


def target_archs(device_capability: tuple[int, int] | None = None) -> tuple[str, ...]:
    env = os.environ.get("CUTLASS_EXT_ARCH")
    if env:
        return parse_archs(env)
    if device_capability is None:
        import torch

        if not torch.cuda.is_available():
            raise BuildError("no CUDA GPU is visible; set CUTLASS_EXT_ARCH=90a to build without one")
        device_capability = torch.cuda.get_device_capability()
    return (arch_of_capability(*device_capability),)


def gencode_flags(archs: tuple[str, ...]) -> list[str]:
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


# Memory budgeted per parallel compile job (default_jobs).
JOB_MEMORY_GIB = 7


def default_jobs() -> int:
    env = os.environ.get("MAX_JOBS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise BuildError(f"MAX_JOBS={env!r} must be a positive integer")
        return int(env)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = 8.0
    # A generated CUTLASS sm90 file of five 16-bit base units (ten kernels) peaked at 7.0 GB of
    # resident memory in nvcc's tools, one of two (four kernels) at 4.5 GB, one kernel at 3.4 GB
    # (GNU time on a development machine).
    return max(1, min(cpus, int(mem_gib // JOB_MEMORY_GIB)))


def cache_root() -> Path:
    env = os.environ.get("CUTLASS_EXT_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "cutlass_ext"


# ------------------------------------------------------------------------------------------------
# The build description


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    archs: tuple[str, ...]
    cuda_home: Path
    nvcc_version: str
    cutlass: CutlassLocation
    kernels: tuple[_kernel_table.GemmKernel, ...]
    kernel_filter: str
    debug: bool
    torch_version: str
    torch_include_dirs: tuple[str, ...]
    torch_library_dirs: tuple[str, ...]
    cxx11_abi: bool
    python_include: str
    # Test builds (CUTLASS_EXT_CPU_AUTOGRAD=1): the C++ autograd nodes also serve CPU tensors, so
    # that a machine without a GPU can run them against the reference kernels.
    cpu_autograd: bool = False

    @classmethod
    def from_environment(cls, device_capability: tuple[int, int] | None = None) -> "BuildConfig":
        import torch
        import torch.utils.cpp_extension as cpp_extension

        archs = target_archs(device_capability)
        cuda_home = find_cuda_home()
        kernel_filter = os.environ.get("CUTLASS_EXT_KERNELS", "")
        return cls(
            archs=archs,
            cuda_home=cuda_home,
            nvcc_version=nvcc_version(cuda_home),
            cutlass=find_cutlass(),
            kernels=tuple(_kernel_table.select_kernels(kernel_filter, archs)),
            kernel_filter=kernel_filter,
            debug=os.environ.get("CUTLASS_EXT_DEBUG", "") == "1",
            torch_version=torch.__version__,
            torch_include_dirs=tuple(cpp_extension.include_paths()),
            torch_library_dirs=tuple(cpp_extension.library_paths()),
            cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
            python_include=sysconfig.get_paths()["include"],
            cpu_autograd=os.environ.get("CUTLASS_EXT_CPU_AUTOGRAD", "") == "1",
        )

    def nvcc_flags(self) -> list[str]:
        flags = [
            "-std=c++17", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-Xcompiler=-fPIC",
            f"-I{CSRC_DIR}",
        ]
        flags += [f"-I{d}" for d in self.cutlass.include_dirs]
        if self.debug:
            flags.append("-lineinfo")
        return flags

    def cxx_flags(self) -> list[str]:
        flags = [
            "-std=c++17", "-O2", "-fPIC", "-DNDEBUG",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(self.cxx11_abi)}",
            "-DTORCH_EXTENSION_NAME=_C", "-DTORCH_API_INCLUDE_EXTENSION_H",
            f"-I{CSRC_DIR}", f"-I{self.cuda_home / 'include'}", f"-I{self.python_include}",
        ]
        flags += [f"-isystem{d}" for d in self.torch_include_dirs]
        if self.debug:
            flags.append("-g")
        if self.cpu_autograd:
            flags.append("-DCUTLASS_EXT_AUTOGRAD_ON_CPU")
        return flags

    def ldflags(self) -> list[str]:
        flags = ["-shared"]
        for d in self.torch_library_dirs:
            flags += [f"-L{d}", f"-Wl,-rpath,{d}"]
        cuda_lib = self.cuda_home / "lib64"
        flags += [f"-L{cuda_lib}", f"-Wl,-rpath,{cuda_lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-lcudart"]
        return flags

    def key(self) -> str:
        """Hash of everything that changes the built library."""
        h = hashlib.sha256()
        for path in sorted(CSRC_DIR.rglob("*")):
            if path.is_file() and path.suffix in (".h", ".cuh", ".cu", ".cpp"):
                h.update(str(path.relative_to(CSRC_DIR)).encode())
                h.update(path.read_bytes())
        for group in _kernel_table.translation_units(list(self.kernels)).values():
            h.update(_kernel_table.unit_source(group).encode())
        h.update(_kernel_table.registry_source(list(self.kernels)).encode())
        version_h = Path(self.cutlass.include_dirs[0]) / "cutlass" / "version.h"
        if version_h.is_file():
            h.update(version_h.read_bytes())
        for part in (self.archs, self.nvcc_version, self.torch_version, sys.version, self.nvcc_flags(),
                     self.cxx_flags(), self.ldflags()):
            h.update(repr(part).encode())
        return h.hexdigest()[:20]

    def build_dir(self, root: Path | None = None) -> Path:
        torch_tag = self.torch_version.replace("+", "_")
        return (root or cache_root()) / f"torch{torch_tag}-cuda{self.nvcc_version}-sm{'_'.join(self.archs)}-{self.key()}"


# Compile seconds of one translation unit in a full build (16 jobs on an H200 machine, ninja's
# log, two base units a file: bench/results/build-two-units-h200.json), rounded, to list the
# longest first: a CUTLASS 3.x file took ~56 s for one base unit and ~90 s (16-bit) or ~75 s
# (TF32) for two, the layer-norm kernels 75-96 s, a CUTLASS 2.x file 22-44 s, a hand-written
# source otherwise 1-40 s and a generated hand-written GEMM family 6-25 s. Replayed on 16 slots,
# an earlier such log's jobs in this order ended 25 s (8%) sooner than with the hand-written
# sources first, as they were listed before (the layer-norm kernels then started at the front but
# the CUTLASS 3.x units, the bulk, only after the other sources; bench/NOTES.md section 45). With
# five base units a file (bench/results/build-h200.json) the Hopper files took 117-169 s.
COMPILE_SECONDS = {
    "simt": 42.0, "sm80": 34.0,  # generated CUTLASS 2.x files, by kernel family
    "generated": 20.0,  # a generated hand-written GEMM family (lowk, gemv, ffma, ...)
    "elementwise/layer_norm_kernels.cu": 96.0,
    "source": 30.0,  # any other hand-written source
}
# A CUTLASS 3.x file's estimate by unit class: its first base unit, and each further one.
CUTLASS3_FILE_SECONDS = {"sm90_16bit": (56.0, 30.0), "sm90_16bit_no_start_wait": (56.0, 30.0),
                         "sm90_tf32": (57.0, 19.0), "sm90_tf32_no_start_wait": (57.0, 19.0)}


def source_seconds(rel: str) -> float:
    """The estimated compile time of the hand-written source ``rel`` (under csrc/)."""
    return COMPILE_SECONDS.get(rel, COMPILE_SECONDS["source"])


def static_object(rel: str) -> str:
    """The object file of the hand-written source ``rel`` (under csrc/), relative to the build dir."""
    return "obj/" + rel.replace("/", "_").rsplit(".", 1)[0] + ".o"


def unit_seconds(group: list) -> float:
    """The estimated compile time of a generated file of ``group``'s kernels (COMPILE_SECONDS,
    CUTLASS3_FILE_SECONDS)."""
    first = group[0]
    if first.hand_written:
        return COMPILE_SECONDS["generated"]
    if first.unit_class in CUTLASS3_FILE_SECONDS:
        alone, each_more = CUTLASS3_FILE_SECONDS[first.unit_class]
        return alone + each_more * (len({k.base_unit for k in group}) - 1)
    return COMPILE_SECONDS[first.family]


def write_build_tree(config: BuildConfig, build_dir: Path) -> Path:
    """Writes the generated sources and build.ninja; returns the path of the library to build."""
    gen_dir = build_dir / "gen"
    gen_dir.mkdir(parents=True, exist_ok=True)

    def write_if_changed(path: Path, text: str) -> None:
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)

    # Ninja starts the compile jobs in the order build.ninja lists them, so they are listed by
    # their expected compile time, longest first (source_seconds, unit_seconds), the hand-written
    # sources before generated units of the same estimate.
    jobs: list[tuple[float, str, str]] = []
    for rel in static_sources():
        src = CSRC_DIR / rel
        obj = static_object(rel)
        if src.suffix == ".cu":
            rule = f"build {obj}: nvcc {src}\n  arch_flags = {' '.join(gencode_flags(config.archs))}\n"
        else:
            rule = f"build {obj}: cxx {src}\n"
        jobs.append((source_seconds(rel), rule, obj))
    for name, group in _kernel_table.translation_units(list(config.kernels)).items():
        src = gen_dir / f"{name}.cu"
        write_if_changed(src, _kernel_table.unit_source(group))
        obj = f"obj/{name}.o"
        # Relative to the build directory (ninja runs in it): a build tree copied under another
        # name keeps its commands, and so its up-to-date objects.
        rule = f"build {obj}: nvcc gen/{src.name}\n  arch_flags = {' '.join(group[0].gencodes(config.archs))}\n"
        jobs.append((unit_seconds(group), rule, obj))
    jobs.sort(key=lambda job: -job[0])  # stable: equal estimates keep the listing's order
    rules = [rule for _, rule, _ in jobs]
    objects = [obj for _, _, obj in jobs]
    registry = gen_dir / "gemm_registry.cpp"
    write_if_changed(registry, _kernel_table.registry_source(list(config.kernels)))
    rules.append(f"build obj/gemm_registry.o: cxx gen/{registry.name}\n")
    objects.append("obj/gemm_registry.o")

    nvcc = config.cuda_home / "bin" / "nvcc"
    cxx = os.environ.get("CXX", "c++")
    ninja = (
        "# Generated by cutlass_ext/_build.py. Do not edit.\n"
        "ninja_required_version = 1.3\n"
        f"nvcc = {nvcc}\n"
        f"cxx = {cxx}\n"
        f"nvcc_flags = {' '.join(config.nvcc_flags())}\n"
        f"cxx_flags = {' '.join(config.cxx_flags())}\n"
        f"ldflags = {' '.join(config.ldflags())}\n\n"
        "rule nvcc\n"
        "  command = $nvcc $nvcc_flags $arch_flags -MD -MF $out.d -c $in -o $out\n"
        "  depfile = $out.d\n  deps = gcc\n  description = NVCC $out\n\n"
        "rule cxx\n"
        "  command = $cxx $cxx_flags -MMD -MF $out.d -c $in -o $out\n"
        "  depfile = $out.d\n  deps = gcc\n  description = CXX $out\n\n"
        "rule link\n"
        "  command = $cxx $in $ldflags -o $out\n  description = LINK $out\n\n"
        + "\n".join(rules)
        + f"\nbuild {LIBRARY_FILE}: link {' '.join(objects)}\n"
        + f"default {LIBRARY_FILE}\n"
    )
    write_if_changed(build_dir / "build.ninja", ninja)
    return build_dir / LIBRARY_FILE


def find_ninja() -> str:
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the PyPI package ships the binary

        return str(Path(ninja.BIN_DIR) / "ninja")
    except ImportError as exc:
        raise BuildError("ninja not found: `pip install ninja`") from exc


def run_build(config: BuildConfig, build_dir: Path, jobs: int | None = None, verbose: bool = False) -> Path:
    """Builds into ``build_dir`` (under a file lock, so concurrent processes build once)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        library = build_dir / LIBRARY_FILE
        if library.is_file():
            return library
        write_build_tree(config, build_dir)
        cmd = [find_ninja(), "-C", str(build_dir), "-j", str(jobs or default_jobs())]
        if verbose:
            cmd.append("-v")
        print(
            f"cutlass_ext: building {len(config.kernels)} GEMM kernels for sm_{'/'.join(config.archs)} "
            f"in {build_dir} (one time; later runs load the cache)",
            file=sys.stderr,
            flush=True,
        )
        result = subprocess.run(cmd, capture_output=not verbose, text=True)
        if result.returncode != 0:
            log = build_dir / "build.log"
            log.write_text((result.stdout or "") + (result.stderr or ""))
            tail = "\n".join(((result.stdout or "") + (result.stderr or "")).splitlines()[-40:])
            raise RuntimeError(f"cutlass_ext: the extension build failed (full log: {log}):\n{tail}")
        return library


def import_library(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[MODULE_NAME] = module
    return module


def aot_library() -> tuple[Path, dict] | None:
    """The library shipped by an ahead-of-time ``pip install``, if any."""
    stamp = PACKAGE_DIR / AOT_STAMP
    library = PACKAGE_DIR / LIBRARY_FILE
    if stamp.is_file() and library.is_file():
        return library, json.loads(stamp.read_text())
    return None


def build_aot(output_dir: Path) -> Path:
    """Builds for ``CUTLASS_EXT_ARCH`` (default 90a, no GPU needed) and copies the library and a
    stamp into ``output_dir``. Used by setup.py."""
    config = BuildConfig.from_environment(device_capability=(9, 0))
    library = run_build(config, config.build_dir(), verbose=True)
    output_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(library, output_dir / LIBRARY_FILE)
    stamp = {"archs": list(config.archs), "torch": config.torch_version, "key": config.key(),
             "kernels": [k.name for k in config.kernels]}
    (output_dir / AOT_STAMP).write_text(json.dumps(stamp, indent=1))
    return output_dir / LIBRARY_FILE


# ------------------------------------------------------------------------------------------------
# Loading (once per process)

_lock = threading.Lock()
_module: ModuleType | None = None
_unavailable: BuildError | None = None


def load() -> ModuleType:
    """The extension module, built first if needed. Raises BuildError when this machine cannot
    build or run it (the message says what to install or set)."""
    global _module, _unavailable
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        if _unavailable is not None:
            raise _unavailable
        import torch

        try:
            capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
            if capability is not None:
                arch_of_capability(*capability)  # raises for GPUs without kernels
            shipped = aot_library()
            if shipped is not None and shipped[1].get("torch") == torch.__version__:
                _module = _attach(import_library(shipped[0]))
                return _module
            config = BuildConfig.from_environment(capability)
            build_dir = config.build_dir()
            library = build_dir / LIBRARY_FILE
            if not library.is_file():
                library = run_build(config, build_dir)
            _module = _attach(import_library(library))
            return _module
        except BuildError as exc:
            _unavailable = exc
            raise


def _attach(module: ModuleType) -> ModuleType:
    """Hands the freshly loaded module its run-time settings (the GEMM tuning table)."""
    from . import tuning

    tuning.attach(module)
    return module


def status() -> str:
    """One line: loaded, or why not (without building)."""
    if _module is not None:
        return f"loaded from {_module.__file__}"
    if _unavailable is not None:
        return f"unavailable: {_unavailable}"
    return "not loaded yet (built on first CUDA use)"
