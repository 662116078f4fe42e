"""The build system's logic: locating CUTLASS and nvcc, arch flags, cache keys, the generated build
tree and selective builds. The last test compiles a small selective build for real where nvcc and
CUTLASS are installed (no GPU needed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cutlass_ext import _build, _kernel_table

from .helpers import cuda_toolchain_available


@pytest.fixture
def clean_env(monkeypatch):
    for var in ("CUTLASS_PATH", "CUDA_HOME", "CUDA_PATH", "CUTLASS_EXT_ARCH", "CUTLASS_EXT_CACHE_DIR", "MAX_JOBS",
                "CUTLASS_EXT_KERNELS", "CUTLASS_EXT_DEBUG", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def fake_cutlass(root: Path) -> Path:
    (root / "include" / "cutlass").mkdir(parents=True)
    (root / "include" / "cutlass" / "cutlass.h").write_text("// fake\n")
    return root


def test_cutlass_path_comes_first(clean_env, tmp_path):
    fake_cutlass(tmp_path / "mine")
    clean_env.setenv("CUTLASS_PATH", str(tmp_path / "mine"))
    found = _build.find_cutlass()
    assert found.origin == "CUTLASS_PATH"
    assert found.include_dirs[0] == str(tmp_path / "mine" / "include")


def test_bad_cutlass_path_says_what_to_do(clean_env, tmp_path):
    clean_env.setenv("CUTLASS_PATH", str(tmp_path))
    with pytest.raises(_build.BuildError, match="CUTLASS_PATH=.*no include/cutlass/cutlass.h"):
        _build.find_cutlass()


def test_third_party_checkout_before_wheel(clean_env, tmp_path):
    fake_cutlass(tmp_path / "third_party" / "cutlass")
    clean_env.setattr(_build, "REPO_DIR", tmp_path)
    assert _build.find_cutlass().origin == "third_party/cutlass"


def test_wheel_is_the_fallback(clean_env, tmp_path):
    clean_env.setattr(_build, "REPO_DIR", tmp_path)
    found = _build.find_cutlass()
    assert found.origin == "nvidia-cutlass wheel"
    assert Path(found.include_dirs[0], "cutlass", "cutlass.h").is_file()


def test_missing_cutlass_names_the_fix(clean_env, tmp_path):
    clean_env.setattr(_build, "REPO_DIR", tmp_path)
    clean_env.setattr(_build.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(_build.BuildError, match="pip install nvidia-cutlass==4.2.0.0"):
        _build.find_cutlass()


def test_missing_nvcc_names_the_fix(clean_env):
    clean_env.setattr(_build, "_is_toolkit", lambda root: False)
    with pytest.raises(_build.BuildError, match="nvcc not found: install the CUDA toolkit"):
        _build.find_cuda_home()


def test_bad_cuda_home(clean_env, tmp_path):
    clean_env.setenv("CUDA_HOME", str(tmp_path))
    with pytest.raises(_build.BuildError, match="CUDA_HOME=.*no bin/nvcc"):
        _build.find_cuda_home()


@pytest.mark.parametrize("spec,expected", [("90a", ("90a",)), ("sm_90a", ("90a",)), ("9.0a", ("90a",)),
                                           ("90", ("90a",)), ("90a;90a", ("90a",)), ("80", ("80",)),
                                           ("sm_90a,sm_80", ("90a", "80"))])
def test_parse_archs(spec, expected):
    assert _build.parse_archs(spec) == expected


@pytest.mark.parametrize("spec,pattern", [("86", "not supported"), ("70", "not supported"), ("hopper", "not an arch"),
                                          (";", "names no arch")])
def test_parse_archs_rejects(spec, pattern):
    with pytest.raises(_build.BuildError, match=pattern):
        _build.parse_archs(spec)


def test_unsupported_gpu_is_explained():
    with pytest.raises(_build.BuildError, match="sm_75.*Hopper.*Ampere"):
        _build.arch_of_capability(7, 5)
    with pytest.raises(_build.BuildError, match="sm_100"):
        _build.arch_of_capability(10, 0)
    assert _build.arch_of_capability(9, 0) == "90a"
    # Every 8.x GPU runs the sm_80 build (CUTLASS 2.x kernels only).
    assert _build.arch_of_capability(8, 0) == _build.arch_of_capability(8, 6) == _build.arch_of_capability(8, 9) == "80"


def test_arch_env_overrides_device(clean_env):
    clean_env.setenv("CUTLASS_EXT_ARCH", "sm_90a")
    assert _build.target_archs((8, 6)) == ("90a",)
    assert _build.gencode_flags(("90a",)) == ["-gencode=arch=compute_90a,code=sm_90a"]


def test_jobs_and_cache_dir(clean_env, tmp_path):
    assert _build.default_jobs() >= 1
    clean_env.setenv("MAX_JOBS", "3")
    assert _build.default_jobs() == 3
    clean_env.setenv("MAX_JOBS", "many")
    with pytest.raises(_build.BuildError, match="MAX_JOBS"):
        _build.default_jobs()
    # Without MAX_JOBS: the cores, or fewer where memory runs out first (JOB_MEMORY_GIB a job).
    clean_env.delenv("MAX_JOBS")
    clean_env.setattr(_build.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 24 * 2**30 // 4096}
    clean_env.setattr(_build.os, "sysconf", lambda name: pages[name])
    assert _build.default_jobs() == 24 // _build.JOB_MEMORY_GIB
    pages["SC_PHYS_PAGES"] = 256 * 2**30 // 4096
    assert _build.default_jobs() == 16
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _build.cache_root() == tmp_path / "xdg" / "cutlass_ext"
    clean_env.setenv("CUTLASS_EXT_CACHE_DIR", str(tmp_path / "cache"))
    assert _build.cache_root() == tmp_path / "cache"


def _config(**changes):
    base = dict(
        archs=("90a",), cuda_home=Path("/opt/cuda"), nvcc_version="13.0.88",
        cutlass=_build.CutlassLocation(("/opt/cutlass/include",), "CUTLASS_PATH"),
        kernels=tuple(_kernel_table.all_kernels()), kernel_filter="", debug=False, torch_version="2.11.0",
        torch_include_dirs=("/opt/torch/include",), torch_library_dirs=("/opt/torch/lib",), cxx11_abi=True,
        python_include="/opt/python/include",
    )
    base.update(changes)
    return _build.BuildConfig(**base)


def test_cache_key_tracks_what_changes_the_binary():
    key = _config().key()
    assert key == _config().key()
    assert key != _config(debug=True).key()
    assert key != _config(torch_version="2.12.0").key()
    assert key != _config(nvcc_version="13.1.0").key()
    assert key != _config(kernels=tuple(_kernel_table.select_kernels("bf16"))).key()
    assert "-lineinfo" in _config(debug=True).nvcc_flags() and "-DNDEBUG" in _config(debug=True).nvcc_flags()


def test_build_tree(tmp_path):
    config = _config(kernels=tuple(_kernel_table.select_kernels("sm90_bf16_kk,sm80_bf16_kk,simt_f32_kk,lowk_bf16")))
    library = _build.write_build_tree(config, tmp_path)
    assert library == tmp_path / _build.LIBRARY_FILE
    ninja = (tmp_path / "build.ninja").read_text()
    unit_of = _kernel_table.unit_of(list(config.kernels))
    units = set(unit_of.values())
    for kernel in config.kernels:
        unit = unit_of[kernel.name]
        source = (tmp_path / "gen" / f"{unit}.cu").read_text()
        assert source.startswith(_kernel_table.BANNER)
        assert source.count(f"DEFINE_GEMM({kernel.name},") + source.count(f"DEFINE_DIRECT_GEMM({kernel.name},") == 1
        # Relative to the build directory, so that a copied build tree keeps its objects.
        assert f"build obj/{unit}.o: nvcc gen/{unit}.cu\n" in ninja
    # The hand-written kernels of a family and dtype share one file; the CUTLASS instantiations
    # (a CUTLASS 3.x one with its fp16 twin, not built here) go base_units_per_file of their class
    # to a file.
    assert "lowk_bf16" in units
    cutlass = [k for k in config.kernels if not k.hand_written]
    bases = {}
    for kernel in cutlass:
        bases.setdefault(kernel.unit_class, set()).add(kernel.base_unit)
    assert set(bases) == {"sm90_16bit", "sm90_16bit_no_start_wait", "sm80_16bit", "simt_f32"}
    assert len(bases["sm90_16bit"]) > 2
    per_file = _kernel_table.base_units_per_file
    assert len(units) == 1 + sum(-(-len(b) // per_file(cls)) for cls, b in bases.items())
    assert sorted(p.stem for p in (tmp_path / "gen").glob("*.cu")) == sorted(units)
    static = _build.static_sources()
    assert "bindings/gemm.cpp" in static and "elementwise/activation_kernels.cu" in static
    hand_written_cu = [rel for rel in static if rel.endswith(".cu")]
    sm90 = [k for k in config.kernels if k.family == "sm90"]
    assert sm90 and len(sm90) < len(config.kernels)
    sm90_units = {unit_of[k.name] for k in sm90}
    assert ninja.count("-gencode=arch=compute_90a,code=sm_90a") == len(sm90_units) + len(hand_written_cu)
    # CUTLASS 2.x kernels (Ampere tensor cores, exact-fp32 SIMT) are compiled from compute_80, the
    # hand-written GEMMs from compute_90 (their sm_90 instructions: stmatrix).
    hand_written_units = {unit_of[k.name] for k in config.kernels if k.hand_written}
    assert hand_written_units and not hand_written_units & sm90_units
    assert ninja.count("-gencode=arch=compute_90,code=sm_90\n") == len(hand_written_units)
    assert ninja.count("-gencode=arch=compute_80,code=sm_90") == len(units) - len(sm90_units) - len(hand_written_units)
    for rel in static:
        rule = "nvcc" if rel.endswith(".cu") else "cxx"
        assert f"build {_build.static_object(rel)}: {rule}" in ninja
    assert "build obj/gemm_registry.o: cxx" in ninja
    # The compile jobs are listed longest first by their estimates (_build.unit_seconds): here
    # four CUTLASS 3.x files of five base units and one of three, the layer-norm kernels, a
    # CUTLASS 3.x file of two (the rest of the kernels that do not wait at their start), the
    # CUTLASS 2.x files, the other hand-written sources and last the hand-written GEMMs.
    listed = re.findall(r"^build (obj/\S+):", ninja, re.M)
    groups = _kernel_table.translation_units(list(config.kernels))
    estimate = {f"obj/{name}.o": _build.unit_seconds(group) for name, group in groups.items()}
    estimate.update({_build.static_object(rel): _build.source_seconds(rel) for rel in static})
    seconds = [estimate[obj] for obj in listed if obj != "obj/gemm_registry.o"]
    assert seconds == sorted(seconds, reverse=True) and len(seconds) == len(listed) - 1
    sm90_sizes = [len({k.base_unit for k in groups[obj[4:-2]]}) for obj in listed if obj.startswith("obj/sm90_")]
    assert sm90_sizes == [5, 5, 5, 5, 3, 2], sm90_sizes
    first_of = {kind: next(i for i, obj in enumerate(listed) if obj.startswith(kind))
                for kind in ("obj/sm90_", "obj/elementwise_layer_norm_kernels", "obj/sm80_", "obj/simt_",
                             "obj/bindings_gemm.o", "obj/lowk_")}
    last_sm90 = max(i for i, obj in enumerate(listed) if obj.startswith("obj/sm90_"))
    assert first_of["obj/sm90_"] == 0 and first_of["obj/elementwise_layer_norm_kernels"] == 5
    assert last_sm90 == 6
    assert first_of["obj/elementwise_layer_norm_kernels"] < first_of["obj/simt_"] < first_of["obj/sm80_"]
    assert first_of["obj/sm80_"] < first_of["obj/bindings_gemm.o"] < first_of["obj/lowk_"]
    assert "-D_GLIBCXX_USE_CXX11_ABI=1" in ninja and "-ltorch_python" in ninja
    registry = (tmp_path / "gen" / "gemm_registry.cpp").read_text()
    assert f"const int kNumGemmKernels = {len(config.kernels)};" in registry
    assert all(f'{{"{k.name}"' in registry for k in config.kernels)


def test_ampere_build_keeps_only_cutlass2_kernels(tmp_path):
    kernels = _kernel_table.select_kernels("", ("80",))
    assert kernels and {k.family for k in kernels} == {"sm80", "simt", "lowk", "gemv", "fewrows", "ffma", "wgrad",
                                                       "narrow"}
    assert {k.dtype for k in kernels if k.family == "sm80"} == {"bf16", "fp16", "tf32"}
    config = _config(archs=("80",), kernels=tuple(kernels))
    _build.write_build_tree(config, tmp_path)
    ninja = (tmp_path / "build.ninja").read_text()
    assert "compute_90a" not in ninja and "sm_90" not in ninja
    units = _kernel_table.translation_units(kernels)
    assert ninja.count("-gencode=arch=compute_80,code=sm_80") == len(units) + sum(
        rel.endswith(".cu") for rel in _build.static_sources())
    # A build for both targets compiles CUTLASS 2.x kernels for each.
    both = _kernel_table.select_kernels("sm80_fp16_kk", ("90a", "80"))
    assert both[0].gencodes(("90a", "80")) == ["-gencode=arch=compute_80,code=sm_90", "-gencode=arch=compute_80,code=sm_80"]
    # Hand-written GEMMs from each target's own virtual arch: sm_90 code keeps stmatrix.
    lowk = _kernel_table.select_kernels("lowk_bf16", ("90a", "80"))
    assert lowk and lowk[0].gencodes(("90a", "80")) == ["-gencode=arch=compute_90,code=sm_90",
                                                        "-gencode=arch=compute_80,code=sm_80"]


def test_units_group_base_units_of_one_class():
    """The bf16 and fp16 versions of a CUTLASS 3.x config form one base unit; tf32 and the other
    CUTLASS families' kernels are their own. A file holds base_units_per_file base units of one
    class (five for the Hopper classes, two for the others; the last of a class may hold fewer),
    named by the first and their count, and the hand-written ones alone; a selective build of one
    dtype writes only that dtype's kernels."""
    kernels = _kernel_table.all_kernels()
    units = _kernel_table.translation_units(kernels)
    assert sorted(k.name for group in units.values() for k in group) == sorted(k.name for k in kernels)
    alone = []
    for name, group in units.items():
        assert len({k.unit_class for k in group}) == 1 and len({k.family for k in group}) == 1
        bases = list(dict.fromkeys(k.base_unit for k in group))
        assert name == bases[0] + (f"__{len(bases)}_units" if len(bases) > 1 else "")
        for base in bases:
            members = [k for k in group if k.base_unit == base]
            if base.startswith("sm90_16bit_"):
                assert sorted(k.dtype for k in members) == ["bf16", "fp16"]
                assert len({k.name.replace(f"_{k.dtype}_", "_") for k in members}) == 1
            elif not group[0].hand_written:
                assert [k.name for k in members] == [base]
        if group[0].hand_written:
            assert len(bases) == 1
        else:
            per_file = _kernel_table.base_units_per_file(group[0].unit_class)
            assert per_file == (5 if group[0].family == "sm90" else 2)
            assert len(bases) <= per_file
            if len(bases) < per_file:
                alone.append(group[0].unit_class)
    assert len(alone) == len(set(alone))
    assert len(units) < len({k.base_unit for k in kernels})
    one = _kernel_table.translation_units(_kernel_table.select_kernels("sm90_fp16_kk_bias_act_128x128_1x2_pp"))
    assert list(one) == ["sm90_16bit_kk_bias_act_128x128_1x2_pp"]
    source = _kernel_table.unit_source(one["sm90_16bit_kk_bias_act_128x128_1x2_pp"])
    assert "sm90_fp16_kk_bias_act_128x128_1x2_pp," in source and "sm90_bf16_" not in source
    two = _kernel_table.translation_units(
        _kernel_table.select_kernels("sm90_fp16_kk_bias_act_128x128_1x2_pp,sm90_fp16_kk_bias_act_128x128_2x1"))
    assert list(two) == ["sm90_16bit_kk_bias_act_128x128_1x2_pp__2_units"]
    # A stream-K kernel (which does not wait for the prior grid at its start) is a unit of its own.
    apart = _kernel_table.translation_units(_kernel_table.select_kernels("sm90_fp16_kk_bias_act_128x128_1x"))
    assert list(apart) == ["sm90_16bit_kk_bias_act_128x128_1x2_pp", "sm90_16bit_kk_bias_act_128x128_1x1_coop_sk"]


def test_units_that_wait_for_the_prior_grid_at_their_start():
    """Every Hopper unit but the extended-K and stream-K ones defines CUTLASS_ENABLE_GDC_FOR_SM90
    (CUTLASS's kernels then wait for the prior grid at their start, and the binding launches them
    as programmatic dependents); an extended-K kernel, whose mainloop waits only before its second
    operand pair, or a stream-K one never shares a unit with them; other families never define it."""
    kernels = _kernel_table.all_kernels()
    assert any(k.ext_k for k in kernels) and any(k.waits_at_start for k in kernels)
    for group in _kernel_table.translation_units(kernels).values():
        source = _kernel_table.unit_source(group)
        waits = {k.waits_at_start for k in group}
        assert len(waits) == 1
        assert ("#define CUTLASS_ENABLE_GDC_FOR_SM90\n" in source) == waits.pop()
        if group[0].family == "sm90":
            assert {k.ext_k or k.config.stream_k for k in group} == {group[0].unit_class.endswith("_no_start_wait")}
            # The define precedes every header, so that CUTLASS's headers see it.
            assert source.index("#include") > source.find("#define CUTLASS_ENABLE_GDC_FOR_SM90")
        else:
            assert not group[0].waits_at_start


def test_short_k_units_instantiate_the_epilogue_of_their_source():
    """The short-K kernels that add beta * C are the bundle's with-C twin (the fp32 staging
    epilogue); the others its warp-staged one, which takes no C."""
    lowk = [k for k in _kernel_table.all_kernels() if k.family == "lowk"]
    assert {k.with_c for k in lowk} == {False, True}
    for kernel in lowk:
        element = "cutlass::half_t" if kernel.dtype == "fp16" else "cutlass::bfloat16_t"
        expected = f"::cutlass_ext::lowk::GemmBundle<{element}, {str(kernel.with_c).lower()}>;"
        assert expected in kernel.definition(), kernel.definition()


def test_selective_build_and_kernel_table():
    names = [k.name for k in _kernel_table.all_kernels()]
    assert len(names) == len(set(names))
    assert _kernel_table.select_kernels(None) == _kernel_table.all_kernels()
    picked = _kernel_table.select_kernels("fp16, simt")
    assert picked and all("fp16" in k.name or "simt" in k.name for k in picked)
    assert _kernel_table.select_kernels("nothing-matches") == []
    assert "kNumGemmKernels = 0" in _kernel_table.registry_source([])
    units = _kernel_table.translation_units(_kernel_table.all_kernels())
    unit_of = _kernel_table.unit_of(_kernel_table.all_kernels())
    for kernel in _kernel_table.all_kernels():
        assert not (kernel.aux and kernel.a_major != "k")
        macro = "CUTLASS_EXT_DEFINE_DIRECT_GEMM" if kernel.hand_written else "CUTLASS_EXT_DEFINE_GEMM"
        assert f"{macro}({kernel.name}," in _kernel_table.unit_source(units[unit_of[kernel.name]])
        assert kernel.gemm_arch == (0 if kernel.hand_written else 90 if kernel.family == "sm90" else 80)


def test_config_names_are_unique_and_tf32_covers_its_training_layouts():
    # A config shared by several dtypes (the 64-row transposed tiles) is listed once, so a name
    # means one tile, stage depth and schedule whatever the dtype.
    names = _kernel_table.config_names()
    assert len(names) == len(set(names))
    by_name = {cfg.name: cfg for cfg in _kernel_table.all_configs()}
    # Every built kernel's config can be asked for by name (config=..., the benchmarks' sweeps).
    for kernel in _kernel_table.all_kernels():
        assert by_name[kernel.config.name] is kernel.config, kernel.name
    tf32 = [k for k in _kernel_table.all_kernels() if k.family == "sm90" and k.dtype == "tf32"]
    for kernel in tf32:
        assert by_name[kernel.config.name] is kernel.config
    transposed = {(k.a_major, k.b_major, k.aux, k.config.name) for k in tf32 if k.config.transposed}
    for tile in ("t64x32k128_pp", "t64x64_pp", "t64x128_pp"):
        # A weight's forward, with and without the pre-activation, and a row-major B.
        assert {("k", "k", False, tile), ("k", "k", True, tile), ("m", "k", False, tile)} <= transposed
    # TF32 weight gradients (an M-major A, an N-major B) run as K slices; its K-major A with an
    # N-major B is copied to K-major first, so it has no kernels of its own.
    assert [(k.a_major, k.b_major) for k in tf32 if k.k_slices] == [("m", "n")]
    assert not [k for k in tf32 if (k.a_major, k.b_major) == ("k", "n")]


def test_registry_rows_carry_cluster_size_and_occupancy_query():
    kernels = _kernel_table.all_kernels()
    src = _kernel_table.registry_source(kernels)
    rows = {line.strip().split('"')[1]: line for line in src.splitlines() if line.strip().startswith('{"')}
    for kernel in kernels:
        cfg = kernel.config
        cutlass3 = isinstance(cfg, _kernel_table.GemmConfig)
        tile = (cfg.tile_m, cfg.tile_n) if cutlass3 else cfg.tile
        cluster = cfg.cluster_m * cfg.cluster_n if cutlass3 else 1
        row = rows[kernel.name]
        assert f'"{cfg.name}", {tile[0]}, {tile[1]}, {cluster}, ' in row, row
        assert row.rstrip().endswith(f"&generated::{kernel.name}_active_clusters}},"), row
        assert f"int {kernel.name}_active_clusters();" in src
    # The heuristic weighs a wider-cluster kernel against the 1x2 ping-pong kernel of the same
    # dtype, layouts and epilogue, so every one has that counterpart.
    wide = [k for k in kernels if isinstance(k.config, _kernel_table.GemmConfig)
            and k.config.cluster_m * k.config.cluster_n > 2]
    assert wide
    for kernel in wide:
        assert kernel.name.replace(kernel.config.name, "128x128_1x2_pp") in rows


def _toolchain_available() -> bool:
    return cuda_toolchain_available() and shutil.which("c++") is not None


# Run in the built library's process (CUTLASS_EXT_CPU_AUTOGRAD=1): the C++ autograd nodes of softmax,
# layer_norm, bias_act (relu's masked form too), sum, add, lora_linear and linear (which serve CUDA
# tensors) run here on CPU tensors, with the reference kernels, against the same math written with
# torch ops in float64. Optional inputs are left out in some calls: an absent one shifts the
# autograd edges of those after it.
CPU_AUTOGRAD_CHECK = """
import torch.nn.functional as F
from cutlass_ext.ops import _activation
torch.manual_seed(0)
def grads(fn, inputs):
    inputs = [t.detach().requires_grad_() if t is not None else None for t in inputs]
    out = fn(*inputs)
    out.backward(torch.ones_like(out) + torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape) / out.numel())
    return out, [t.grad if t is not None else None for t in inputs], type(out.grad_fn).__name__
def check(name, ours_fn, ref_fn, inputs):
    out, ours, node = grads(ours_fn, inputs)
    ref_out, ref, _ = grads(ref_fn, [t.double() if t is not None else None for t in inputs])
    assert node == "CppFunction", (name, node)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-5)
    for o, r in zip(ours, ref):
        assert (o is None) == (r is None), name
        if o is not None:
            torch.testing.assert_close(o.double(), r, rtol=1e-4, atol=1e-5)
x = torch.randn(6, 10)
w, b, res = torch.randn(10), torch.randn(10), torch.randn(6, 10)
check("softmax", lambda x: cutlass_ext.softmax(x, scale=0.7), lambda x: torch.softmax(0.7 * x, -1), [x])
for weight, bias in ((w, b), (None, b), (w, None), (None, None)):
    check("layer_norm", lambda x, w, b: cutlass_ext.layer_norm(x, w, b),
          lambda x, w, b: F.layer_norm(x, (10,), w, b), [x, weight, bias])
for bias, residual in ((b, res), (None, res), (b, None)):
    check("bias_act", lambda x, b, r: cutlass_ext.bias_act(x, b, "gelu", scale=0.5, residual=r),
          lambda x, b, r: F.gelu(0.5 * x + (b if b is not None else 0) + (r if r is not None else 0)),
          [x, bias, residual])
for bias, residual in ((b, res), (None, res), (b, None), (None, None)):  # relu saves its mask
    check("bias_act relu", lambda x, b, r: cutlass_ext.bias_act(x, b, "relu", scale=0.5, residual=r),
          lambda x, b, r: F.relu(0.5 * x + (b if b is not None else 0) + (r if r is not None else 0)),
          [x, bias, residual])
W, A, B, lb = torch.randn(5, 10), torch.randn(4, 10), torch.randn(5, 4), torch.randn(5)
for bias in (lb, None):
    check("lora_linear", lambda x, W, A, B, b: cutlass_ext.lora_linear(x, W, A, B, b, scaling=0.5, activation="silu"),
          lambda x, W, A, B, b: F.silu(F.linear(x, W, b) + 0.5 * F.linear(F.linear(x, A), B)), [x, W, A, B, bias])
for bias, act in ((lb, "gelu"), (None, "relu")):
    check("linear", lambda x, W, b: cutlass_ext.linear(x, W.t(), b, activation=act),
          lambda x, W, b: _activation.apply(F.linear(x, W, b), act), [x, W, bias])
x3 = torch.randn(3, 4, 5)
for dim, keepdim in ((0, False), ([-1, 0], False), ([2, 1], True)):
    check("sum", lambda x: cutlass_ext.sum(x, dim, keepdim=keepdim), lambda x: x.sum(dim, keepdim=keepdim), [x3])
check("add", lambda a, b: cutlass_ext.add(a, b), lambda a, b: a + b, [x, res])
# Saved tensors are checked for in-place changes, and freed by a backward without retain_graph.
y = cutlass_ext.softmax(x.detach().requires_grad_())
y.mul_(2)
try:
    y.sum().backward()
    raise AssertionError("an in-place change of a saved output went unnoticed")
except RuntimeError as e:
    assert "inplace" in str(e), e
xl = x.detach().requires_grad_()
out = cutlass_ext.linear(xl, W.t(), lb, activation="relu").sum()
out.backward(retain_graph=False)
try:
    out.backward()
    raise AssertionError("a second backward through freed saved tensors did not raise")
except RuntimeError as e:
    assert "second time" in str(e), e
print("C++ autograd on CPU: ok")
"""


@pytest.mark.skipif(not _toolchain_available(), reason="needs nvcc, CUTLASS headers and a C++ compiler")
@pytest.mark.parametrize("arch", ["80", "90a"])
def test_row_cluster_helpers_compile_for_every_arch(tmp_path, arch):
    """common/cluster_rows.cuh calls Hopper-only cluster intrinsics behind arch guards: the units
    that include it must still compile for sm_80 (CUTLASS_EXT_ARCH=80), where its kernels trap and
    are never launched."""
    root = Path(__file__).resolve().parent.parent
    nvcc = _build.find_cuda_home() / "bin" / "nvcc"
    includes = [f"-I{root / 'csrc'}", *(f"-I{d}" for d in _build.find_cutlass().include_dirs)]
    cmd = [str(nvcc), "-std=c++17", "--expt-relaxed-constexpr", f"-gencode=arch=compute_{arch},code=sm_{arch}",
           *includes, "-c", str(root / "tests" / "cpp" / "cluster_rows_archs.cu"), "-o", str(tmp_path / "unit.o")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.skipif(not _toolchain_available(), reason="needs nvcc, CUTLASS headers and a C++ compiler")
def test_selective_build_compiles_and_imports(tmp_path):
    """A real build of two kernels plus the binding, in a subprocess; loading the library (no GPU
    needed) registers the CUDA kernels of the ops with the dispatcher."""
    env = dict(os.environ, CUTLASS_EXT_CACHE_DIR=str(tmp_path), CUTLASS_EXT_ARCH="90a",
               CUTLASS_EXT_KERNELS="sm90_fp16_kn_bias_act_128x128_1x1,simt_f32_mk", CUTLASS_EXT_CPU_AUTOGRAD="1")
    code = (
        "import torch, cutlass_ext\n"
        "from cutlass_ext import _build\n"
        "config = _build.BuildConfig.from_environment()\n"
        "module = _build.import_library(_build.run_build(config, config.build_dir()))\n"
        "print(sorted(name for name, _ in module.kernels()))\n"
        "print(module.activation_names())\n"
        "print([torch._C._dispatch_has_kernel_for_dispatch_key('cutlass_ext::' + op, 'CUDA')\n"
        "       for op in ('linear', 'matmul', '_act_grad', '_linear_backward')])\n"
        # The build tree names its generated sources relative to itself: moved under another name
        # and regenerated there (a developer seeding the next build from the last one), it has
        # nothing to rebuild.
        "import shutil, subprocess\n"
        "moved = config.build_dir().with_name('moved_build')\n"
        "shutil.copytree(config.build_dir(), moved, symlinks=True); shutil.rmtree(config.build_dir())\n"
        "_build.write_build_tree(config, moved)\n"
        "dry = subprocess.run([_build.find_ninja(), '-C', str(moved), '-n'], capture_output=True, text=True)\n"
        "print('copied build tree:', dry.stdout.strip().splitlines()[-1])\n"
        + CPU_AUTOGRAD_CHECK
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "['simt_f32_mk_bias_act_128x128x8_simt', 'sm90_fp16_kn_bias_act_128x128_1x1_coop_sk']" in result.stdout
    assert "['none', 'relu', 'gelu', 'gelu_tanh', 'silu', 'sigmoid']" in result.stdout
    assert "[True, True, True, True]" in result.stdout  # loading registered the CUDA kernels
    assert "C++ autograd on CPU: ok" in result.stdout, result.stdout[-2000:]
    assert "copied build tree: ninja: no work to do." in result.stdout, result.stdout[-2000:]
