"""cutlass_ext.linear / matmul / _act_grad against float64 references, on CPU (reference kernels)
and CUDA (CUTLASS kernels)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

import cutlass_ext
from cutlass_ext import _kernel_table
from cutlass_ext.ops import _activation
from cutlass_ext.ops import linear as linear_ops

from ..conftest import HAS_CUDA, requires_cuda
from ..helpers import (DTYPES, activation64, assert_close_to_reference, aux_cooperative, capture_cuda_graph,
                       cuda_kernels_run, every_value, fp32_precision, gemm_kernels_run, narrow_kernel_takes,
                       few_rows_tile, narrow_n_tile, one_round_tile_n, one_wave_tiles_take, unit_in_last_place, wide_tile)

DTYPE_NAMES = ["fp16", "bf16", "fp32", pytest.param("tf32", marks=requires_cuda)]
# Tests of Hopper-path features (several configs per call) skip when the suite runs the Ampere path.
requires_sm90_path = pytest.mark.skipif(os.environ.get("CUTLASS_EXT_GEMM_ARCH") == "sm80",
                                        reason="CUTLASS_EXT_GEMM_ARCH=sm80 builds one config per layout")
ACTS = list(_activation.ACTIVATIONS)


def act_ref(z: torch.Tensor, act: str) -> torch.Tensor:
    return _activation.apply(z, act)


def ref_linear(A, B, bias, act):
    z = A.double() @ B.double()
    if bias is not None:
        z = z + bias.double()
    return act_ref(z, act)


def peer_linear(A, B, bias, act):
    """torch's own result in the same dtype: act(F.linear(...)) (cuBLAS / CPU BLAS)."""
    return act_ref(F.linear(A, B.t(), bias), act)


def rand(*shape, device, dtype, scale=1.0):
    return torch.randn(*shape, device=device, dtype=torch.float32).mul_(scale).to(dtype)


def make_b(k, n, layout, device, dtype):
    """B [K, N]: row-major ('kn') or the transpose of a row-major [N, K] weight ('weight_t')."""
    scale = 1 / math.sqrt(max(k, 1))
    if layout == "kn":
        return rand(k, n, device=device, dtype=dtype, scale=scale)
    return rand(n, k, device=device, dtype=dtype, scale=scale).t()


# name -> builder of A given (device, dtype); each returns A with the described layout.
def _a_plain(lead, k):
    return lambda d, t: rand(*lead, k, device=d, dtype=t)


A_CASES = {
    "square": (_a_plain((128,), 256), 256),
    "tall": (_a_plain((512,), 64), 128),
    "one": (_a_plain((1,), 1), 1),
    "odd": (_a_plain((7,), 13), 5),
    "unaligned_k": (_a_plain((129,), 139), 264),
    "unaligned_n": (_a_plain((64,), 128), 250),
    "vector": (_a_plain((), 40), 24),
    "m_zero": (_a_plain((0,), 64), 32),
    "k_zero": (_a_plain((16,), 0), 24),
    "batched": (_a_plain((3, 17), 96), 40),
    "wide": (_a_plain((40,), 1024), 2048),
    # A is a column slice of a wider tensor: row stride 200 > K.
    "noncontig": (lambda d, t: rand(96, 200, device=d, dtype=t)[:, 8:136], 72),
    # A starts one element into its storage: a base address no 16-byte load can use.
    "offset": (lambda d, t: rand(96 * 64 + 1, device=d, dtype=t)[1:].view(96, 64), 48),
    # A is M-major (the transpose of a row-major [K, M] tensor).
    "transposed": (lambda d, t: rand(64, 136, device=d, dtype=t).t(), 56),
    # Batch dims that cannot be flattened without a copy.
    "permuted": (lambda d, t: rand(5, 6, 32, device=d, dtype=t).transpose(0, 1), 16),
}


def _setup(dtype_name, device):
    if device == "cpu" and dtype_name == "tf32":
        pytest.skip("tf32 is a CUDA mode")
    return DTYPES[dtype_name]


@pytest.mark.parametrize("b_layout", ["kn", "weight_t"])
@pytest.mark.parametrize("case", list(A_CASES))
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_forward_shapes(device, dtype_name, case, b_layout):
    dtype = _setup(dtype_name, device)
    make_a, n = A_CASES[case]
    A = make_a(device, dtype)
    k = A.shape[-1]
    B = make_b(k, n, b_layout, device, dtype)
    bias = rand(n, device=device, dtype=dtype)
    with fp32_precision(dtype_name):
        out = cutlass_ext.linear(A, B, bias, activation="gelu")
        peer = peer_linear(A, B, bias, "gelu")
    assert out.dtype == dtype and out.is_contiguous()
    assert_close_to_reference(out, ref_linear(A, B, bias, "gelu"), peer, dtype_name)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_forward_activations(device, dtype_name, act, with_bias):
    dtype = _setup(dtype_name, device)
    A = rand(200, 96, device=device, dtype=dtype)
    B = make_b(96, 136, "weight_t", device, dtype)
    bias = rand(136, device=device, dtype=dtype) if with_bias else None
    with fp32_precision(dtype_name):
        out = cutlass_ext.linear(A, B, bias, activation=act)
        peer = peer_linear(A, B, bias, act)
    assert_close_to_reference(out, ref_linear(A, B, bias, act), peer, dtype_name)


def test_relu_shorthand(device):
    A = rand(16, 32, device=device, dtype=torch.float32)
    B = make_b(32, 8, "kn", device, torch.float32)
    with fp32_precision("fp32"):
        assert torch.equal(cutlass_ext.linear(A, B, relu=True), cutlass_ext.linear(A, B, activation="relu"))


def test_nan_propagates(device):
    A = rand(32, 64, device=device, dtype=torch.bfloat16)
    A[3, 5] = float("nan")
    B = make_b(64, 40, "kn", device, torch.bfloat16)
    out = cutlass_ext.linear(A, B, activation="relu")
    assert torch.isnan(out[3]).all() and torch.isfinite(out[:3]).all()


# ------------------------------------------------------------------------------------------------
# Backward


def grads_of(fn, inputs, grad_out):
    inputs = [x.detach().requires_grad_(True) if x is not None else None for x in inputs]
    out = fn(*inputs)
    out.backward(grad_out)
    return out, [x.grad if x is not None else None for x in inputs]


@pytest.mark.parametrize("b_layout", ["kn", "weight_t"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_backward(device, dtype_name, act, b_layout):
    dtype = _setup(dtype_name, device)
    A = rand(3, 50, 72, device=device, dtype=dtype)
    B = make_b(72, 104, b_layout, device, dtype)
    if b_layout == "weight_t":
        B = B.t().detach().clone().t()  # a leaf that keeps the transposed layout
    bias = rand(104, device=device, dtype=dtype)
    grad_out = rand(3, 50, 104, device=device, dtype=dtype)
    with fp32_precision(dtype_name):
        _, ours = grads_of(lambda a, b, c: cutlass_ext.linear(a, b, c, activation=act), [A, B, bias], grad_out)
        _, peer = grads_of(lambda a, b, c: peer_linear(a, b, c, act), [A, B, bias], grad_out)
    _, ref = grads_of(lambda a, b, c: ref_linear(a, b, c, act), [A.double(), B.double(), bias.double()],
                      grad_out.double())
    for name, o, p, r in zip(("dA", "dB", "dbias"), ours, peer, ref):
        assert o.dtype == dtype
        assert_close_to_reference(o, r, p, dtype_name, what=name)
    assert ours[1].stride() == B.stride(), "dB should come back in B's layout"


def backward_work(device, run, monkeypatch):
    """(GEMMs, fused activation-backward passes, other kernels) that ``run`` performs: counted
    through the reference kernels on CPU and from the profiler's kernel list on CUDA."""
    if device == "cpu":
        counts = {"gemm": 0, "act_grad": 0}

        def counting(key, fn):
            def wrapper(*args):
                counts[key] += 1
                return fn(*args)
            return wrapper

        monkeypatch.setattr(linear_ops, "_matmul_reference", counting("gemm", linear_ops._matmul_reference))
        monkeypatch.setattr(linear_ops, "_act_grad_reference", counting("act_grad", linear_ops._act_grad_reference))
        run()
        return counts["gemm"], counts["act_grad"], []
    _, names = cuda_kernels_run(run)
    gemm_kernels = ("GemmUniversal", "lowk_gemm_kernel", "gemv_gemm_kernel", "fewrows_gemm_kernel", "ffma_gemm_kernel",
                    "wgrad_gemm_kernel")
    gemms = sum(any(k in n for k in gemm_kernels) for n in names)
    act_grads = sum("act_grad_kernel" in n for n in names)
    others = [n for n in names if not any(k in n for k in (*gemm_kernels, "act_grad_kernel", "bias_grad_finalize"))]
    return gemms, act_grads, others


@pytest.mark.parametrize("needs", ["a", "b", "bias", "a+bias"])
@pytest.mark.parametrize("act", ["none", "gelu"])
def test_backward_computes_only_needed_grads(device, act, needs, monkeypatch):
    wanted = needs.split("+")
    # 24 output columns: above the few-column backward's 16 (test_few_column_backward_* below)
    A = rand(40, 24, device=device, dtype=torch.bfloat16).requires_grad_("a" in wanted)
    B = make_b(24, 24, "weight_t", device, torch.bfloat16).detach().requires_grad_("b" in wanted)
    bias = rand(24, device=device, dtype=torch.bfloat16).requires_grad_("bias" in wanted)
    out = cutlass_ext.linear(A, B, bias, activation=act)
    grad = torch.ones_like(out)
    gemms, act_grads, others = backward_work(device, lambda: out.backward(grad), monkeypatch)
    assert gemms == ("a" in wanted) + ("b" in wanted)
    # One fused pass computes act'(z) and the bias gradient; none at all for a bare GEMM.
    assert act_grads == (0 if act == "none" and "bias" not in wanted else 1)
    assert others == [], others  # no separate activation-backward, bias-sum or copy kernels
    assert (A.grad is not None) == A.requires_grad and (B.grad is not None) == B.requires_grad
    assert (bias.grad is not None) == bias.requires_grad


FEW_COLUMN_KERNELS = ("few_column_backward_kernel", "few_column_backward_finish_kernel")


def few_column_layer(rows, k, n, dtype, x_layout="plain", b_layout="weight_t"):
    """X [rows, k] (plain, a column slice of a wider tensor, one element off 16-byte alignment, or
    the transpose of a [k, rows] tensor), B [k, n] and a bias, as leaves."""
    if x_layout == "slice":
        x = rand(rows, k + 24, device="cuda", dtype=dtype)[:, 8:8 + k]
    elif x_layout == "offset":
        x = rand(rows * k + 1, device="cuda", dtype=dtype)[1:].view(rows, k)
    elif x_layout == "transposed":
        x = rand(k, rows, device="cuda", dtype=dtype).t()
    else:
        x = rand(rows, k, device="cuda", dtype=dtype)
    B = make_b(k, n, b_layout, "cuda", dtype)
    if b_layout == "weight_t":
        B = B.t().detach().clone().t()
    bias = rand(n, device="cuda", dtype=dtype)
    return [t.detach().requires_grad_() for t in (x, B, bias)]


def few_column_reference(x, B, bias, act, dy):
    """Float64 gradients of act(x B + bias) for dy (None for the inputs that need none), and the
    scales their errors are taken against: dW and dbias are sums over all rows of terms of both
    signs, and with one to a few columns such a sum can cancel to far below its terms' rounding
    errors (65536 rows of bf16 dZ: a dbias of 9.5 off by 0.2 from rounding alone), so theirs are
    the terms' size."""
    ref = [t.detach().double().requires_grad_(t.requires_grad) for t in (x, B, bias)]
    z = ref[0] @ ref[1] + ref[2]
    z.retain_grad()
    act_ref(z, act).backward(dy.double())
    g = z.grad
    return [r.grad for r in ref], (None, (ref[0].detach().square().t() @ g.square()).sqrt(), g)


def check_few_column_backward(rows, k, n, dtype_name, act, x_layout="plain", b_layout="weight_t"):
    dtype = DTYPES[dtype_name]
    x, B, bias = few_column_layer(rows, k, n, dtype, x_layout, b_layout)
    dy = rand(rows, n, device="cuda", dtype=dtype)
    with fp32_precision(dtype_name):
        y = cutlass_ext.linear(x, B, bias, activation=act)
        _, names = cuda_kernels_run(lambda: y.backward(dy))
        # One pass (and the splits' sum), no GEMM and no separate act'/bias pass. (A leaf X with
        # other strides than dX's gets a copy from autograd, as with any other op.)
        assert sum(FEW_COLUMN_KERNELS[0] in name for name in names) == 1, names
        assert not any(k in name for name in names for k in ("Gemm", "gemm", "act_grad", "sum_partials")), names
        _, peer = grads_of(lambda a, b, c: peer_linear(a, b, c, act), [x, B, bias], dy)
    ref, scales = few_column_reference(x, B, bias, act, dy)
    for name, o, p, r, scale in zip(("dX", "dW", "dbias"), (x.grad, B.grad, bias.grad), peer, ref, scales):
        assert o.dtype == dtype
        assert_close_to_reference(o, r, p, dtype_name, what=name, scale=scale)
    # dW in B's layout (the strides of size-1 dimensions address nothing)
    assert all(a == b for a, b, size in zip(B.grad.stride(), B.stride(), B.shape) if size > 1), (B.grad.stride(), B.stride())


@requires_cuda
@pytest.mark.parametrize("rows,k,n", [
    (2048, 256, 1), (777, 256, 1), (65536, 256, 1), (5000, 64, 4), (333, 13, 3), (1, 40, 2), (2048, 1024, 4),
    (20000, 24, 2), (96, 1, 3), (40, 4096, 1), (5000, 64, 16), (16384, 64, 16), (20000, 24, 8), (300, 1024, 5),
    (96, 3, 16),
])
@pytest.mark.parametrize("dtype_name", ["fp16", "bf16", "fp32"])
def test_few_column_backward(rows, k, n, dtype_name):
    # Layers with up to 4 output columns, or up to 16 over up to 2^20 elements of X: the whole
    # backward in one pass over X (and a second kernel adding the row splits' dW and dbias), no GEMM.
    check_few_column_backward(rows, k, n, dtype_name, "gelu")


@requires_cuda
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("b_layout", ["kn", "weight_t"])
def test_few_column_backward_activations(act, b_layout):
    check_few_column_backward(3000, 128, 4, "bf16", act, b_layout=b_layout)


@requires_cuda
@pytest.mark.parametrize("x_layout", ["slice", "offset", "transposed"])
@pytest.mark.parametrize("n", [1, 4, 16])
def test_few_column_backward_reads_views_in_place(x_layout, n):
    # Strided, misaligned and K-strided X take the one-element path; no copy kernel runs.
    check_few_column_backward(1500, 72, n, "bf16", "relu", x_layout=x_layout)


@requires_cuda
@pytest.mark.parametrize("rows,k,n", [(2048, 2048, 16), (16385, 64, 16), (512, 64, 24)])
def test_wider_layers_keep_the_gemm_backward(rows, k, n):
    x, B, bias = few_column_layer(rows, k, n, torch.bfloat16)
    y = cutlass_ext.linear(x, B, bias, activation="gelu")
    _, names = cuda_kernels_run(lambda: y.backward(torch.ones_like(y)))
    assert not any(FEW_COLUMN_KERNELS[0] in name for name in names), names
    assert any("act_grad" in name for name in names), names


@requires_cuda
@pytest.mark.parametrize("needs", ["a", "b", "a+bias", "b+bias"])
def test_few_column_backward_computes_only_needed_grads(needs):
    wanted = needs.split("+")
    x, B, bias = few_column_layer(3000, 256, 1, torch.bfloat16)
    x.requires_grad_("a" in wanted)
    B.requires_grad_("b" in wanted)
    bias.requires_grad_("bias" in wanted)
    dy = rand(3000, 1, device="cuda", dtype=torch.bfloat16)
    y = cutlass_ext.linear(x, B, bias, activation="silu")
    _, names = cuda_kernels_run(lambda: y.backward(dy))
    # The second stage runs only for dW or dbias.
    assert sum(FEW_COLUMN_KERNELS[0] in name for name in names) == 1, names
    assert len(names) == 1 + ("b" in wanted or "bias" in wanted), names
    ref, scales = few_column_reference(x, B, bias, "silu", dy)
    for ours, r, scale in zip((x, B, bias), ref, scales):
        assert (ours.grad is not None) == ours.requires_grad
        if ours.requires_grad:
            assert_close_to_reference(ours.grad, r, None, "bf16", scale=scale)


@requires_cuda
def test_few_column_backward_is_deterministic_and_graph_safe():
    x, B, _ = few_column_layer(40000, 256, 2, torch.bfloat16)
    dy = rand(40000, 2, device="cuda", dtype=torch.bfloat16)
    z = rand(40000, 2, device="cuda", dtype=torch.bfloat16)

    def backward():
        return torch.ops.cutlass_ext._linear_backward(dy, x.detach(), B.detach(), z, "gelu", True, True, True, True)

    first = backward()
    graph, captured = capture_cuda_graph(backward)
    graph.replay()
    torch.cuda.synchronize()
    for a, b, c in zip(first, backward(), captured):
        assert torch.equal(a, b) and torch.equal(a, c)


@requires_cuda
def test_few_column_backward_direct_op_checks_and_strides():
    x, B, _ = few_column_layer(700, 48, 3, torch.float16, b_layout="kn")
    x, B = x.detach(), B.detach()
    z = rand(700, 6, device="cuda", dtype=torch.float16)[:, 1::2]

    def check(dy):
        ours = torch.ops.cutlass_ext._linear_backward(dy, x, B, z, "gelu_tanh", True, True, True, False)
        ref = linear_ops._linear_backward_reference(dy.double(), x.double(), B.double(), z.double(), "gelu_tanh",
                                                    True, True, True, False)
        for o, r, what in zip(ours, ref, ("dX", "dW", "dbias")):
            assert_close_to_reference(o, r, None, "fp16", what=what)

    # A non-contiguous dY and pre-activation (columns of wider tensors).
    dy = rand(700, 9, device="cuda", dtype=torch.float16)[:, ::3]
    check(dy)
    # An expanded dY (the gradient of y.sum()) is read through its zero strides.
    check(torch.ones(1, 1, device="cuda", dtype=torch.float16).expand(700, 3))
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.cutlass_ext._linear_backward(dy, x.float(), B, z, "gelu_tanh", True, True, True, False)
    with pytest.raises(RuntimeError, match="rows where grad has"):
        torch.ops.cutlass_ext._linear_backward(dy, x[:699], B, z, "gelu_tanh", True, True, True, False)


def test_backward_without_saved_preactivation_fails_clearly(device):
    A = rand(8, 16, device=device, dtype=torch.float32, scale=1).requires_grad_()
    B = make_b(16, 8, "kn", device, torch.float32)
    y, _ = torch.ops.cutlass_ext.linear(A, B, None, "gelu", False)
    with pytest.raises(RuntimeError, match="save_preact=True"):
        y.sum().backward()


# ------------------------------------------------------------------------------------------------
# matmul

MATMUL_CASES = {
    "2d": ((64, 48), (48, 80)),
    "odd": ((7, 13), (13, 5)),
    "batched": ((4, 33, 64), (4, 64, 24)),
    "fold": ((2, 3, 16, 40), (40, 72)),
    "broadcast": ((2, 1, 16, 40), (3, 40, 8)),
}


@pytest.mark.parametrize("case", list(MATMUL_CASES))
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_matmul(device, dtype_name, case):
    dtype = _setup(dtype_name, device)
    a_shape, b_shape = MATMUL_CASES[case]
    A = rand(*a_shape, device=device, dtype=dtype)
    B = rand(*b_shape, device=device, dtype=dtype, scale=1 / math.sqrt(a_shape[-1]))
    grad_out = rand(*torch.broadcast_shapes(a_shape[:-2], b_shape[:-2]), a_shape[-2], b_shape[-1],
                    device=device, dtype=dtype)
    with fp32_precision(dtype_name):
        out, ours = grads_of(cutlass_ext.matmul, [A, B], grad_out)
        peer_out, peer = grads_of(torch.matmul, [A, B], grad_out)
    ref_out, ref = grads_of(torch.matmul, [A.double(), B.double()], grad_out.double())
    assert_close_to_reference(out, ref_out, peer_out, dtype_name)
    for name, o, p, r in zip(("dA", "dB"), ours, peer, ref):
        assert_close_to_reference(o, r, p, dtype_name, what=name)


@requires_cuda
@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("rows,k", [(1, 1024), (8, 64), (300, 16), (300, 1024)])
@pytest.mark.parametrize("act,lo,hi", [("gelu", -6, 8), ("silu", -16, 16), ("sigmoid", -16, 16)])
@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
def test_16bit_epilogue_activations_within_one_unit(dtype_name, act, lo, hi, rows, k, train):
    # 16-bit results take GELU, SiLU and sigmoid in the forms of csrc/common/activation_16bit.h in
    # every epilogue (CUTLASS's, with and without the training forward's pre-activation output,
    # and the one-row, few-row and short-K kernels'). Every value z of the dtype in [lo, hi] is a
    # column of the product (A's first column ones, B's first row z, the rest zero, so the fp32
    # accumulator holds z exactly), and must come out within one unit of float64.
    dtype = DTYPES[dtype_name]
    z = every_value(dtype, lo, hi)
    z = torch.cat([z, z[: (-z.numel()) % 8]]).cuda()
    A = torch.zeros(rows, k, device="cuda", dtype=dtype)
    A[:, 0] = 1
    B = torch.zeros(k, z.numel(), device="cuda", dtype=dtype)
    B[0] = z
    y = cutlass_ext.linear(A.requires_grad_(train), B, None, activation=act)
    ref, _ = activation64(act, z.double())
    err = (y.detach().double() - ref).abs() / unit_in_last_place(ref, dtype)
    assert err.max() <= 1.0, f"{act} off by {err.max():.2f} units at z = {z[err.max(0).values.argmax()]:.6g}"


# ------------------------------------------------------------------------------------------------
# _act_grad (the fused activation-backward + bias-gradient op)


@pytest.mark.parametrize("shape", [(1, 1), (7, 5), (33, 64), (2048, 520), (257, 4097), (5000, 24)])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype_name", ["fp16", "bf16", "fp32"])
def test_act_grad(device, dtype_name, act, shape):
    dtype = DTYPES[dtype_name]
    rows, cols = shape
    grad = rand(rows, cols + 3, device=device, dtype=dtype)[:, 3:]  # non-contiguous rows
    z = rand(rows, cols, device=device, dtype=dtype, scale=2)
    saved = torch.relu(z) if act == "relu" else z
    dz, db = torch.ops.cutlass_ext._act_grad(grad, saved if act != "none" else None, act, True, True)
    ref_dz = _activation.backward(grad.double(), saved.double(), act)
    if act == "none":
        assert dz.numel() == 0
    else:
        assert_close_to_reference(dz, ref_dz, _activation.backward(grad, saved, act), dtype_name, what="dz")
    peer_db = _activation.backward(grad, saved, act).float().sum(0).to(dtype)  # torch's dz, summed
    assert_close_to_reference(db, ref_dz.sum(0), peer_db, dtype_name, what="dbias")


@pytest.mark.parametrize("shape", [(65536, 16), (32768, 64), (3001, 8), (1000, 24), (4096, 1032)])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_act_grad_narrow_rows(device, dtype_name, shape):
    # Contiguous (vectorized) rows of one to a few 16-byte vectors: the block's threads go across
    # rows instead of idling across columns, and many row splits are added in a fixed order.
    dtype = DTYPES[dtype_name]
    grad = rand(*shape, device=device, dtype=dtype)
    z = rand(*shape, device=device, dtype=dtype, scale=2)
    dz, db = torch.ops.cutlass_ext._act_grad(grad, z, "gelu", True, True)
    ref_dz = _activation.backward(grad.double(), z.double(), "gelu")
    peer_dz = _activation.backward(grad, z, "gelu")
    assert_close_to_reference(dz, ref_dz, peer_dz, dtype_name, what="dz")
    assert_close_to_reference(db, ref_dz.sum(0), peer_dz.float().sum(0).to(dtype), dtype_name, what="dbias")
    assert torch.equal(torch.ops.cutlass_ext._act_grad(grad, z, "gelu", True, True)[1], db)


def test_act_grad_is_deterministic(device):
    grad = rand(8192, 256, device=device, dtype=torch.bfloat16)
    z = rand(8192, 256, device=device, dtype=torch.bfloat16)
    first = torch.ops.cutlass_ext._act_grad(grad, z, "gelu", True, True)
    second = torch.ops.cutlass_ext._act_grad(grad, z, "gelu", True, True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


# ------------------------------------------------------------------------------------------------
# torch.library.opcheck, torch.compile, CUDA graphs, streams


def _opcheck_inputs(device, n=32):
    A = rand(2, 24, 40, device=device, dtype=torch.bfloat16).requires_grad_()
    B = make_b(40, n, "weight_t", device, torch.bfloat16).detach().requires_grad_()
    bias = rand(n, device=device, dtype=torch.bfloat16).requires_grad_()
    return A, B, bias


@pytest.mark.parametrize("act,save", [("none", False), ("relu", False), ("gelu", True), ("silu", True)])
def test_opcheck_linear(device, act, save):
    A, B, bias = _opcheck_inputs(device)
    torch.library.opcheck(torch.ops.cutlass_ext.linear.default, (A, B, bias, act, save))
    torch.library.opcheck(torch.ops.cutlass_ext.linear.default, (A, B, None, act, save))


def test_opcheck_matmul(device):
    A, B, _ = _opcheck_inputs(device)
    torch.library.opcheck(torch.ops.cutlass_ext.matmul.default, (A, B))
    torch.library.opcheck(torch.ops.cutlass_ext.matmul.default, (A, B.t().unsqueeze(0).expand(2, 32, 40).mT))


@pytest.mark.parametrize("act", ["none", "relu", "gelu"])
@pytest.mark.parametrize("transposed", [True, False])
def test_opcheck_linear_backward(device, act, transposed):
    A, B, _ = _opcheck_inputs(device)
    B = B.detach() if transposed else B.detach().contiguous()  # weight.t() or a row-major [K, N]
    saved = rand(2, 24, 32, device=device, dtype=torch.bfloat16) if act != "none" else None
    grad = rand(2, 24, 32, device=device, dtype=torch.bfloat16)
    for needs in [(True, True, True), (True, False, False), (False, True, True), (False, False, True)]:
        torch.library.opcheck(torch.ops.cutlass_ext._linear_backward.default,
                              (grad, A.detach(), B, saved, act, *needs, transposed))


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_opcheck_act_grad(device, act):
    grad = rand(64, 48, device=device, dtype=torch.float16)
    saved = rand(64, 48, device=device, dtype=torch.float16)
    for need_input, need_bias in [(True, True), (True, False), (False, True)]:
        torch.library.opcheck(torch.ops.cutlass_ext._act_grad.default, (grad, saved, act, need_input, need_bias))


def _compile_backend(device):
    return "inductor" if device == "cuda" else "aot_eager"


@pytest.mark.parametrize("act,n", [("relu", 32), ("gelu", 32), ("gelu", 3)])  # n = 3: the few-column kernel
def test_compile_fullgraph(device, act, n):
    torch._dynamo.reset()
    A, B, bias = _opcheck_inputs(device, n)

    def step(a, w, b):
        h = cutlass_ext.linear(a, w.t(), b, activation=act)
        return cutlass_ext.matmul(h, w).float().square().mean()

    compiled = torch.compile(step, fullgraph=True, backend=_compile_backend(device))
    W = B.t().detach().requires_grad_()
    loss = compiled(A, W, bias)
    loss.backward()
    grads = [x.grad.clone() for x in (A, W, bias)]
    for x in (A, W, bias):
        x.grad = None
    eager_loss = step(A, W, bias)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-2, atol=1e-3)
    for g, x in zip(grads, (A, W, bias)):
        torch.testing.assert_close(g, x.grad, rtol=2e-2, atol=2e-2)


@requires_cuda
@pytest.mark.parametrize("n", [192, 1])  # 1: the few-column kernel
def test_cuda_graph_capture_forward(n):
    A = rand(256, 128, device="cuda", dtype=torch.bfloat16)
    W = rand(n, 128, device="cuda", dtype=torch.bfloat16)
    bias = rand(n, device="cuda", dtype=torch.bfloat16)
    graph, out = capture_cuda_graph(lambda: cutlass_ext.linear(A, W.t(), bias, activation="gelu"))
    for _ in range(2):
        A.copy_(torch.randn_like(A))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, cutlass_ext.linear(A, W.t(), bias, activation="gelu"), rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("act,out_features", [("relu", 64), ("gelu", 64), ("gelu", 1)])  # 1: the few-column kernel
def test_cuda_graph_training_step(act, out_features):
    layer = cutlass_ext.FusedLinear(128, out_features, activation=act, device="cuda", dtype=torch.bfloat16)
    x = rand(512, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
    graphed = torch.cuda.make_graphed_callables(layer, (x,))
    x2 = rand(512, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
    out = graphed(x2)
    out.float().square().sum().backward()
    g_graph = (x2.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone())
    x2.grad = None
    layer.zero_grad(set_to_none=True)
    layer(x2).float().square().sum().backward()
    for a, b in zip(g_graph, (x2.grad, layer.weight.grad, layer.bias.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@requires_cuda
def test_runs_on_current_stream():
    side = torch.cuda.Stream()
    A = rand(1024, 512, device="cuda", dtype=torch.float16)
    W = rand(768, 512, device="cuda", dtype=torch.float16)
    expected = cutlass_ext.linear(A, W.t(), activation="silu")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        A2 = A * 1  # produced on the side stream, consumed by the next launch on it
        out = cutlass_ext.linear(A2, W.t(), activation="silu")
    side.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Every built kernel, forced by name through the config override


def _kernel_inputs(kernel, device):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "f32": torch.float32}[kernel.dtype]
    # Several tiles in M and N; K and N multiples of 8 (no copies). A transposed kernel computes
    # B^T A^T: its first operand is the caller's B, its second the caller's A, and M is its
    # narrow (and here partial) tile.
    m, k, n = (37, 264, 392) if kernel.config.transposed else (304, 264, 392)
    if kernel.family == "lowk":
        k = 40  # K <= 64, not a multiple of its 16-deep MMA step
    if kernel.family == "gemv":
        n = 13  # N <= 16, not a power of two
    if kernel.family == "fewrows":
        m = 13  # M <= 16, more than one 8-wide MMA tile
    if kernel.family == "ffma":
        k = 13  # K <= 32, rows not in 16-byte pieces
    if kernel.family == "wgrad":
        m, k, n = 300, 3000, 13  # a narrow side <= 16 (N), a long K
    if kernel.family == "narrow":
        k, n = 72, 40  # N <= 64 (a partial 64-wide tile), K <= 256 (not a multiple of its 16-deep MMA step)
    if kernel.k_slices:
        k = 4096  # eight slices of 512 for 12 output tiles
    a_major, b_major = (kernel.b_major, kernel.a_major) if kernel.config.transposed else (kernel.a_major, kernel.b_major)
    A = rand(m, k, device=device, dtype=dtype) if a_major == "k" else rand(k, m, device=device, dtype=dtype).t()
    B = make_b(k, n, "weight_t" if b_major == "k" else "kn", device, dtype)
    return A, B, rand(n, device=device, dtype=dtype)


@requires_cuda
# The extended-K kernels (a second operand pair in the K loop) serve LoRA only; the tests
# test_rank_r_term_inside_the_main_gemm and ..._the_wide_tile in tests/ops/test_lora.py run each
# of them, with and without the pre-activation output, in the forward and in dx.
@pytest.mark.parametrize("name", [k.name for k in _kernel_table.all_kernels() if not k.ext_k])
def test_every_kernel(name, monkeypatch):
    kernel = {k.name: k for k in _kernel_table.all_kernels()}[name]
    ext = cutlass_ext.build()
    built = dict(ext.kernels())
    if name not in built:
        pytest.skip(f"{name} is not in this (selective) build")
    A, B, bias = _kernel_inputs(kernel, "cuda")
    monkeypatch.setenv("CUTLASS_EXT_GEMM_CONFIG", kernel.config.name)
    dtype_name = {"f32": "fp32"}.get(kernel.dtype, kernel.dtype)
    with fp32_precision(dtype_name):
        if kernel.k_slices:
            # Plain products only (weight gradients): fp32 partials of K slices, then their sum.
            out, names = cuda_kernels_run(lambda: cutlass_ext.matmul(A, B))
            assert any("sum_partials" in n for n in names), names
            assert_close_to_reference(out, A.double() @ B.double(), torch.matmul(A, B), dtype_name)
            return
        if kernel.family == "wgrad":
            # Plain products of an M-major A and an N-major B (weight gradients), one side narrow.
            out, names = cuda_kernels_run(lambda: cutlass_ext.matmul(A, B))
            assert any(WGRAD in n for n in names), names
            assert_close_to_reference(out, A.double() @ B.double(), torch.matmul(A, B), "fp32")
            return
        if kernel.plain:
            # Products without bias or activation (the backward's dX and dW) take the plain
            # epilogue; with a bias the same config runs its bias-and-activation twin.
            out, names = gemm_kernels_run(lambda: cutlass_ext.matmul(A, B))
            assert len(names) == 1 and "EltAct" not in names[0], names
            assert_close_to_reference(out, A.double() @ B.double(), torch.matmul(A, B), dtype_name)
            twin = kernel.name.replace("_plain_", "_bias_act_")
            if twin not in {k.name for k in _kernel_table.all_kernels()}:
                return  # built for the backward's plain products only (WIDE_16BIT_CONFIGS)
            y, names = gemm_kernels_run(lambda: cutlass_ext.linear(A, B, bias))
            assert len(names) == 1 and "EltAct" in names[0], names
            assert_close_to_reference(y, ref_linear(A, B, bias, "none"), peer_linear(A, B, bias, "none"), dtype_name)
            return
        if kernel.with_c:
            # C-source kernels serve in-place accumulation: W += s * A @ B as a LoRA merge
            # (lora_B is the A operand, lora_A the B operand), checked to write W in place.
            W = rand(A.shape[0], B.shape[1], device="cuda", dtype=A.dtype)
            W0, ptr = W.clone(), W.data_ptr()
            monkeypatch.setenv("CUTLASS_EXT_LORA_MERGE_PASS", "0")  # the merge as a GEMM, not the rank-r pass
            _, names = gemm_kernels_run(lambda: torch.ops.cutlass_ext.lora_merge(W, B, A, 0.5))
            assert len(names) == 1, names
            assert W.data_ptr() == ptr
            ref = W0.double() + 0.5 * (A.double() @ B.double())
            assert_close_to_reference(W, ref, torch.addmm(W0, A, B, alpha=0.5), dtype_name, what="merged W")
            return
        if kernel.aux:
            y, aux = torch.ops.cutlass_ext.linear(A, B, bias, "gelu", True)
            assert_close_to_reference(aux, ref_linear(A, B, bias, "none"), peer_linear(A, B, bias, "none"),
                                      dtype_name, what="aux")
        else:
            # Every activation: the sm90 epilogues run none and ReLU inline and the smooth ones
            # out of line (gemm/epilogue_activation.cuh). ReLU keeps a NaN.
            for act in ACTS:
                y, _ = torch.ops.cutlass_ext.linear(A, B, bias, act, False)
                peer = peer_linear(A, B, bias, act)
                assert_close_to_reference(y, ref_linear(A, B, bias, act), peer, dtype_name, what=act)
            A_nan = A.clone()
            A_nan[0, 0] = float("nan")
            y, _ = torch.ops.cutlass_ext.linear(A_nan, B, bias, "relu", False)
            assert torch.isnan(y[0]).all() and torch.isfinite(y[1:]).all()
            return
        peer = peer_linear(A, B, bias, "gelu")
    assert_close_to_reference(y, ref_linear(A, B, bias, "gelu"), peer, dtype_name)


def heuristic_kernel(m, k, n):
    """The one GEMM kernel the heuristic runs for a bf16 linear+bias+ReLU of m x k x n (its result
    checked against the reference)."""
    A = rand(m, k, device="cuda", dtype=torch.bfloat16)
    W = rand(n, k, device="cuda", dtype=torch.bfloat16, scale=k ** -0.5)
    bias = rand(n, device="cuda", dtype=torch.bfloat16)
    y, names = gemm_kernels_run(lambda: cutlass_ext.linear(A, W.t(), bias, relu=True))
    assert len(names) == 1, names
    assert_close_to_reference(y, ref_linear(A, W.t(), bias, "relu"), peer_linear(A, W.t(), bias, "relu"), "bf16")
    return names[0]


# ------------------------------------------------------------------------------------------------
# The hand-written short-K kernel (lowk: K <= 64 on mma.sync)


@requires_cuda
@pytest.mark.parametrize(
    "m,k,n,hand_written",
    [(300, 16, 392, True), (8, 32, 392, True), (300, 40, 392, True), (8192, 64, 256, True), (8200, 40, 392, False),
     (300, 72, 392, False)],
)
def test_heuristic_takes_the_short_k_kernel_where_it_applies(m, k, n, hand_written):
    name = heuristic_kernel(m, k, n)
    assert ("lowk_gemm_kernel" in name) == hand_written, name


@requires_cuda
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("layouts", ["kk", "kn", "mk", "mn"])
@pytest.mark.parametrize("k", [8, 24, 64])
def test_lowk_kernel(dtype_name, layouts, k, monkeypatch):
    # M = 136 and N = 200 end in partial 64x128 tiles; K is padded to the 16-deep MMA step inside.
    # Above K = 32 the heuristic prefers CUTLASS, so the kernel is forced there.
    if k > 32:
        monkeypatch.setenv("CUTLASS_EXT_GEMM_CONFIG", "lowk_64x128")
    dtype = DTYPES[dtype_name]
    m, n = 136, 200
    A = rand(m, k, device="cuda", dtype=dtype) if layouts[0] == "k" else rand(k, m, device="cuda", dtype=dtype).t()
    B = make_b(k, n, "weight_t" if layouts[1] == "k" else "kn", "cuda", dtype)
    bias = rand(n, device="cuda", dtype=dtype)
    (y, z), names = gemm_kernels_run(lambda: torch.ops.cutlass_ext.linear(A, B, bias, "silu", True))
    assert len(names) == 1 and "lowk_gemm_kernel" in names[0], names
    assert_close_to_reference(y, ref_linear(A, B, bias, "silu"), peer_linear(A, B, bias, "silu"), dtype_name)
    assert_close_to_reference(z, ref_linear(A, B, bias, "none"), peer_linear(A, B, bias, "none"), dtype_name,
                              what="aux")
    # With C, in place: W += s * A @ B (a LoRA merge as a GEMM: lora_B is A, lora_A is B).
    monkeypatch.setenv("CUTLASS_EXT_LORA_MERGE_PASS", "0")
    W = rand(m, n, device="cuda", dtype=dtype)
    W0, ptr = W.clone(), W.data_ptr()
    _, names = gemm_kernels_run(lambda: torch.ops.cutlass_ext.lora_merge(W, B, A, -0.75))
    assert len(names) == 1 and "lowk_gemm_kernel" in names[0], names
    assert W.data_ptr() == ptr
    assert_close_to_reference(W, W0.double() - 0.75 * (A.double() @ B.double()), torch.addmm(W0, A, B, alpha=-0.75),
                              dtype_name, what="merged W")


@requires_cuda
@pytest.mark.parametrize("layouts", ["kk", "kn", "mk", "mn"])
@pytest.mark.parametrize("raster", [None, "along_m", "along_n"])
def test_lowk_kernel_walks_many_tiles_per_block(layouts, raster, monkeypatch):
    # The kernel's blocks are persistent: with more 64x128 tiles than fit the GPU at once each
    # block walks several, prefetching the next tiles' A (and C) while it writes one, and
    # reloading B where its walk enters the next column of tiles (or batch). along_m walks
    # contiguous ranges, M fastest; along_n one column of tiles a block, striped over the rows
    # of every batch (the default here: 17 columns of tiles fill 391 of an H200's 396 slots).
    # 3 x 1000 x 2056 has 3 * 16 * 17 = 816 tiles (partial in M and N) in three batches.
    monkeypatch.setenv("CUTLASS_EXT_GEMM_CONFIG", "lowk_64x128")
    if raster is not None:
        monkeypatch.setenv("CUTLASS_EXT_GEMM_RASTER", raster)
    L, m, k, n = 3, 1000, 16, 2056
    A = rand(L, m, k, device="cuda", dtype=torch.bfloat16)
    if layouts[0] == "m":
        A = rand(L, k, m, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    B = rand(L, k, n, device="cuda", dtype=torch.bfloat16, scale=k ** -0.5)
    if layouts[1] == "k":
        B = rand(L, n, k, device="cuda", dtype=torch.bfloat16, scale=k ** -0.5).transpose(1, 2)
    out, names = gemm_kernels_run(lambda: cutlass_ext.matmul(A, B))
    assert len(names) == 1 and "lowk_gemm_kernel" in names[0], names
    assert_close_to_reference(out, A.double() @ B.double(), torch.matmul(A, B), "bf16")
    # With C, in place, over 2048 x 4096 (512 tiles): a merge W += s * lora_B @ lora_A as a GEMM.
    monkeypatch.setenv("CUTLASS_EXT_LORA_MERGE_PASS", "0")
    W = rand(2048, 4096, device="cuda", dtype=torch.bfloat16)
    lora_B = rand(2048, k, device="cuda", dtype=torch.bfloat16)
    lora_A = rand(k, 4096, device="cuda", dtype=torch.bfloat16)
    if layouts[0] == "m":
        lora_B = rand(k, 2048, device="cuda", dtype=torch.bfloat16).t()
    if layouts[1] == "k":
        lora_A = rand(4096, k, device="cuda", dtype=torch.bfloat16).t()
    W0 = W.clone()
    _, names = gemm_kernels_run(lambda: torch.ops.cutlass_ext.lora_merge(W, lora_A, lora_B, 0.5))
    assert len(names) == 1 and "lowk_gemm_kernel" in names[0], names
    assert_close_to_reference(W, W0.double() + 0.5 * (lora_B.double() @ lora_A.double()),
                              torch.addmm(W0, lora_B, lora_A, alpha=0.5), "bf16", what="merged W")


@requires_cuda
def test_lowk_kernel_batched():
    A = rand(3, 100, 32, device="cuda", dtype=torch.bfloat16)
    B = rand(3, 32, 264, device="cuda", dtype=torch.bfloat16, scale=32 ** -0.5)
    out, names = gemm_kernels_run(lambda: cutlass_ext.matmul(A, B))
    assert len(names) == 1 and "lowk_gemm_kernel" in names[0], names
    assert_close_to_reference(out, A.double() @ B.double(), torch.matmul(A, B), "bf16")


@requires_cuda
def test_cuda_kernel_errors_with_numbers_raise():
    # The CUDA kernels' own checks (reached by calling the op directly, past the Python checks)
    # put sizes in their messages; they must raise, not crash the process.
    A = rand(16, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"bias must be a \[24\] "):
        torch.ops.cutlass_ext.linear(A, rand(32, 24, device="cuda", dtype=torch.bfloat16),
                                     rand(23, device="cuda", dtype=torch.bfloat16), "none", False, None)
    with pytest.raises(RuntimeError, match=r"shapes \[16, 32\] and \[31, 24\] cannot be multiplied"):
        torch.ops.cutlass_ext.matmul(A, rand(31, 24, device="cuda", dtype=torch.bfloat16), None)


@requires_cuda
def test_lowk_config_rejects_long_k():
    A = rand(64, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="lowk_64x128' is not built for this dtype, layout and epilogue and shape"):
        cutlass_ext.linear(A, A.t(), config="lowk_64x128")


@requires_cuda
def test_activation_codes_match_kernels():
    assert tuple(cutlass_ext.build().activation_names()) == _activation.ACTIVATIONS


@requires_cuda
def test_unknown_config_is_rejected(monkeypatch):
    monkeypatch.setenv("CUTLASS_EXT_GEMM_CONFIG", "no_such_config")
    A = rand(64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="no_such_config"):
        cutlass_ext.linear(A, A)


# ------------------------------------------------------------------------------------------------
# Bad input: every error names the argument


def _good(device="cpu"):
    return rand(8, 16, device=device, dtype=torch.float16), rand(16, 4, device=device, dtype=torch.float16)


@pytest.mark.parametrize(
    "mutate,exc,pattern",
    [
        (lambda A, B: (A.double(), B.double(), None, {}), TypeError, "A has dtype torch.float64"),
        (lambda A, B: (A, B.float(), None, {}), TypeError, "B has dtype torch.float32 but A"),
        (lambda A, B: (A, B, torch.zeros(4, dtype=torch.bfloat16), {}), TypeError, "bias has dtype"),
        (lambda A, B: (A, B.to("meta"), None, {}), ValueError, "B is on meta but A is on cpu"),
        (lambda A, B: (A, B[:8], None, {}), ValueError, "B has 8 rows"),
        (lambda A, B: (A, B.t(), None, {}), ValueError, "last dimension is K=16"),
        (lambda A, B: (A, B[:, 0], None, {}), ValueError, "B must be 2-D"),
        (lambda A, B: (A.sum(), B, None, {}), ValueError, "A must have at least 1 dimension"),
        (lambda A, B: (A, B, torch.zeros(5, dtype=torch.float16), {}), ValueError, r"bias must have shape \[N\]"),
        (lambda A, B: (A, B, None, {"activation": "tanh"}), ValueError, "activation must be one of"),
        (lambda A, B: (A, B, None, {"relu": True, "activation": "gelu"}), ValueError, "relu=True conflicts"),
        (lambda A, B: (A.numpy(), B, None, {}), TypeError, "A must be a torch.Tensor"),
    ],
)
def test_linear_rejects_bad_input(mutate, exc, pattern):
    A, B = _good()
    a, b, bias, kwargs = mutate(A, B)
    with pytest.raises(exc, match=pattern):
        cutlass_ext.linear(a, b, bias, **kwargs)


@pytest.mark.parametrize(
    "a_shape,b_shape,pattern",
    [((8,), (8, 4), "at least 2 dimensions"), ((8, 16), (8, 4), "K=16"), ((2, 8, 16), (3, 16, 4), "do not broadcast")],
)
def test_matmul_rejects_bad_input(a_shape, b_shape, pattern):
    with pytest.raises(ValueError, match=pattern):
        cutlass_ext.matmul(torch.randn(a_shape), torch.randn(b_shape))


@requires_cuda
def test_device_mix_with_cuda_is_rejected():
    A, B = _good()
    with pytest.raises(ValueError, match="B is on cuda:0 but A is on cpu"):
        cutlass_ext.linear(A, B.cuda())


def test_cpu_runs_without_extension():
    # The CPU path never loads (or builds) the CUDA extension.
    from cutlass_ext import _build

    A, B = _good()
    cutlass_ext.linear(A, B, relu=True)
    if not HAS_CUDA:
        assert _build._module is None


# ------------------------------------------------------------------------------------------------
# Small M (decode shapes): the heuristic takes the few-row kernel up to 16 rows and the transposed
# kernels above, each tile width, forward with and without an aux output, and the backward (dA = dZ
# W through the M-major weight).


@requires_cuda
@pytest.mark.parametrize("m", [1, 5, 16, 31, 33, 64, 100, 200, 256, 257])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
def test_small_m_forward_backward(dtype_name, m):
    dtype = DTYPES[dtype_name]
    k, n = 520, 2120  # N: 33 full 64-row tiles and a partial one
    A = rand(m, k, device="cuda", dtype=dtype)
    W = rand(n, k, device="cuda", dtype=dtype, scale=1 / math.sqrt(k))
    bias = rand(n, device="cuda", dtype=dtype)
    grad_out = rand(m, n, device="cuda", dtype=dtype)
    with torch.no_grad():
        y = cutlass_ext.linear(A, W.t(), bias, activation="relu")
    assert_close_to_reference(y, ref_linear(A, W.t(), bias, "relu"), peer_linear(A, W.t(), bias, "relu"), dtype_name)
    fn = lambda a, w, c: cutlass_ext.linear(a, w.t(), c, activation="gelu")  # noqa: E731
    out, ours = grads_of(fn, [A, W, bias], grad_out)
    _, peer = grads_of(lambda a, w, c: peer_linear(a, w.t(), c, "gelu"), [A, W, bias], grad_out)
    ref_out, ref = grads_of(lambda a, w, c: ref_linear(a, w.t(), c, "gelu"), [A.double(), W.double(), bias.double()],
                            grad_out.double())
    assert_close_to_reference(out, ref_out, peer_linear(A, W.t(), bias, "gelu"), dtype_name, what="y (aux kernel)")
    for name, o, p, r in zip(("dA", "dW", "dbias"), ours, peer, ref):
        assert_close_to_reference(o, r, p, dtype_name, what=name)


# ------------------------------------------------------------------------------------------------
# Between half a wave and two waves of 128x128 tiles the forward takes, past one round of 128x128
# tiles, one round of 128x144 or 128x192 tiles from K = 1024 (or 128x256 ones from K = 4096, the
# most tiles) where it covers at least 70% of the SMs; else the 128x128 tiles (cooperative from
# K = 4096, ping-pong below), the transposed 64x128 tiles or the 128x144 or 128x192 tiles,
# whichever leaves its last wave fuller (by more than a tenth of a wave, in that order of
# preference).


@requires_cuda
@pytest.mark.parametrize("k", [264, 2048, 4096])
@pytest.mark.parametrize("m,n", [(512, 4096), (768, 4096), (1024, 4096), (640, 3000), (1536, 1536), (2048, 2048),
                                 (1024, 3072), (1536, 2048), (2048, 1536)])
def test_mid_m_forward_takes_the_fuller_last_wave(m, k, n):
    name = heuristic_kernel(m, k, n)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    square = math.ceil(m / 128) * math.ceil(n / 128)
    if not (2 * square >= sms and square < 2 * sms):
        pytest.skip(f"{square} tiles of 128x128 are outside (half a wave, two waves) on {sms} SMs")
    width = one_round_tile_n(m, k, n, sms)
    if width is not None:  # one round of 128x144, 128x192 or 128x256 tiles over at least 70% of the SMs
        A = rand(m, k, device="cuda", dtype=torch.bfloat16)
        W = rand(n, k, device="cuda", dtype=torch.bfloat16)
        _, forced = gemm_kernels_run(lambda: cutlass_ext.linear(A, W.t(), relu=True, config=f"128x{width}_2x1_coop"))
        assert name == forced[0], (name, width)
        return
    fill = lambda tiles: tiles / (math.ceil(tiles / sms) * sms)  # noqa: E731
    expected, best = "square", fill(square)
    # The 144- or 192-wide tiles, whichever fills its last wave better.
    one_wave = max((math.ceil(m / 128) * math.ceil(n / w) for w in (144, 192)), key=fill)
    for kind, tiles in (("narrow", math.ceil(m / 128) * math.ceil(n / 64)), ("one_wave", one_wave)):
        if fill(tiles) > best + 0.1:
            expected, best = kind, fill(tiles)
    if expected == "narrow" or (expected == "square" and k < 4096):
        assert "Pingpong" in name, name
    else:
        assert "Cooperative" in name and "StreamK" not in name, name
        assert (is_144_wide(name) or "C<192>" in name or "ILi192E" in name) == (expected == "one_wave"), name


# From two waves of 128x128 tiles, the 128x144 tiles where their rounds over the SMs, weighted by
# their area, are at most 85% of the 128x128 tiles'.


@requires_cuda
@pytest.mark.parametrize("m,n", [(3072, 1536), (4608, 1536), (3072, 3072), (4096, 3072)])
def test_from_two_waves_the_144_wide_tiles_where_they_need_fewer_rounds(m, n):
    name = heuristic_kernel(m, 512, n)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    square = math.ceil(m / 128) * math.ceil(n / 128)
    if square < 2 * sms:
        pytest.skip(f"{square} tiles of 128x128 are under two waves on {sms} SMs")
    assert is_144_wide(name) == one_wave_tiles_take(m, n, sms), name


def is_144_wide(name):
    return "ILi144E" in name or "C<144>" in name


# Few columns over many rows with a short K (narrow MLP layers): the transposed product, in the
# widest 64-row tile whose grid fills the SMs at least once (at most 64 wide for up to 64 columns
# with K <= 256), else the narrowest.

NARROW_N_TILES = {16: "t64x16k128_pp", 32: "t64x32k128_pp", 64: "t64x64_pp", 128: "t64x128_pp"}


def heuristic_and_transposed_tiles(m, k, n):
    """(the heuristic's kernel for a bf16 m x k -> n linear, {tile width: the kernel that config
    runs} for each transposed 64-row tile); skips where those configs are not built."""
    built = dict(cutlass_ext.build().kernels())
    if not all(f"sm90_bf16_kk_bias_act_{c}" in built for c in NARROW_N_TILES.values()):
        pytest.skip("the transposed configs are not in this (selective) build")
    name = heuristic_kernel(m, k, n)
    A = rand(m, k, device="cuda", dtype=torch.bfloat16)
    W = rand(n, k, device="cuda", dtype=torch.bfloat16)
    forced = {}
    for tile_n, cfg in NARROW_N_TILES.items():
        _, names = gemm_kernels_run(lambda: cutlass_ext.linear(A, W.t(), config=cfg))
        forced[tile_n] = names[0]
    return name, forced


def assert_transposed_tile(name, forced, expected):
    """The heuristic's kernel ``name`` is the transposed tile of width ``expected`` among ``forced``
    (heuristic_and_transposed_tiles), or, where ``expected`` is None, none of them."""
    if expected is None:
        assert name not in forced.values(), name
    else:
        assert name == forced[expected], (name, expected)


@requires_cuda
@requires_sm90_path
@pytest.mark.parametrize("m,k,n", [(2048, 256, 64), (8192, 256, 64), (65536, 64, 16), (4100, 200, 250),
                                   (20000, 512, 17), (3000, 2048, 64), (65536, 4096, 8), (2048, 4096, 16),
                                   (2048, 8192, 16), (8192, 512, 256), (32768, 512, 256), (2048, 512, 256),
                                   (16384, 256, 64), (32768, 256, 64), (65536, 256, 64)])
def test_narrow_n_takes_the_transposed_tiles(m, k, n):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    name, forced = heuristic_and_transposed_tiles(m, k, n)
    expected = narrow_n_tile(m, k, n, sms)
    if narrow_kernel_takes(m, k, n):  # the hand-written narrow kernel comes first
        assert NARROW in name, name
    else:  # None: a long K keeps the other rules
        assert_transposed_tile(name, forced, expected)


# Few rows against a weight: up to 64 rows the transposed tile that holds them in one column tile;
# 65-256 rows in two column tiles, unless that grid takes more than two rounds over the SMs, where
# the general rules take the 128-row tiles.


@requires_cuda
@requires_sm90_path
@pytest.mark.parametrize("m,k,n", [(16, 4096, 4096), (32, 4096, 4096), (64, 4096, 11008), (128, 11008, 4096),
                                   (128, 4096, 11008), (256, 4096, 11008)])
def test_few_rows_take_the_transposed_tile_that_holds_them(m, k, n):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    name, forced = heuristic_and_transposed_tiles(m, k, n)
    assert_transposed_tile(name, forced, few_rows_tile(m, k, n, sms))


# A training forward of a GELU/SiLU layer (the aux epilogue) over a short K: the cooperative 128x128
# tile, which shares each tile's epilogue between both math warpgroups.


@requires_cuda
@requires_sm90_path
@pytest.mark.parametrize("m,k,n", [(4096, 128, 4096), (8192, 500, 250), (2048, 512, 256), (16384, 2048, 1024),
                                   (8192, 256, 64)])
def test_short_k_training_forward_takes_the_cooperative_tile(m, k, n):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    A = rand(m, k, device="cuda", dtype=torch.bfloat16)
    W = rand(n, k, device="cuda", dtype=torch.bfloat16, scale=k ** -0.5)
    bias = rand(n, device="cuda", dtype=torch.bfloat16)
    (y, z), names = gemm_kernels_run(lambda: torch.ops.cutlass_ext.linear(A, W.t(), bias, "gelu", True))
    assert len(names) == 1, names
    cooperative = "Cooperative" in names[0] and "StreamK" not in names[0]
    assert cooperative == aux_cooperative(m, k, n, sms), names[0]
    assert_close_to_reference(z, ref_linear(A, W.t(), bias, "none"), peer_linear(A, W.t(), bias, "none"), "bf16",
                              what="aux")
    assert_close_to_reference(y, ref_linear(A, W.t(), bias, "gelu"), peer_linear(A, W.t(), bias, "gelu"), "bf16")


# Below half a wave of 128x128 tiles with K <= 4096 and more than 256 columns: the transposed 64-row
# tiles, the narrowest whose grid runs in one round over at least half the SMs; a longer K keeps split-K.


@requires_cuda
@requires_sm90_path
@pytest.mark.parametrize("m,k,n", [(512, 512, 512), (1024, 1024, 1024), (1024, 4096, 1024), (600, 1000, 700),
                                   (300, 2048, 1000), (1024, 8192, 1024)])
def test_below_half_a_wave_takes_the_transposed_tiles(m, k, n):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert 2 * math.ceil(m / 128) * math.ceil(n / 128) < sms
    name, forced = heuristic_and_transposed_tiles(m, k, n)
    one_round = [t for t in NARROW_N_TILES if sms <= 2 * math.ceil(n / 64) * math.ceil(m / t) <= 2 * sms]
    if k > 4096 or not one_round:
        assert name not in forced.values(), name
        assert "StreamKScheduler" in name, name
        return
    expected = min(one_round)
    assert name == forced[expected], (name, expected)


@requires_cuda
@requires_sm90_path
@pytest.mark.parametrize("k", [4096, 8192])
def test_partial_second_wave_with_a_long_k_takes_stream_k(k):
    # 6 row tiles of 128 and enough column tiles for about 1.3 waves of 128x128 tiles. With a
    # row-major B (no 144- or 192-wide tiles for that layout): the stream-K decomposition from
    # K = 8192 on, a data-parallel kernel below. With a weight (a K-major B): one round of wider
    # tiles ahead of both (tests/test_select.py has the rules).
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = 128 * math.ceil(1.3 * sms / 6)
    tiles = 6 * n // 128
    assert sms < tiles < 1.5 * sms
    A = rand(768, k, device="cuda", dtype=torch.bfloat16)
    B = rand(k, n, device="cuda", dtype=torch.bfloat16, scale=k ** -0.5)
    bias = rand(n, device="cuda", dtype=torch.bfloat16)
    y, names = gemm_kernels_run(lambda: cutlass_ext.linear(A, B, bias, relu=True))
    assert len(names) == 1 and ("StreamKScheduler" in names[0]) == (k >= 8192), [name[:200] for name in names]
    assert_close_to_reference(y, ref_linear(A, B, bias, "relu"), peer_linear(A, B, bias, "relu"), "bf16")
    width = one_round_tile_n(768, k, n, sms)
    assert width is not None
    name = heuristic_kernel(768, k, n)
    assert f"ILi{width}E" in name or f"C<{width}>" in name, name


@requires_cuda
@requires_sm90_path
@pytest.mark.parametrize("n", [128, 72])
def test_one_column_tile_takes_the_transposed_tile(n):
    # [32, 1024, 2048] @ [32, 2048, n]: 256 output tiles of 128x128, one column tile each: the
    # transposed 64-row tile instead of the 1x2 cluster, whose second CTA would have no columns
    # (tests/test_select.py has the rule).
    A = rand(32, 1024, 2048, device="cuda", dtype=torch.bfloat16)
    B = rand(32, 2048, n, device="cuda", dtype=torch.bfloat16)
    out, names = gemm_kernels_run(lambda: cutlass_ext.matmul(A, B))
    _, forced = gemm_kernels_run(lambda: cutlass_ext.matmul(A, B, config="t64x128_pp"))
    assert len(names) == 1 and names == forced, [name[:200] for name in names]
    assert_close_to_reference(out, A.double() @ B.double(), torch.matmul(A, B), "bf16")


@requires_cuda
@requires_sm90_path
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
def test_several_rounds_over_a_long_k_take_the_wide_tile_in_training(dtype_name, monkeypatch):
    # A GELU layer's training step at 4096 x 4096 -> 4096 (3.9 rounds of 128x256 tiles on 132 SMs,
    # K = 4096): the forward with its pre-activation, dX and dW all on the cooperative 128x256
    # tile (select_kernel, bench/NOTES.md sections 44-46); 1536 rows stay on 128x128 tiles (fewer
    # than 2048 rows in the forward and dX, a K of 1536 in dW).
    built = dict(cutlass_ext.build().kernels())
    wide = [f"sm90_{dtype_name}_{e}_128x256_2x1_coop" for e in ("kk_bias_act_aux", "kn_plain", "mn_plain")]
    if not all(n in built for n in wide):
        pytest.skip("the 16-bit 128x256 kernels are not in this (selective) build")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    dtype = DTYPES[dtype_name]
    for m in (4096, 1536):
        k = n = 4096
        # The forward, dX = dY W and dW = dY^T X.
        takes = {wide_tile(m, k, n, sms), wide_tile(m, n, k, sms), wide_tile(n, m, k, sms)}
        assert len(takes) == 1, (m, takes)
        takes_wide = takes.pop()
        x = rand(m, k, device="cuda", dtype=dtype).requires_grad_()
        W = rand(n, k, device="cuda", dtype=dtype, scale=k ** -0.5).requires_grad_()
        bias = rand(n, device="cuda", dtype=dtype).requires_grad_()
        dy = rand(m, n, device="cuda", dtype=dtype)

        def step():
            y = cutlass_ext.linear(x, W.t(), bias, activation="gelu")
            return (y,) + torch.autograd.grad(y, (x, W, bias), dy)

        outs, kernels = gemm_kernels_run(step)
        gemms = [n for n in kernels if "Gemm" in n]
        assert len(gemms) == 3, kernels
        with monkeypatch.context() as patch:
            patch.setenv("CUTLASS_EXT_GEMM_CONFIG", "128x256_2x1_coop")
            _, forced = gemm_kernels_run(step)
        wide_runs = [n == f for n, f in zip(gemms, [n for n in forced if "Gemm" in n])]
        assert all(wide_runs) if takes_wide else not any(wide_runs), (m, gemms)
        # The results against float64 (the peer: torch's own step in this dtype).
        ref_y, ref = grads_of(lambda a, w, c: ref_linear(a, w.t(), c, "gelu"),
                              [x.double(), W.double(), bias.double()], dy.double())
        peer_y, peer = grads_of(lambda a, w, c: peer_linear(a, w.t(), c, "gelu"), [x, W, bias], dy)
        for what, o, r, p in zip(("y", "dx", "dW", "dbias"), outs, [ref_y, *ref], [peer_y, *peer]):
            assert_close_to_reference(o, r, p, dtype_name, what=what)


@requires_cuda
@requires_sm90_path
def test_two_waves_take_the_2x2_cluster_where_it_needs_no_more_rounds():
    ext = cutlass_ext.build()
    wide_name, dp_name = "sm90_bf16_kk_bias_act_128x128_2x2_pp", "sm90_bf16_kk_bias_act_128x128_1x2_pp"
    built = dict(ext.kernels())
    if wide_name not in built or dp_name not in built:
        pytest.skip("the 128x128 ping-pong configs are not in this (selective) build")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wide_ctas = min(sms, 4 * ext._gemm_active_clusters(wide_name))
    dp_ctas = min(sms, 2 * ext._gemm_active_clusters(dp_name))
    assert 0 < wide_ctas <= sms and 0 < dp_ctas <= sms
    # 1024 rows (8 row tiles) against just over two waves of tiles, ~2.4 waves, then exactly four
    # waves; where fewer rounds of 128x144 tiles cost less, those (the rule above).
    checked = 0
    for n_tiles in (math.ceil((2 * sms + 8) / 8), math.ceil(2.4 * sms / 8), math.ceil(4 * sms / 8)):
        tiles = 8 * n_tiles
        takes_wide = math.ceil(tiles / wide_ctas) <= math.ceil(tiles / dp_ctas)
        name = heuristic_kernel(1024, 512, 128 * n_tiles)
        if one_wave_tiles_take(1024, 128 * n_tiles, sms):
            assert is_144_wide(name), name
            continue
        checked += 1
        A = rand(1024, 512, device="cuda", dtype=torch.bfloat16)
        W = rand(128 * n_tiles, 512, device="cuda", dtype=torch.bfloat16)
        _, forced = gemm_kernels_run(lambda: cutlass_ext.linear(A, W.t(), config="128x128_2x2_pp"))
        assert (name == forced[0]) == takes_wide, (tiles, wide_ctas, dp_ctas, name)
    assert checked >= 2


@requires_cuda
@requires_sm90_path
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["kn", "weight_t"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_stream_k_decomposition_is_correct_and_deterministic(dtype_name, layout, activation):
    # About 1.4 waves of 128x128 tiles with partial tiles at both edges: the stream-K config splits
    # the K loops of its tiles between SMs (split count 0) and reduces them in a fixed order.
    dtype = DTYPES[dtype_name]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m = 128 * 5 + 37
    n = 128 * (math.ceil(1.4 * sms / 6) - 1) + 72
    k = 2000
    A = rand(m, k, device="cuda", dtype=dtype)
    B = make_b(k, n, layout, "cuda", dtype)
    bias = rand(n, device="cuda", dtype=dtype)
    run = lambda: cutlass_ext.linear(A, B, bias, activation=activation, config="128x128_1x1_coop_sk")  # noqa: E731
    y, names = gemm_kernels_run(run)
    assert len(names) == 1 and "StreamKScheduler" in names[0], names
    assert_close_to_reference(y, ref_linear(A, B, bias, activation), peer_linear(A, B, bias, activation), dtype_name)
    for _ in range(3):
        assert torch.equal(run(), y)


# ------------------------------------------------------------------------------------------------
# Weight gradients over many rows: equal K slices into fp32 partial products, added in a fixed order


@requires_cuda
@requires_sm90_path
@pytest.mark.parametrize("dtype_name,rows,fin,fout,sliced", [
    # (Layers of up to 16 output columns over up to 2^20 elements take the few-column backward.)
    ("bf16", 65536, 64, 32, True), ("fp16", 32768, 256, 64, True), ("bf16", 8200, 64, 32, True),
    ("bf16", 8248, 64, 32, False),  # 8248 = 8 x 1031: no equal 8-aligned slices, CUTLASS's split-K
    # A 13-wide input (not a multiple of 8 elements) is copied padded and N-major, which keeps K slices.
    ("bf16", 8192, 13, 512, True), ("fp16", 2048, 13, 64, True),
])
def test_weight_gradient_over_many_rows_runs_as_k_slices(dtype_name, rows, fin, fout, sliced):
    dtype = DTYPES[dtype_name]
    x = rand(rows, fin, device="cuda", dtype=dtype).requires_grad_()
    W = rand(fout, fin, device="cuda", dtype=dtype, scale=fin ** -0.5).requires_grad_()
    dy = rand(rows, fout, device="cuda", dtype=dtype)

    def backward():
        W.grad = x.grad = None
        cutlass_ext.linear(x, W.t()).backward(dy)
        return W.grad

    dW, names = cuda_kernels_run(backward)
    assert any("sum_partials" in n for n in names) == sliced, names
    assert any("StreamK" in n for n in names) != sliced, names
    ref = dy.double().t() @ x.double()
    assert_close_to_reference(dW, ref, dy.t() @ x, dtype_name, what="dW")
    assert torch.equal(backward(), dW)  # the slices are added in a fixed order


@requires_cuda
@requires_sm90_path
def test_one_row_product_over_many_rows_runs_as_k_slices():
    # dZ^T X of a one-column layer as a product: a one-row (K-major) A over 8192 rows.
    dz = rand(8192, 1, device="cuda", dtype=torch.bfloat16)
    x = rand(8192, 256, device="cuda", dtype=torch.bfloat16)
    out, names = cuda_kernels_run(lambda: cutlass_ext.matmul(dz.t(), x))
    assert any("sum_partials" in n for n in names), names
    assert_close_to_reference(out, dz.double().t() @ x.double(), dz.t() @ x, "bf16")


@requires_cuda
@requires_sm90_path
def test_k_slices_config_is_forced_or_refused_by_name():
    # By name the K-slices kernel runs any plain product it can cut; one it cannot is refused.
    A = rand(4096, 300, device="cuda", dtype=torch.bfloat16).t()
    B = rand(4096, 200, device="cuda", dtype=torch.bfloat16, scale=1 / 64)
    out, names = cuda_kernels_run(lambda: cutlass_ext.matmul(A, B, config="128x128_1x1_coop"))
    assert any("sum_partials" in n for n in names), names
    assert_close_to_reference(out, A.double() @ B.double(), A @ B, "bf16")
    with pytest.raises(RuntimeError, match="cuts K = 264 into equal slices"):
        cutlass_ext.matmul(rand(300, 264, device="cuda", dtype=torch.bfloat16).t().t(),
                           rand(264, 200, device="cuda", dtype=torch.bfloat16), config="128x128_1x1_coop")


# ------------------------------------------------------------------------------------------------
# config=: a config forced per call (the benchmarks' override)


def test_config_argument_is_checked(device):
    A, B = rand(8, 16, device=device, dtype=torch.bfloat16), make_b(16, 24, "kn", device, torch.bfloat16)
    for fn in (lambda c: cutlass_ext.linear(A, B, config=c), lambda c: cutlass_ext.matmul(A, B, config=c)):
        with pytest.raises(ValueError, match="config must be None or one of .*t64x32k128_pp"):
            fn("no_such_config")
        with pytest.raises(ValueError, match="config must be None"):
            fn(3)


def test_config_argument_on_cpu_is_ignored():
    A, B = rand(8, 16, device="cpu", dtype=torch.float32), make_b(16, 24, "kn", "cpu", torch.float32)
    assert torch.equal(cutlass_ext.linear(A, B, config="t64x16k128_pp"), cutlass_ext.linear(A, B))
    assert torch.equal(cutlass_ext.matmul(A, B, config="128x128_1x2_pp"), cutlass_ext.matmul(A, B))


def test_opcheck_with_config(device):
    A, B, bias = _opcheck_inputs(device)
    config = "128x128_1x1_coop_sk"
    torch.library.opcheck(torch.ops.cutlass_ext.linear.default, (A, B, bias, "gelu", True, config))
    torch.library.opcheck(torch.ops.cutlass_ext.matmul.default, (A, B, config))


@requires_cuda
@requires_sm90_path
@pytest.mark.parametrize("config", ["128x128_1x2_pp", "128x128_1x1_coop_sk", "t64x16k128_pp", "t64x128_pp"])
def test_config_argument_selects_the_kernel(config):
    A = rand(48, 256, device="cuda", dtype=torch.bfloat16)
    W = rand(320, 256, device="cuda", dtype=torch.bfloat16, scale=1 / 16)
    bias = rand(320, device="cuda", dtype=torch.bfloat16)
    y, names = cuda_kernels_run(lambda: cutlass_ext.linear(A, W.t(), bias, relu=True, config=config))
    names = [n for n in names if "GemmUniversal" in n]
    assert len(names) == 1
    assert_close_to_reference(y, ref_linear(A, W.t(), bias, "relu"), peer_linear(A, W.t(), bias, "relu"), "bf16")
    cfg = {c.name: c for c in _kernel_table.all_configs()}[config]
    assert cfg.schedule in names[0] and ("StreamKScheduler" in names[0]) == cfg.stream_k
    _CONFIG_KERNELS[config] = names[0]
    # Each config ran a kernel of its own (the tile shape and layouts differ where the schedule doesn't).
    assert len(set(_CONFIG_KERNELS.values())) == len(_CONFIG_KERNELS)


_CONFIG_KERNELS: dict[str, str] = {}


@requires_cuda
def test_config_not_built_for_the_layout_is_rejected():
    A = rand(64, 64, device="cuda", dtype=torch.float32)  # TF32 builds no ping-pong config
    with pytest.raises(RuntimeError, match="128x128_1x2_pp' is not built"):
        cutlass_ext.linear(A, A, config="128x128_1x2_pp")


@requires_cuda
def test_compile_with_config():
    A = rand(16, 256, device="cuda", dtype=torch.bfloat16)
    W = rand(512, 256, device="cuda", dtype=torch.bfloat16, scale=1 / 16)
    fn = torch.compile(lambda a, w: cutlass_ext.linear(a, w.t(), activation="silu", config="t64x32k128_pp"),
                       fullgraph=True)
    assert_close_to_reference(fn(A, W), ref_linear(A, W.t(), None, "silu"), peer_linear(A, W.t(), None, "silu"),
                              "bf16")


# ------------------------------------------------------------------------------------------------
# Autotuning: measured once per bucket, persisted, reused; never while capturing a graph


@pytest.fixture
def tuning_table(tmp_path):
    from cutlass_ext import tuning

    ext = cutlass_ext.build()
    path = tmp_path / "tuning.tsv"
    ext._configure_tuning(str(path), False)
    yield ext, path
    ext._configure_tuning(str(tuning.tuning_file()), tuning.autotune_from_environment())


@requires_cuda
@requires_sm90_path
def test_autotune_records_and_reuses(tuning_table):
    ext, path = tuning_table
    A = rand(96, 512, device="cuda", dtype=torch.bfloat16)
    W = rand(1024, 512, device="cuda", dtype=torch.bfloat16, scale=1 / 16)
    bias = rand(1024, device="cuda", dtype=torch.bfloat16)
    with cutlass_ext.tune():
        y = cutlass_ext.linear(A, W.t(), bias, relu=True)
    assert not ext._tuning_enabled()
    entries = cutlass_ext.tuning.entries()
    assert len(entries) == 1
    (key, config), = entries.items()
    assert "|bf16|tensorop|kk|plain|128x1024x512|single" in key and config in _kernel_table.config_names()
    assert path.read_text() == f"{key}\t{config}\n"
    assert_close_to_reference(y, ref_linear(A, W.t(), bias, "relu"), peer_linear(A, W.t(), bias, "relu"), "bf16")
    # Same bucket (M 65..128): reused, nothing new measured; a new process reads the file.
    with cutlass_ext.tune():
        cutlass_ext.linear(A[:70], W.t(), bias, relu=True)
    assert cutlass_ext.tuning.entries() == entries
    ext._clear_tuning()
    ext._configure_tuning(str(path), False)
    assert cutlass_ext.tuning.entries() == entries


@requires_cuda
@requires_sm90_path
@pytest.mark.parametrize("sustain_ms", [0, 30])
def test_autotune_with_and_without_the_sustained_round(tuning_table, sustain_ms):
    # 0: the quickest burst wins; 30: the finalists run alone 30 ms each before their timing
    # (the rule itself: tests/test_tuning_rule_host.py).
    ext, _ = tuning_table
    previous = ext._tuning_sustain_ms()
    ext._set_tuning_sustain_ms(sustain_ms)
    assert ext._tuning_sustain_ms() == sustain_ms
    A = rand(256, 1024, device="cuda", dtype=torch.bfloat16)
    W = rand(2048, 1024, device="cuda", dtype=torch.bfloat16, scale=1 / 32)
    bias = rand(2048, device="cuda", dtype=torch.bfloat16)
    try:
        with cutlass_ext.tune():
            y = cutlass_ext.linear(A, W.t(), bias, relu=True)
    finally:
        ext._set_tuning_sustain_ms(previous)
    (config,) = cutlass_ext.tuning.entries().values()
    assert config in _kernel_table.config_names()
    assert_close_to_reference(y, ref_linear(A, W.t(), bias, "relu"), peer_linear(A, W.t(), bias, "relu"), "bf16")


@requires_cuda
@requires_sm90_path
def test_autotune_of_a_product_shorter_than_its_launch(tuning_table):
    # A few-microsecond product: the timed runs wait behind a stream hold (gemm.cpp
    # time_median_ms), whose still-running query must not leave an error for the next launch.
    A = rand(2048, 256, device="cuda", dtype=torch.bfloat16)
    W = rand(64, 256, device="cuda", dtype=torch.bfloat16, scale=1 / 16)
    bias = rand(64, device="cuda", dtype=torch.bfloat16)
    with cutlass_ext.tune():
        y = cutlass_ext.linear(A, W.t(), bias, relu=True)
    (config,) = cutlass_ext.tuning.entries().values()
    assert config in _kernel_table.config_names()
    # The next calls launch cleanly and the tuned config gives the same product.
    again = cutlass_ext.linear(A, W.t(), bias, relu=True)
    torch.cuda.synchronize()
    for out in (y, again):
        assert_close_to_reference(out, ref_linear(A, W.t(), bias, "relu"), peer_linear(A, W.t(), bias, "relu"), "bf16")


@requires_cuda
@requires_sm90_path
def test_autotune_in_place_accumulation_is_not_repeated(tuning_table, monkeypatch):
    # Tuning runs each candidate into scratch outputs: an in-place W += s * B A must add once.
    monkeypatch.setenv("CUTLASS_EXT_LORA_MERGE_PASS", "0")  # the merge as a GEMM
    W = rand(256, 192, device="cuda", dtype=torch.bfloat16)
    lora_a = rand(16, 192, device="cuda", dtype=torch.bfloat16)
    lora_b = rand(256, 16, device="cuda", dtype=torch.bfloat16)
    expected = W.double() + 0.5 * (lora_b.double() @ lora_a.double())
    with cutlass_ext.tune():
        torch.ops.cutlass_ext.lora_merge(W, lora_a, lora_b, 0.5)
    assert len(cutlass_ext.tuning.entries()) == 1
    assert_close_to_reference(W, expected, None, "bf16", what="merged W")


@requires_cuda
@requires_sm90_path
def test_autotune_skips_graph_capture(tuning_table):
    A = rand(32, 256, device="cuda", dtype=torch.bfloat16)
    W = rand(384, 256, device="cuda", dtype=torch.bfloat16, scale=1 / 16)
    static = {}
    with cutlass_ext.tune():
        graph, static["y"] = capture_cuda_graph(lambda: cutlass_ext.linear(A, W.t(), relu=True))
    # The warm-up call outside the capture tuned the bucket; the captured call only read it.
    assert len(cutlass_ext.tuning.entries()) == 1
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_reference(static["y"], ref_linear(A, W.t(), None, "relu"), peer_linear(A, W.t(), None, "relu"),
                              "bf16")


# ------------------------------------------------------------------------------------------------
# The Ampere path (CUTLASS 2.x kernels), chosen on 8.x GPUs and on Hopper by CUTLASS_EXT_GEMM_ARCH


@requires_cuda
@pytest.mark.parametrize("b_layout", ["kn", "weight_t"])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16", "tf32"])
def test_sm80_path(dtype_name, b_layout, monkeypatch):
    monkeypatch.setenv("CUTLASS_EXT_GEMM_ARCH", "sm80")
    dtype = DTYPES[dtype_name]
    A = rand(2, 75, 136, device="cuda", dtype=dtype)
    B = make_b(136, 200, b_layout, device="cuda", dtype=dtype)
    if b_layout == "weight_t":
        B = B.t().detach().clone().t()
    bias = rand(200, device="cuda", dtype=dtype)
    grad_out = rand(2, 75, 200, device="cuda", dtype=dtype)
    with fp32_precision(dtype_name):
        (out, ours), names = cuda_kernels_run(
            lambda: grads_of(lambda a, b, c: cutlass_ext.linear(a, b, c, activation="gelu"), [A, B, bias], grad_out))
        peer_out, peer = grads_of(lambda a, b, c: peer_linear(a, b, c, "gelu"), [A, B, bias], grad_out)
    ref_out, ref = grads_of(lambda a, b, c: ref_linear(a, b, c, "gelu"), [A.double(), B.double(), bias.double()],
                            grad_out.double())
    assert_close_to_reference(out, ref_out, peer_out, dtype_name)
    for name, o, p, r in zip(("dA", "dB", "dbias"), ours, peer, ref):
        assert_close_to_reference(o, r, p, dtype_name, what=name)
    gemms = [n for n in names if "Gemm" in n]
    assert len(gemms) == 3 and not any("Sm90" in n for n in gemms), gemms


@requires_cuda
@pytest.mark.parametrize("setting, value, message", [
    ("CUTLASS_EXT_GEMM_ARCH", "sm70", "CUTLASS_EXT_GEMM_ARCH=sm70 must be sm90 or sm80"),
    ("CUTLASS_EXT_GEMM_RASTER", "diagonal", "CUTLASS_EXT_GEMM_RASTER=diagonal must be along_m or along_n"),
    ("CUTLASS_EXT_GEMM_SWIZZLE", "3", "CUTLASS_EXT_GEMM_SWIZZLE=3 must be 1, 2, 4 or 8"),
])
def test_gemm_settings_are_checked(monkeypatch, setting, value, message):
    A = rand(16, 32, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv(setting, value)
    with pytest.raises(RuntimeError, match=message):
        cutlass_ext.linear(A, A.t())


@requires_cuda
def test_gemm_arch_setting_keeps_a_named_config(monkeypatch):
    A = rand(16, 32, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("CUTLASS_EXT_GEMM_ARCH", "sm80")
    # A config names its path: a Hopper config still runs the Hopper kernels.
    y = cutlass_ext.linear(A, A.t(), config="t64x32k128_pp")
    assert_close_to_reference(y, ref_linear(A, A.t(), None, "none"), peer_linear(A, A.t(), None, "none"), "bf16")


@requires_cuda
@requires_sm90_path
@pytest.mark.parametrize("swizzle", ["1", "8"])
@pytest.mark.parametrize("raster", ["along_m", "along_n"])
def test_tile_order_settings(monkeypatch, swizzle, raster):
    # The persistent scheduler's tile order (bench/NOTES.md section 43) changes which tile runs
    # when, never the result: a product of 12 x 20 tiles with a partial edge, bias and GELU.
    A = rand(12 * 128 - 5, 256, device="cuda", dtype=torch.bfloat16)
    B = make_b(256, 20 * 128 - 3, "weight_t", "cuda", torch.bfloat16)
    bias = rand(20 * 128 - 3, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setenv("CUTLASS_EXT_GEMM_SWIZZLE", swizzle)
    monkeypatch.setenv("CUTLASS_EXT_GEMM_RASTER", raster)
    y = cutlass_ext.linear(A, B, bias, activation="gelu")
    assert_close_to_reference(y, ref_linear(A, B, bias, "gelu"), peer_linear(A, B, bias, "gelu"), "bf16")


@requires_cuda
@requires_sm90_path
@pytest.mark.parametrize("m", [1, 40, 700])
def test_tf32_n_major_b_needs_no_copy(m):
    # fp32 A @ B with a row-major [K, N] B: the transposed TF32 kernels (from 9 rows) or the
    # few-row kernel (up to 8) read it in place.
    A = rand(m, 264, device="cuda", dtype=torch.float32)
    B = make_b(264, 520, "kn", "cuda", torch.float32)
    with fp32_precision("tf32"):
        y, names = cuda_kernels_run(lambda: cutlass_ext.matmul(A, B))
        peer = A @ B
    assert_close_to_reference(y, A.double() @ B.double(), peer, "tf32")
    # One kernel ran, in particular no copy of B.
    assert len(names) == 1 and ("GemmUniversal" in names[0] or FEWROWS in names[0]), names


# ------------------------------------------------------------------------------------------------
# The hand-written few-column kernel (gemv: N <= 16, one dot product per output, unpadded operands)

GEMV = "gemv_gemm_kernel"


def check_batched_on_one_kernel(A, B, kernel, dtype_name):
    """A batched matmul runs as one launch of `kernel` and matches float64."""
    with fp32_precision(dtype_name):
        y, names = cuda_kernels_run(lambda: cutlass_ext.matmul(A, B))
        peer = torch.matmul(A, B)
    assert len(names) == 1 and kernel in names[0], names
    assert_close_to_reference(y, A.double() @ B.double(), peer, dtype_name)


def _a_layout(m, k, layout, dtype):
    if layout == "plain":
        return rand(m, k, device="cuda", dtype=dtype)
    if layout == "offset":  # rows of k elements at a row stride of k + 3, starting one element in
        return rand(m, k + 3, device="cuda", dtype=dtype)[:, 1:k + 1]
    return rand(2 * m, k, device="cuda", dtype=dtype)[::2]  # "rows": every other row


def _b_layout(k, n, layout, dtype):
    if layout == "strided":  # neither dimension contiguous
        return make_b(k, 2 * n, "kn", "cuda", dtype)[:, ::2]
    return make_b(k, n, layout, "cuda", dtype)


@requires_cuda
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
@pytest.mark.parametrize("m,k,n", [(1, 256, 1), (37, 13, 3), (300, 264, 1), (4099, 64, 16), (1000, 1000, 13),
                                   (513, 7, 8), (64, 1, 2), (300, 2048, 4), (3, 12000, 1)])
def test_gemv_kernel(dtype_name, m, k, n):
    dtype = DTYPES[dtype_name]
    A = rand(m, k, device="cuda", dtype=dtype)
    B = make_b(k, n, "weight_t", "cuda", dtype)
    bias = rand(n, device="cuda", dtype=dtype)
    with fp32_precision(dtype_name):
        (y, aux), names = cuda_kernels_run(lambda: torch.ops.cutlass_ext.linear(A, B, bias, "gelu", True, "gemv_n16"))
        peer_z = peer_linear(A, B, bias, "none")
    # One launch: no padded copies of A, B, the bias or the output.
    assert len(names) == 1 and GEMV in names[0], names
    assert_close_to_reference(aux, ref_linear(A, B, bias, "none"), peer_z, dtype_name, what="aux")
    assert_close_to_reference(y, ref_linear(A, B, bias, "gelu"), act_ref(peer_z, "gelu"), dtype_name)


@requires_cuda
@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
@pytest.mark.parametrize("a_layout", ["offset", "rows"])
@pytest.mark.parametrize("b_layout", ["kn", "strided"])
@pytest.mark.parametrize("k", [13, 64, 257])
def test_gemv_kernel_reads_views_in_place(dtype_name, a_layout, b_layout, k):
    dtype = DTYPES[dtype_name]
    A = _a_layout(203, k, a_layout, dtype)
    B = _b_layout(k, 3, b_layout, dtype)
    bias = rand(6, device="cuda", dtype=dtype)[::2]  # a strided bias is copied (3 elements), nothing else
    with fp32_precision(dtype_name):
        y, names = cuda_kernels_run(lambda: cutlass_ext.linear(A, B, bias, relu=True))
        peer = peer_linear(A, B, bias, "relu")
    assert sum(GEMV in n for n in names) == 1 and len(names) <= 2, names
    assert_close_to_reference(y, ref_linear(A, B, bias, "relu"), peer, dtype_name)


@requires_cuda
@pytest.mark.parametrize("dtype_name", ["fp16", "tf32"])
@pytest.mark.parametrize("shared_b", [False, True])
def test_gemv_kernel_batched(dtype_name, shared_b):
    dtype = DTYPES[dtype_name]
    A = rand(3, 130, 72, device="cuda", dtype=dtype)
    B = make_b(72, 4, "kn", "cuda", dtype)
    B = B.expand(3, 72, 4) if shared_b else torch.stack([B, 2 * B, -B])
    check_batched_on_one_kernel(A, B, GEMV, dtype_name)


@requires_cuda
def test_gemv_kernel_gradients():
    # A 256 -> 1 layer in training: the forward on the few-column kernel, the backward in the
    # few-column backward's one pass; gradients against float64.
    A = rand(777, 256, device="cuda", dtype=torch.bfloat16).requires_grad_()
    W = rand(1, 256, device="cuda", dtype=torch.bfloat16, scale=1 / 16).requires_grad_()
    bias = rand(1, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = rand(777, 1, device="cuda", dtype=torch.bfloat16)
    y = cutlass_ext.linear(A, W.t(), bias, activation="silu")
    y.backward(dy)
    check_layer_against_float64(y, A, W, bias, dy, F.silu)


def check_layer_against_float64(y, A, W, bias, dy, act, out_tolerance="bf16", grad_tolerance=None):
    """y = act(A W^T + bias) and the gradients that y.backward(dy) left in A, W and bias match
    float64, with torch's own layer as the peer (run under the caller's precision settings); the
    output within out_tolerance's bound, the gradients within grad_tolerance's (the same by default)."""
    A64, W64, b64 = (t.detach().double().requires_grad_() for t in (A, W, bias))
    y64 = act(A64 @ W64.t() + b64)
    y64.backward(dy.double())
    Ap, Wp, bp = (t.detach().clone().requires_grad_() for t in (A, W, bias))
    yp = act(F.linear(Ap, Wp, bp))
    yp.backward(dy)
    assert_close_to_reference(y, y64, yp, out_tolerance)
    for ours, ref, peer, what in ((A.grad, A64.grad, Ap.grad, "dA"), (W.grad, W64.grad, Wp.grad, "dW"),
                                  (bias.grad, b64.grad, bp.grad, "dbias")):
        assert_close_to_reference(ours, ref, peer, grad_tolerance or out_tolerance, what=what)


@requires_cuda
@pytest.mark.parametrize("m,k,n,expected", [(20000, 512, 1, True), (2048, 4096, 1, True), (65536, 64, 4, True),
                                            (2048, 1024, 3, True), (2048, 4096, 4, True), (65536, 64, 8, False),
                                            (2048, 256, 16, False)])
def test_gemv_heuristic(m, k, n, expected):
    # N <= 4 (and B within the kernel's shared memory).
    A = rand(m, k, device="cuda", dtype=torch.bfloat16)
    W = rand(n, k, device="cuda", dtype=torch.bfloat16, scale=k ** -0.5)
    _, names = cuda_kernels_run(lambda: cutlass_ext.linear(A, W.t(), relu=True))
    assert any(GEMV in n for n in names) == expected, names


@requires_cuda
@pytest.mark.parametrize("policy", ["tf32", "fp32"])
@pytest.mark.parametrize("m,n", [(2048, 13), (2048, 16), (2048, 17), (16384, 16), (16385, 16), (40000, 13), (40000, 4)])
def test_gemv_heuristic_fp32(policy, m, n):
    # fp32 takes the few-column kernel up to N = 16 (dX of a 13-feature layer): without TF32 always,
    # with TF32 over more than 16384 rows only where N <= 4 or N is not a multiple of 4 (else the
    # transposed tiles are faster).
    A = rand(m, 512, device="cuda", dtype=torch.float32)
    B = make_b(512, n, "kn", "cuda", torch.float32)
    expected = n <= 16 and (policy == "fp32" or m <= 16384 or n <= 4 or n % 4 != 0)
    with fp32_precision(policy):
        y, names = cuda_kernels_run(lambda: cutlass_ext.matmul(A, B))
        peer = torch.matmul(A, B)
    assert any(GEMV in name for name in names) == expected, names
    assert_close_to_reference(y, A.double() @ B.double(), peer, policy)


@requires_cuda
def test_gemv_config_rejects_what_it_cannot_run():
    A = rand(64, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="config 'gemv_n16' takes N <= 16"):
        cutlass_ext.linear(A, rand(32, 17, device="cuda", dtype=torch.bfloat16), config="gemv_n16")
    with pytest.raises(RuntimeError, match="a K-major A"):
        cutlass_ext.linear(rand(32, 64, device="cuda", dtype=torch.bfloat16).t(),
                           rand(32, 4, device="cuda", dtype=torch.bfloat16), config="gemv_n16")
    # Forced where the heuristic would not take it: still correct.
    A = rand(100, 4096, device="cuda", dtype=torch.bfloat16)
    B = make_b(4096, 16, "weight_t", "cuda", torch.bfloat16)
    with pytest.raises(RuntimeError, match="72 KB"):
        cutlass_ext.linear(A, B, config="gemv_n16")
    A = rand(100, 2048, device="cuda", dtype=torch.bfloat16)
    B = make_b(2048, 8, "weight_t", "cuda", torch.bfloat16)
    y, names = cuda_kernels_run(lambda: cutlass_ext.linear(A, B, config="gemv_n16"))
    assert len(names) == 1 and GEMV in names[0], names
    assert_close_to_reference(y, ref_linear(A, B, None, "none"), peer_linear(A, B, None, "none"), "bf16")


# The narrow kernel (N <= 64, K <= 256, 16-bit): all of N and K in one block, one launch on the
# operands where they are.
NARROW = "narrow_gemm_kernel"


@requires_cuda
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("b_layout", ["weight_t", "kn"])
# 17000 rows make 133 blocks of 128 rows: two 16-row tiles a warp on 132-SM GPUs, a partial last block.
@pytest.mark.parametrize("m,k,n", [(4099, 64, 16), (1, 16, 24), (300, 8, 8), (129, 256, 64), (1000, 72, 40),
                                   (65, 200, 48), (17000, 40, 24), (20000, 256, 64)])
def test_narrow_kernel(dtype_name, b_layout, m, k, n):
    dtype = DTYPES[dtype_name]
    A = rand(m, k, device="cuda", dtype=dtype)
    B = make_b(k, n, b_layout, "cuda", dtype)
    bias = rand(n, device="cuda", dtype=dtype)
    (y, aux), names = cuda_kernels_run(lambda: torch.ops.cutlass_ext.linear(A, B, bias, "gelu", True, "narrow_64"))
    peer_z = peer_linear(A, B, bias, "none")
    # One launch: no padded copies of A, B, the bias or the output.
    assert len(names) == 1 and NARROW in names[0], names
    assert_close_to_reference(aux, ref_linear(A, B, bias, "none"), peer_z, dtype_name, what="aux")
    assert_close_to_reference(y, ref_linear(A, B, bias, "gelu"), act_ref(peer_z, "gelu"), dtype_name)
    # Without bias or activation (a dX = dZ W), and every activation without the aux output.
    y, names = cuda_kernels_run(lambda: cutlass_ext.matmul(A, B, config="narrow_64"))
    assert len(names) == 1 and NARROW in names[0], names
    assert_close_to_reference(y, A.double() @ B.double(), torch.matmul(A, B), dtype_name)
    for act in ACTS:
        y, _ = torch.ops.cutlass_ext.linear(A, B, bias, act, False, "narrow_64")
        assert_close_to_reference(y, ref_linear(A, B, bias, act), peer_linear(A, B, bias, act), dtype_name, what=act)


@requires_cuda
@pytest.mark.parametrize("a_layout", ["offset", "rows"])
def test_narrow_kernel_views(a_layout):
    # A row stride that is a multiple of 16 bytes (every other row) is read in place; one that is
    # not (rows starting one element in) cannot run on this kernel: the forced config says why.
    A = _a_layout(700, 64, a_layout, torch.bfloat16)
    B = make_b(64, 16, "weight_t", "cuda", torch.bfloat16)
    bias = rand(16, device="cuda", dtype=torch.bfloat16)
    if a_layout == "offset":
        with pytest.raises(RuntimeError, match="config 'narrow_64' takes N <= 64 and K <= 256, a K-major A"):
            cutlass_ext.linear(A, B, bias, relu=True, config="narrow_64")
        return
    y, names = cuda_kernels_run(lambda: cutlass_ext.linear(A, B, bias, relu=True, config="narrow_64"))
    assert len(names) == 1 and NARROW in names[0], names
    assert_close_to_reference(y, ref_linear(A, B, bias, "relu"), peer_linear(A, B, bias, "relu"), "bf16")


@requires_cuda
@pytest.mark.parametrize("shared_b", [False, True])
def test_narrow_kernel_batched(shared_b):
    A = rand(3, 130, 72, device="cuda", dtype=torch.float16)
    B = make_b(72, 24, "kn", "cuda", torch.float16)
    B = B.expand(3, 72, 24) if shared_b else torch.stack([B, 2 * B, -B])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUTLASS_EXT_GEMM_CONFIG", "narrow_64")
        check_batched_on_one_kernel(A, B, NARROW, "fp16")


@requires_cuda
@pytest.mark.parametrize("m,k,n", [(65536, 64, 16), (512, 64, 16), (511, 64, 16), (8192, 64, 32), (8192, 64, 33),
                                   (8192, 32, 64), (8192, 128, 16), (8192, 64, 8), (8192, 64, 4), (8192, 72, 8)])
def test_narrow_heuristic(m, k, n):
    # N <= 64, K <= 64 and N K <= 2048 from 512 rows, as the forward of a layer (a K-major B) and as
    # dX = dZ W of a layer n -> k (an N-major B).
    A = rand(m, k, device="cuda", dtype=torch.bfloat16)
    W = rand(n, k, device="cuda", dtype=torch.bfloat16, scale=k ** -0.5)
    bias = rand(n, device="cuda", dtype=torch.bfloat16)
    y, names = cuda_kernels_run(lambda: cutlass_ext.linear(A, W.t(), bias, relu=True))
    assert any(NARROW in name for name in names) == narrow_kernel_takes(m, k, n), names
    assert_close_to_reference(y, ref_linear(A, W.t(), bias, "relu"), peer_linear(A, W.t(), bias, "relu"), "bf16")
    dZ = rand(m, n, device="cuda", dtype=torch.bfloat16)
    dX, names = cuda_kernels_run(lambda: cutlass_ext.matmul(dZ, W))
    assert any(NARROW in name for name in names) == narrow_kernel_takes(m, n, k, b_major="n"), names
    assert_close_to_reference(dX, dZ.double() @ W.double(), dZ @ W, "bf16")


@requires_cuda
def test_narrow_kernel_gradients():
    # A 64 -> 32 GELU layer over 20000 rows in training: the forward (with the pre-activation) and
    # dX = dZ W on the narrow kernel; gradients against float64.
    A = rand(20000, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
    W = rand(32, 64, device="cuda", dtype=torch.bfloat16, scale=1 / 8).requires_grad_()
    bias = rand(32, device="cuda", dtype=torch.bfloat16).requires_grad_()
    dy = rand(20000, 32, device="cuda", dtype=torch.bfloat16)

    def step():
        y = cutlass_ext.linear(A, W.t(), bias, activation="gelu")
        y.backward(dy)
        return y

    y, names = cuda_kernels_run(step)
    assert sum(NARROW in n for n in names) == 2, names
    check_layer_against_float64(y, A, W, bias, dy, F.gelu)


@requires_cuda
def test_narrow_config_rejects_what_it_cannot_run():
    A = rand(64, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="config 'narrow_64' takes N <= 64 and K <= 256"):
        cutlass_ext.linear(A, make_b(64, 72, "weight_t", "cuda", torch.bfloat16), config="narrow_64")
    with pytest.raises(RuntimeError, match="config 'narrow_64' takes N <= 64 and K <= 256"):
        cutlass_ext.linear(rand(64, 264, device="cuda", dtype=torch.bfloat16),
                           make_b(264, 16, "weight_t", "cuda", torch.bfloat16), config="narrow_64")
    with pytest.raises(RuntimeError, match="K \\(and N for an N-major B\\) and their row strides multiples of 16"):
        cutlass_ext.linear(rand(64, 13, device="cuda", dtype=torch.bfloat16),
                           make_b(13, 16, "weight_t", "cuda", torch.bfloat16), config="narrow_64")
    # A C source (an in-place weight merge: W [64, 16] += s * lora_B [64, 8] @ lora_A [8, 16]).
    W = rand(64, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp, pytest.raises(RuntimeError, match="no C source"):
        mp.setenv("CUTLASS_EXT_GEMM_CONFIG", "narrow_64")
        mp.setenv("CUTLASS_EXT_LORA_MERGE_PASS", "0")
        torch.ops.cutlass_ext.lora_merge(W, rand(8, 16, device="cuda", dtype=torch.bfloat16),
                                         rand(64, 8, device="cuda", dtype=torch.bfloat16), 0.5)


# The short-K kernel on operands that would otherwise be copied (K or a stride not a multiple of
# 16 bytes): read element by element, one launch.


@requires_cuda
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
@pytest.mark.parametrize("m,k,n", [(2048, 13, 512), (300, 1, 256), (4099, 7, 64), (8192, 33, 128)])
@pytest.mark.parametrize("a_layout", ["plain", "offset", "m_major"])
def test_lowk_kernel_reads_unaligned_operands(dtype_name, m, k, n, a_layout):
    dtype = DTYPES[dtype_name]
    if a_layout == "m_major":  # M-major A with an odd M: no 16-byte pieces along M either
        A = rand(k, m + 1, device="cuda", dtype=dtype)[:, 1:].t()
    else:
        A = _a_layout(m, k, a_layout, dtype)
    B = make_b(k, n, "weight_t", "cuda", dtype)  # K-major rows of k elements
    bias = rand(n, device="cuda", dtype=dtype)
    aux_wanted = a_layout != "m_major"  # the aux epilogue is built for a K-major A
    (y, aux), names = cuda_kernels_run(lambda: torch.ops.cutlass_ext.linear(A, B, bias, "gelu", aux_wanted))
    assert len(names) == 1 and "lowk_gemm_kernel" in names[0], names
    # A contiguous A and weight are copied as whole 16-byte pieces (the packed path); an A at an
    # odd offset or stride, or M-major with an odd M, element by element.
    assert lowk_copy_kind(names[0]) == ("packed" if a_layout == "plain" else "elementwise"), names[0]
    peer_z = peer_linear(A, B, bias, "none")
    if aux_wanted:
        assert_close_to_reference(aux, ref_linear(A, B, bias, "none"), peer_z, dtype_name, what="aux")
    assert_close_to_reference(y, ref_linear(A, B, bias, "gelu"), act_ref(peer_z, "gelu"), dtype_name)


def lowk_copy_kind(kernel_name):
    """How the short-K kernel named `kernel_name` copies its operands (its third template argument)."""
    kind = int(kernel_name.split("lowk_gemm_kernel<")[1].split(">")[0].split(",")[2])
    return {0: "vector", 1: "packed", 2: "elementwise"}[kind]


@requires_cuda
@pytest.mark.parametrize("k", [13, 1, 33])
def test_lowk_kernel_packed_operands_over_many_tiles(k, monkeypatch):
    # Contiguous [lines, K] operands whose rows are not 16-byte pieces, over more tiles than the
    # persistent blocks (3000 x 2056 -> 47 x 17 tiles), so each block walks several: the next
    # tile's raw A is in flight while one is multiplied, and B and its bias are copied again where
    # a block's range enters the next column of tiles.
    monkeypatch.setenv("CUTLASS_EXT_GEMM_CONFIG", "lowk_64x128")
    m, n = 3000, 2056
    A = rand(m, k, device="cuda", dtype=torch.bfloat16)
    W = rand(n, k, device="cuda", dtype=torch.bfloat16, scale=k ** -0.5)
    bias = rand(n, device="cuda", dtype=torch.bfloat16)
    (y, z), names = cuda_kernels_run(lambda: torch.ops.cutlass_ext.linear(A, W.t(), bias, "silu", True, None))
    assert len(names) == 1 and lowk_copy_kind(names[0]) == "packed", names
    assert_close_to_reference(z, ref_linear(A, W.t(), bias, "none"), peer_linear(A, W.t(), bias, "none"), "bf16",
                              what="aux")
    assert_close_to_reference(y, ref_linear(A, W.t(), bias, "silu"), peer_linear(A, W.t(), bias, "silu"), "bf16")
    # Three batches of [1000, k] rows against three packed weights (batches 1000 k and 2056 k
    # elements apart: multiples of 16 bytes for these K).
    A3 = rand(3, 1000, k, device="cuda", dtype=torch.bfloat16)
    W3 = rand(3, n, k, device="cuda", dtype=torch.bfloat16, scale=k ** -0.5)
    out, names = cuda_kernels_run(lambda: cutlass_ext.matmul(A3, W3.transpose(1, 2)))
    assert len(names) == 1 and lowk_copy_kind(names[0]) == "packed", names
    assert_close_to_reference(out, A3.double() @ W3.double().transpose(1, 2), torch.matmul(A3, W3.transpose(1, 2)),
                              "bf16")


@requires_cuda
@pytest.mark.parametrize("a_layout", ["plain", "offset"])
def test_short_k_unaligned_rule_past_32768_rows(a_layout):
    # Past 32768 rows a contiguous 13-feature X and weight still take the short-K kernel alone
    # (its packed path beats the padded copy there); an X at an odd offset is copied padded first.
    m, k, n = 40000, 13, 64
    A = _a_layout(m, k, a_layout, torch.bfloat16)
    W = rand(n, k, device="cuda", dtype=torch.bfloat16, scale=k ** -0.5)
    bias = rand(n, device="cuda", dtype=torch.bfloat16)
    y, names = cuda_kernels_run(lambda: cutlass_ext.linear(A, W.t(), bias, relu=True))
    lowk = [name for name in names if "lowk_gemm_kernel" in name]
    if a_layout == "plain":
        assert len(names) == 1 and lowk and lowk_copy_kind(lowk[0]) == "packed", names
    else:
        assert len(names) > 1 and not [name for name in lowk if lowk_copy_kind(name) == "elementwise"], names
    assert_close_to_reference(y, ref_linear(A, W.t(), bias, "relu"), peer_linear(A, W.t(), bias, "relu"), "bf16")


@requires_cuda
def test_lowk_kernel_unaligned_b_without_bias():
    # Element-wise copies of an A and a B that both start 2 bytes past 16, no bias, and a last
    # column tile past N (its bias pieces zero-filled from an aligned stand-in address).
    A = rand(300, 16, device="cuda", dtype=torch.bfloat16)[:, 1:14]
    B = rand(200, 16, device="cuda", dtype=torch.bfloat16, scale=0.25)[:, 1:14].t()
    out, names = cuda_kernels_run(lambda: cutlass_ext.matmul(A, B))
    assert len(names) == 1 and lowk_copy_kind(names[0]) == "elementwise", names
    assert_close_to_reference(out, A.double() @ B.double(), torch.matmul(A, B), "bf16")


@requires_cuda
def test_lowk_kernel_packed_a_with_c(monkeypatch):
    # An in-place merge W += s * lora_B @ lora_A with a rank of 13, as a GEMM: lora_B [m, 13] is a
    # packed A, lora_A [13, n] an N-major B in 16-byte pieces, W the C source (its raw A tiles sit
    # after C's).
    monkeypatch.setenv("CUTLASS_EXT_LORA_MERGE_PASS", "0")
    m, r, n = 1000, 13, 1032
    W = rand(m, n, device="cuda", dtype=torch.bfloat16)
    lora_A = rand(r, n, device="cuda", dtype=torch.bfloat16)
    lora_B = rand(m, r, device="cuda", dtype=torch.bfloat16)
    W0 = W.clone()
    _, names = cuda_kernels_run(lambda: torch.ops.cutlass_ext.lora_merge(W, lora_A, lora_B, -0.5))
    assert len(names) == 1 and lowk_copy_kind(names[0]) == "packed", names
    assert_close_to_reference(W, W0.double() - 0.5 * (lora_B.double() @ lora_A.double()),
                              torch.addmm(W0, lora_B, lora_A, alpha=-0.5), "bf16", what="merged W")


# ------------------------------------------------------------------------------------------------
# The hand-written few-row kernel (fewrows: TF32, M <= 16, a K-major A, a K- or N-major B, a stream
# over the weight)

FEWROWS = "fewrows_gemm_kernel"
F32 = torch.float32


@requires_cuda
@pytest.mark.parametrize("m,k,n,b_layout", [
    *[(m, k, n, layout) for m, k, n in ((1, 256, 256), (8, 264, 392), (9, 4104, 300), (16, 520, 2120), (3, 4, 40))
      for layout in ("weight_t", "kn")],
    (16, 1024, 1, "weight_t"), (16, 1024, 4, "kn")])
def test_fewrows_kernel(m, k, n, b_layout):
    # One or two 8-wide MMA tiles of rows, K tails inside a stage, partial blocks of columns; B
    # K-major (a weight's transpose) or N-major (a row-major [K, N] matrix).
    A = rand(m, k, device="cuda", dtype=F32)
    B = make_b(k, n, b_layout, "cuda", F32)
    bias = rand(n, device="cuda", dtype=F32)
    with fp32_precision("tf32"):
        (y, aux), names = cuda_kernels_run(
            lambda: torch.ops.cutlass_ext.linear(A, B, bias, "gelu", True, "fewrows_16"))
        peer_z = peer_linear(A, B, bias, "none")
    # One launch: no padded copies of A, B, the bias or the output.
    assert len(names) == 1 and FEWROWS in names[0], names
    assert_close_to_reference(aux, ref_linear(A, B, bias, "none"), peer_z, "tf32", what="aux")
    assert_close_to_reference(y, ref_linear(A, B, bias, "gelu"), act_ref(peer_z, "gelu"), "tf32")


@requires_cuda
@pytest.mark.parametrize("shared_b", [False, True])
def test_fewrows_kernel_batched_and_strided(shared_b):
    # Batches of rows (every other row of a larger tensor) against per-batch or shared weights.
    A = rand(3, 8, 512, device="cuda", dtype=F32)[:, ::2]
    W = rand(392, 512, device="cuda", dtype=F32, scale=512 ** -0.5)
    Wb = W.expand(3, 392, 512) if shared_b else torch.stack([W, 2 * W, -W])
    B = Wb.transpose(1, 2)
    check_batched_on_one_kernel(A, B, FEWROWS, "tf32")


@requires_cuda
@pytest.mark.parametrize("m,k,n,expected", [(1, 4096, 4096, True), (16, 4096, 4096, True), (17, 4096, 4096, False),
                                             (8, 4096, 4104, True), (9, 4096, 4104, False)])
def test_fewrows_heuristic_reads_a_row_major_b(m, k, n, expected):
    # A row-major [K, N] B (N-major) takes the few-row kernel up to 16 rows (8 past 4096 x 4096
    # elements), more rows than a K-major B: the transposed CUTLASS tiles it would otherwise run
    # on transpose it in registers.
    A = rand(m, k, device="cuda", dtype=F32)
    B = make_b(k, n, "kn", "cuda", F32)
    with fp32_precision("tf32"):
        y, names = gemm_kernels_run(lambda: cutlass_ext.matmul(A, B))
        peer = torch.matmul(A, B)
    assert len(names) == 1 and (FEWROWS in names[0]) == expected, names
    assert_close_to_reference(y, A.double() @ B.double(), peer, "tf32")


@requires_cuda
@pytest.mark.parametrize("m,k,n,layout,expected", [
    (1, 4096, 4096, "plain", True), (4, 4096, 11008, "plain", True), (3, 256, 256, "rows", True),
    (5, 4096, 4096, "plain", False),    # more rows than the heuristic gives it
    (4, 4096, 128, "plain", False),     # too few columns to be worth a stream
    (4, 128, 4096, "plain", False),     # too short a K
    (4, 4098, 4096, "plain", False),    # K not a multiple of 16 bytes: the padded path
    (4, 4096, 4096, "offset", False),   # rows not 16-byte aligned
])
def test_fewrows_heuristic(m, k, n, layout, expected):
    A = _a_layout(m, k, layout, F32)
    W = rand(n, k, device="cuda", dtype=F32, scale=k ** -0.5)
    with fp32_precision("tf32"):
        y, names = gemm_kernels_run(lambda: cutlass_ext.linear(A, W.t(), relu=True))
        peer = peer_linear(A, W.t(), None, "relu")
    assert any(FEWROWS in name for name in names) == expected, names
    assert_close_to_reference(y, ref_linear(A, W.t(), None, "relu"), peer, "tf32")


@requires_cuda
@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_fewrows_kernel_serves_tf32_only(dtype_name):
    # 16-bit types keep the transposed CUTLASS tiles; without TF32 an fp32 product multiplies
    # exactly on the FMA units, however few its rows.
    A = rand(2, 1024, device="cuda", dtype=DTYPES[dtype_name])
    B = make_b(1024, 1024, "weight_t", "cuda", DTYPES[dtype_name])
    with fp32_precision(dtype_name):
        y, names = gemm_kernels_run(lambda: cutlass_ext.linear(A, B))
        peer = peer_linear(A, B, None, "none")
    assert names and not any(FEWROWS in name for name in names), names
    assert_close_to_reference(y, ref_linear(A, B, None, "none"), peer, dtype_name)


@requires_cuda
def test_fewrows_config_rejects_what_it_cannot_run():
    W = rand(256, 512, device="cuda", dtype=F32)
    with fp32_precision("tf32"):
        with pytest.raises(RuntimeError, match="config 'fewrows_16' takes M <= 16"):
            cutlass_ext.linear(rand(17, 512, device="cuda", dtype=F32), W.t(), config="fewrows_16")
        with pytest.raises(RuntimeError, match="a K-major A and a K- or N-major B"):  # neither stride 1
            cutlass_ext.linear(rand(4, 512, device="cuda", dtype=F32), _b_layout(512, 256, "strided", F32),
                               config="fewrows_16")
        with pytest.raises(RuntimeError, match="a K-major A"):  # an M-major A
            cutlass_ext.linear(rand(512, 4, device="cuda", dtype=F32).t(), W.t(), config="fewrows_16")
        # Where the heuristic would not take it (few columns, 16 rows): still correct when forced.
        A = rand(16, 512, device="cuda", dtype=F32)
        B = make_b(512, 24, "weight_t", "cuda", F32)
        y, names = cuda_kernels_run(lambda: cutlass_ext.linear(A, B, config="fewrows_16"))
        peer = peer_linear(A, B, None, "none")
    assert len(names) == 1 and FEWROWS in names[0], names
    assert_close_to_reference(y, ref_linear(A, B, None, "none"), peer, "tf32")


# ------------------------------------------------------------------------------------------------
# The hand-written short-K fp32 kernel (ffma: K <= 32, exact multiply-adds on the FMA units,
# unpadded operands)

FFMA = "ffma_gemm_kernel"


@requires_cuda
@pytest.mark.parametrize("act", ["gelu", "silu"])
@pytest.mark.parametrize("policy", ["tf32", "fp32"])
@pytest.mark.parametrize("m,k,n", [(2048, 13, 512), (1, 13, 3), (37, 1, 5), (300, 32, 130), (4099, 7, 64),
                                   (65, 20, 257)])
def test_ffma_kernel(policy, m, k, n, act):
    # Partial tiles in M and N, N not a multiple of 4 (element stores), K from 1 to 32. SiLU takes
    # the fp32 exp2/reciprocal form of every fp32 epilogue (common/activation_16bit.h).
    A = rand(m, k, device="cuda", dtype=F32)
    B = make_b(k, n, "weight_t", "cuda", F32)
    bias = rand(n, device="cuda", dtype=F32)
    with fp32_precision(policy):
        (y, aux), names = cuda_kernels_run(lambda: torch.ops.cutlass_ext.linear(A, B, bias, act, True,
                                                                                "ffma_64x128"))
        peer_z = peer_linear(A, B, bias, "none")
    # One launch: no padded copies of A, B, the bias or the output.
    assert len(names) == 1 and FFMA in names[0], names
    # Exact fp32 under either policy: held to the fp32 tolerance.
    assert_close_to_reference(aux, ref_linear(A, B, bias, "none"), peer_z, "fp32", what="aux")
    assert_close_to_reference(y, ref_linear(A, B, bias, act), act_ref(peer_z, act), "fp32")


@requires_cuda
@pytest.mark.parametrize("policy", ["tf32", "fp32"])
@pytest.mark.parametrize("a_layout", ["plain", "offset", "rows", "m_major"])
@pytest.mark.parametrize("b_layout", ["weight_t", "kn", "strided"])
def test_ffma_kernel_reads_views_in_place(policy, a_layout, b_layout):
    # A 13-feature input layer read where it is: rows at an odd stride, an offset start, an
    # M-major A, a row-major or fully strided B. The heuristic takes the kernel (K = 13).
    m, k, n = 1000, 13, 200
    A = rand(k, m, device="cuda", dtype=F32).t() if a_layout == "m_major" else _a_layout(m, k, a_layout, F32)
    B = make_b(k, n, "weight_t", "cuda", F32) if b_layout == "weight_t" else _b_layout(k, n, b_layout, F32)
    bias = rand(n, device="cuda", dtype=F32)
    with fp32_precision(policy):
        y, names = cuda_kernels_run(lambda: cutlass_ext.linear(A, B, bias, relu=True))
        peer = peer_linear(A, B, bias, "relu")
    assert len(names) == 1 and FFMA in names[0], names
    assert_close_to_reference(y, ref_linear(A, B, bias, "relu"), peer, "fp32")


@requires_cuda
@pytest.mark.parametrize("shared_b", [False, True])
def test_ffma_kernel_batched(shared_b):
    A = rand(3, 130, 13, device="cuda", dtype=F32)
    B = make_b(13, 70, "kn", "cuda", F32)
    B = B.expand(3, 13, 70) if shared_b else torch.stack([B, 2 * B, -B])
    check_batched_on_one_kernel(A, B, FFMA, "fp32")


@requires_cuda
@pytest.mark.parametrize("policy,m,k,aligned,expected", [
    ("tf32", 2048, 13, True, True), ("tf32", 2048, 16, True, True), ("tf32", 2048, 32, True, False),
    ("tf32", 8192, 16, True, False), ("tf32", 2048, 30, True, True), ("tf32", 2048, 32, False, True),
    ("tf32", 2048, 33, False, False), ("tf32", 32768, 13, True, True), ("tf32", 32769, 13, True, False),
    ("fp32", 2048, 32, True, True), ("fp32", 32769, 13, True, True), ("fp32", 2048, 33, True, False)])
def test_ffma_heuristic(policy, m, k, aligned, expected):
    # Without TF32 every K <= 32. With it, where the tensor-core tiles would copy the operands
    # first (K or the row stride not a multiple of 16 bytes) up to K = 32 and 2^24 outputs, else
    # up to K = 16 and 2^21 outputs (here N = 512).
    A = rand(m, k, device="cuda", dtype=F32) if aligned else _a_layout(m, k, "offset", F32)
    W = rand(512, k, device="cuda", dtype=F32, scale=k ** -0.5)
    with fp32_precision(policy):
        y, names = gemm_kernels_run(lambda: cutlass_ext.linear(A, W.t(), relu=True))
        peer = peer_linear(A, W.t(), None, "relu")
    assert any(FFMA in name for name in names) == expected, names
    assert_close_to_reference(y, ref_linear(A, W.t(), None, "relu"), peer, policy)


@requires_cuda
def test_ffma_config_rejects_what_it_cannot_run():
    with fp32_precision("tf32"), pytest.raises(RuntimeError, match="config 'ffma_64x128' takes K <= 32"):
        cutlass_ext.linear(rand(64, 33, device="cuda", dtype=F32), make_b(33, 8, "weight_t", "cuda", F32),
                           config="ffma_64x128")


@requires_cuda
@pytest.mark.parametrize("policy", ["tf32", "fp32"])
def test_ffma_layer_gradients(policy):
    # A 13 -> 512 GELU layer in training: the forward (with its pre-activation) on the FMA-unit
    # kernel, dX = dZ W on the few-column kernel (N = 13) and dW = dZ^T X on the narrow
    # weight-gradient kernel: no padded copies; gradients against float64.
    A = rand(3000, 13, device="cuda", dtype=F32).requires_grad_()
    W = rand(512, 13, device="cuda", dtype=F32, scale=13 ** -0.5).requires_grad_()
    bias = rand(512, device="cuda", dtype=F32).requires_grad_()
    dy = rand(3000, 512, device="cuda", dtype=F32)
    with fp32_precision(policy):
        y, names = cuda_kernels_run(lambda: cutlass_ext.linear(A, W.t(), bias, activation="gelu"))
        assert any(FFMA in n for n in names), names
        _, names = cuda_kernels_run(lambda: y.backward(dy))
        assert any(GEMV in n for n in names) and any(WGRAD in n for n in names), names
        assert not [n for n in names if "GemmUniversal" in n], names
        check_layer_against_float64(y, A, W, bias, dy, F.gelu, "fp32", policy)


# ------------------------------------------------------------------------------------------------
# The hand-written narrow weight-gradient kernel (wgrad: fp32 plain products of an M-major A and an
# N-major B with M or N <= 16, a reduction over the rows on the FMA units)

WGRAD = "wgrad_gemm_kernel"


@requires_cuda
@pytest.mark.parametrize("policy", ["tf32", "fp32"])
@pytest.mark.parametrize("m,k,n", [(512, 2048, 13), (16, 65536, 64), (300, 40, 5), (1000, 7, 16), (13, 5000, 13),
                                   (1, 999, 300), (700, 100000, 1)])
def test_wgrad_kernel(policy, m, k, n):
    # N or M narrow (the other side up to several 128-column blocks), one slice (written directly)
    # or many (partial products added by sum_partials), K not a multiple of the 4-row chunk, fewer
    # chunks than a block's warps.
    A = rand(k, m, device="cuda", dtype=F32).t()  # dZ^T: M-major
    B = rand(k, n, device="cuda", dtype=F32)      # X: N-major
    with fp32_precision(policy):
        out, names = cuda_kernels_run(lambda: cutlass_ext.matmul(A, B, config="wgrad_256"))
        peer = torch.matmul(A, B)
    assert names and WGRAD in names[0] and all(WGRAD in n or "sum_partials" in n for n in names), names
    assert_close_to_reference(out, A.double() @ B.double(), peer, "fp32")


@requires_cuda
@pytest.mark.parametrize("wide", ["contiguous", "offset"])
@pytest.mark.parametrize("m,k,n", [(512, 2048, 13), (16, 65536, 64), (40, 3001, 3), (130, 9, 8), (7, 500, 257)])
def test_wgrad_kernel_slices_and_unaligned_rows(wide, m, k, n):
    # Slices of the rows whose partial products sum_partials adds in slice order (the same bits on
    # every call), or one slice written directly; the wide operand contiguous (its rows on 16 bytes
    # where its width is a multiple of four: a lane's four columns copied as one piece) or not (an
    # offset start and an odd row stride: one by one).
    def rows(cols, offset):
        return rand(k, cols + 1, device="cuda", dtype=F32)[:, 1:] if offset else rand(k, cols, device="cuda", dtype=F32)
    wide_m = n <= 16
    A = rows(m, wide == "offset" and wide_m).t()
    B = rows(n, wide == "offset" and not wide_m)
    with fp32_precision("fp32"):
        out, names = cuda_kernels_run(lambda: cutlass_ext.matmul(A, B, config="wgrad_256"))
        peer = torch.matmul(A, B)
        again = cutlass_ext.matmul(A, B, config="wgrad_256")
    assert names and WGRAD in names[0] and all(WGRAD in n or "sum_partials" in n for n in names), names
    assert_close_to_reference(out, A.double() @ B.double(), peer, "fp32")
    assert torch.equal(out, again)


@requires_cuda
@pytest.mark.parametrize("b_layout", ["offset", "rows"])
def test_wgrad_kernel_reads_views_in_place(b_layout):
    # dW of a 13-feature layer whose input is a view (an offset start, every other row) and whose
    # dZ rows are every other row of a larger tensor: read where they are, by the heuristic.
    dz = rand(2 * 3000, 512, device="cuda", dtype=F32)[::2]
    x = _a_layout(3000, 13, b_layout, F32)
    with fp32_precision("tf32"):
        out, names = cuda_kernels_run(lambda: cutlass_ext.matmul(dz.t(), x))
        peer = torch.matmul(dz.t(), x)
    assert all(WGRAD in n or "sum_partials" in n for n in names), names
    assert_close_to_reference(out, dz.t().double() @ x.double(), peer, "fp32")


@requires_cuda
def test_wgrad_config_rejects_what_it_cannot_run():
    A = rand(64, 2000, device="cuda", dtype=F32)  # K-major
    with fp32_precision("tf32"), pytest.raises(RuntimeError, match="config 'wgrad_256' takes plain products"):
        cutlass_ext.matmul(A, rand(2000, 8, device="cuda", dtype=F32), config="wgrad_256")
