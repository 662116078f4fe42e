"""cutlass_ext.bias_act / sum / add against float64 references, on CPU (reference kernels) and
CUDA (hand-written kernels)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cutlass_ext
from cutlass_ext.ops import _activation, pointwise

from ..conftest import requires_cuda
from ..helpers import (DTYPES, activation64, assert_close_to_reference, capture_cuda_graph, cuda_kernels_run,
                       every_value, unit_in_last_place)

DTYPE_NAMES = ["fp16", "bf16", "fp32"]
ACTS = list(_activation.ACTIVATIONS)


def rand(*shape, device, dtype, scale=1.0):
    return torch.randn(*shape, device=device, dtype=torch.float32).mul_(scale).to(dtype)


def grads_of(fn, inputs, grad_out):
    inputs = [x.detach().requires_grad_(True) if x is not None else None for x in inputs]
    out = fn(*inputs)
    out.backward(grad_out)
    return out, [x.grad if x is not None else None for x in inputs]


# ------------------------------------------------------------------------------------------------
# bias_act


def ref_bias_act(x, bias, act, scale, residual):
    """The same math with torch ops, in x's dtype (torch's own error) or float64 (the reference)."""
    z = x * scale
    if bias is not None:
        z = z + bias
    if residual is not None:
        z = z + residual
    return _activation.apply(z, act)


def check_bias_act(x, bias, act, scale, residual, dtype_name):
    out = cutlass_ext.bias_act(x, bias, act, scale=scale, residual=residual)
    assert out.dtype == x.dtype and out.is_contiguous() and out.shape == x.shape
    d = lambda t: t.double() if t is not None else None  # noqa: E731
    ref = ref_bias_act(d(x), d(bias), act, scale, d(residual))
    assert_close_to_reference(out, ref, ref_bias_act(x, bias, act, scale, residual), dtype_name)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_bias_act_activations(device, dtype_name, act):
    dtype = DTYPES[dtype_name]
    x = rand(67, 136, device=device, dtype=dtype)
    bias = rand(136, device=device, dtype=dtype)
    residual = rand(67, 136, device=device, dtype=dtype)
    check_bias_act(x, bias, act, 0.75, residual, dtype_name)


@pytest.mark.parametrize("with_bias,with_residual", [(True, False), (False, True), (False, False)])
@pytest.mark.parametrize("scale", [1.0, -2.5])
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_bias_act_optional_inputs(device, dtype_name, scale, with_bias, with_residual):
    dtype = DTYPES[dtype_name]
    x = rand(3, 40, 96, device=device, dtype=dtype)
    bias = rand(96, device=device, dtype=dtype) if with_bias else None
    residual = rand(3, 40, 96, device=device, dtype=dtype) if with_residual else None
    check_bias_act(x, bias, "gelu", scale, residual, dtype_name)


# name -> builder of x given (device, dtype); each returns x with the described shape or layout.
BIAS_ACT_CASES = {
    "one": lambda d, t: rand(1, 1, device=d, dtype=t),
    "odd": lambda d, t: rand(5, 7, device=d, dtype=t),
    "c1000": lambda d, t: rand(33, 1000, device=d, dtype=t),
    "c4097": lambda d, t: rand(9, 4097, device=d, dtype=t),
    "long_row": lambda d, t: rand(3, 262144, device=d, dtype=t),
    "many_rows": lambda d, t: rand(20000, 24, device=d, dtype=t),
    "zero_rows": lambda d, t: rand(0, 64, device=d, dtype=t),
    "vector": lambda d, t: rand(48, device=d, dtype=t),
    "batched": lambda d, t: rand(2, 3, 17, 40, device=d, dtype=t),
    "noncontig": lambda d, t: rand(96, 200, device=d, dtype=t)[:, 8:136],
    "offset": lambda d, t: rand(64 * 64 + 1, device=d, dtype=t)[1:].view(64, 64),
    "transposed": lambda d, t: rand(64, 72, device=d, dtype=t).t(),
    "expanded_rows": lambda d, t: rand(1, 256, device=d, dtype=t).expand(50, 256),
}


@pytest.mark.parametrize("case", list(BIAS_ACT_CASES))
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_bias_act_shapes(device, dtype_name, case):
    dtype = DTYPES[dtype_name]
    x = BIAS_ACT_CASES[case](device, dtype)
    c = x.shape[-1]
    bias = rand(c + 1, device=device, dtype=dtype)[1:]  # an unaligned bias as well
    residual = BIAS_ACT_CASES[case](device, dtype)
    check_bias_act(x, bias, "silu", 1.5, residual, dtype_name)


# Aligned bias, so that the 16-byte kernels run: rows stored one after another take one vector a
# thread over the flat matrix (the bias vector by the index modulo the row's vectors), others the
# row-by-row grid. Row lengths that are not a multiple of the block, and a residual whose rows are
# apart while x's are not (which must leave the flat kernel).
BIAS_ACT_LAYOUTS = {
    "flat_c1000": (lambda d, t: rand(37, 1000, device=d, dtype=t), lambda d, t: rand(37, 1000, device=d, dtype=t)),
    "flat_c24": (lambda d, t: rand(999, 24, device=d, dtype=t), None),
    "flat_c2056": (lambda d, t: rand(3, 5, 2056, device=d, dtype=t), lambda d, t: rand(3, 5, 2056, device=d, dtype=t)),
    "residual_rows_apart": (lambda d, t: rand(40, 256, device=d, dtype=t),
                            lambda d, t: rand(40, 320, device=d, dtype=t)[:, 32:288]),
    "x_rows_apart": (lambda d, t: rand(40, 320, device=d, dtype=t)[:, 64:320],
                     lambda d, t: rand(40, 256, device=d, dtype=t)),
}


@pytest.mark.parametrize("case", list(BIAS_ACT_LAYOUTS))
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_bias_act_row_layouts(device, dtype_name, act, case):
    dtype = DTYPES[dtype_name]
    make_x, make_res = BIAS_ACT_LAYOUTS[case]
    x = make_x(device, dtype)
    bias = rand(x.shape[-1], device=device, dtype=dtype)
    residual = make_res(device, dtype) if make_res is not None else None
    check_bias_act(x, bias, act, 1.25, residual, dtype_name)


@requires_cuda
@pytest.mark.parametrize("rows_apart", [False, True])
def test_bias_act_rows_past_one_grid(rows_apart):
    # Rows apart: 256 bf16 columns take blocks of 8 rows; more than 65535 such blocks do not fit a
    # grid's y dimension, so the kernel strides over rows, and the rows after the first stride must
    # be written too (y is fresh, unpoisoned memory: an unwritten row would not match). Rows one
    # after another: the flat kernel's grid covers them all.
    rows = 65535 * 8 + 37
    x = rand(rows, 264 if rows_apart else 256, device="cuda", dtype=torch.bfloat16)[:, :256]
    bias = rand(256, device="cuda", dtype=torch.bfloat16)
    y = cutlass_ext.bias_act(x, bias, "relu")
    for part in (slice(0, 600), slice(65535 * 8 - 300, rows)):
        assert torch.equal(y[part], torch.relu(x[part].float() + bias.float()).to(torch.bfloat16))


def test_bias_act_nan_propagates(device):
    x = rand(32, 64, device=device, dtype=torch.bfloat16)
    x[3, 5] = float("nan")
    out = cutlass_ext.bias_act(x, None, "relu")
    assert torch.isnan(out[3, 5]) and torch.isfinite(out[:3]).all()


def test_bias_act_default_is_relu_and_none_means_identity(device):
    x = rand(16, 32, device=device, dtype=torch.float32)
    assert torch.equal(cutlass_ext.bias_act(x), torch.relu(x))
    assert torch.equal(cutlass_ext.bias_act(x, activation=None), cutlass_ext.bias_act(x, activation="none"))


@requires_cuda
@pytest.mark.parametrize("act,lo,hi", [("gelu", -6, 8), ("silu", -16, 16), ("sigmoid", -16, 16)])
@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
def test_16bit_activations_within_one_unit(dtype_name, act, lo, hi):
    # 16-bit results take the forms of csrc/common/activation_16bit.h (GELU from a polynomial, not
    # erff; SiLU and sigmoid from the hardware exp2 and reciprocal): every value of the dtype in
    # [lo, hi] must come out within one unit of float64 (erff's fp32 GELU misses by several units
    # in the negative tail, where 1 + erf cancels), and the derivative within one unit plus 2e-6
    # (GELU's polynomial error where d crosses zero near x = -0.75).
    dtype = DTYPES[dtype_name]
    x = every_value(dtype, lo, hi)
    x = torch.cat([x, x[: (-x.numel()) % 64]]).view(-1, 64).cuda().requires_grad_()
    y = cutlass_ext.bias_act(x, None, act)
    y.backward(torch.ones_like(y))
    x64 = x.detach().double()
    ref, dref = activation64(act, x64)
    err = (y.detach().double() - ref).abs() / unit_in_last_place(ref, dtype)
    assert err.max() <= 1.0, f"{act} off by {err.max():.2f} units at x = {x64.flatten()[err.argmax()]:.6g}"
    derr = ((x.grad.double() - dref).abs() - 2e-6) / unit_in_last_place(dref, dtype)
    assert derr.max() <= 1.0, f"{act}' off by {derr.max():.2f} units at x = {x64.flatten()[derr.argmax()]:.6g}"


@requires_cuda
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
def test_fp32_sigmoid_forms_error_bound(act):
    # fp32 SiLU and sigmoid take the hardware exp2 and reciprocal with the exponent's rounding put
    # back (csrc/common/activation_16bit.h): each value in [-87, 40] (below, sigmoid is subnormal
    # and flushed to 0) within 1e-6 of float64 relative to itself (~8 fp32 units; the form's own
    # roundings reach 3.1e-7 and the approximations add ~2.5e-7), the derivative within 1e-6 of
    # float64 relative to max(|d|, 1) for SiLU (whose derivative crosses zero), to |d| for sigmoid.
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([torch.linspace(-87.0, 40.0, 2**20), torch.rand(2**20, generator=gen) * 127.0 - 87.0])
    x = x.view(-1, 256).cuda().requires_grad_()
    y = cutlass_ext.bias_act(x, None, act)
    y.backward(torch.ones_like(y))
    x64 = x.detach().double()
    ref, dref = activation64(act, x64)
    err = ((y.detach().double() - ref).abs() / ref.abs().clamp(min=1e-38)).max()
    assert err <= 1e-6, f"fp32 {act}: relative error {err:.3e}"
    dscale = dref.abs().clamp(min=1.0) if act == "silu" else dref.abs()
    derr = ((x.grad.double() - dref).abs() / dscale).max()
    assert derr <= 1e-6, f"fp32 {act}': relative error {derr:.3e}"


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_bias_act_backward(device, dtype_name, act):
    dtype = DTYPES[dtype_name]
    x = rand(3, 50, 72, device=device, dtype=dtype)
    bias = rand(72, device=device, dtype=dtype)
    residual = rand(3, 50, 72, device=device, dtype=dtype)
    grad_out = rand(3, 50, 72, device=device, dtype=dtype)
    scale = 1.25

    def ours(a, b, r):
        return cutlass_ext.bias_act(a, b, act, scale=scale, residual=r)

    _, mine = grads_of(ours, [x, bias, residual], grad_out)
    _, peer = grads_of(lambda a, b, r: ref_bias_act(a, b, act, scale, r), [x, bias, residual], grad_out)
    _, ref = grads_of(lambda a, b, r: ref_bias_act(a, b, act, scale, r),
                      [x.double(), bias.double(), residual.double()], grad_out.double())
    for name, o, p, r in zip(("dx", "dbias", "dresidual"), mine, peer, ref):
        assert o.dtype == dtype
        assert_close_to_reference(o, r, p, dtype_name, what=name)


@pytest.mark.parametrize("case", ["odd", "c4097", "many_rows", "zero_rows", "noncontig", "offset"])
@pytest.mark.parametrize("act", ["relu", "gelu_tanh", "none"])
def test_bias_act_backward_shapes(device, act, case):
    dtype = torch.bfloat16
    x = BIAS_ACT_CASES[case](device, dtype)
    bias = rand(x.shape[-1], device=device, dtype=dtype)
    residual = BIAS_ACT_CASES[case](device, dtype)
    grad_out = BIAS_ACT_CASES[case](device, dtype)
    _, mine = grads_of(lambda a, b, r: cutlass_ext.bias_act(a, b, act, scale=0.5, residual=r),
                       [x, bias, residual], grad_out)
    _, peer = grads_of(lambda a, b, r: ref_bias_act(a, b, act, 0.5, r), [x, bias, residual], grad_out)
    _, ref = grads_of(lambda a, b, r: ref_bias_act(a, b, act, 0.5, r),
                      [x.double(), bias.double(), residual.double()], grad_out.double())
    for name, o, p, r in zip(("dx", "dbias", "dresidual"), mine, peer, ref):
        if x.shape[0] == 0 and name == "dbias":
            assert torch.equal(o, torch.zeros_like(o))  # a sum over zero rows
            continue
        assert_close_to_reference(o, r, p, "bf16", what=name)


@pytest.mark.parametrize("act", ["gelu", "relu"])  # relu: the masked forward's node
@pytest.mark.parametrize("needs", ["x", "bias", "residual", "x+bias", "bias+residual"])
def test_bias_act_backward_computes_only_needed_grads(device, needs, act):
    wanted = needs.split("+")
    x = rand(40, 24, device=device, dtype=torch.float32).requires_grad_("x" in wanted)
    bias = rand(24, device=device, dtype=torch.float32).requires_grad_("bias" in wanted)
    residual = rand(40, 24, device=device, dtype=torch.float32).requires_grad_("residual" in wanted)
    out = cutlass_ext.bias_act(x, bias, act, scale=2.0, residual=residual)
    grad = rand(40, 24, device=device, dtype=torch.float32)
    out.backward(grad)
    dz = _activation.backward(grad.double(), (2.0 * x + bias + residual).detach().double(), act)
    expected = {"x": 2.0 * dz, "bias": dz.sum(0), "residual": dz}
    for name, t in (("x", x), ("bias", bias), ("residual", residual)):
        assert (t.grad is not None) == (name in wanted)
        if t.grad is not None:
            torch.testing.assert_close(t.grad.double(), expected[name], rtol=1e-5, atol=1e-5)


@requires_cuda
def test_bias_act_backward_is_one_fused_pass():
    x = rand(4096, 512, device="cuda", dtype=torch.bfloat16).requires_grad_()
    bias = rand(512, device="cuda", dtype=torch.bfloat16).requires_grad_()
    residual = rand(4096, 512, device="cuda", dtype=torch.bfloat16).requires_grad_()
    out = cutlass_ext.bias_act(x, bias, "gelu", residual=residual)
    grad = torch.ones_like(out)
    _, names = cuda_kernels_run(lambda: out.backward(grad))
    assert sum("bias_act_backward_kernel" in n for n in names) == 1, names
    # sum_partials: the deterministic dbias finalize.
    others = [n for n in names if not any(k in n for k in ("bias_act_backward_kernel", "sum_partials"))]
    assert others == [], others


@requires_cuda
def test_bias_act_backward_is_deterministic():
    x = rand(16384, 256, device="cuda", dtype=torch.bfloat16)
    grad = rand(16384, 256, device="cuda", dtype=torch.bfloat16)
    bias = rand(256, device="cuda", dtype=torch.bfloat16)
    args = (grad, x, bias, None, "gelu", 1.0, True, True, False)
    first = torch.ops.cutlass_ext._bias_act_backward(*args)
    second = torch.ops.cutlass_ext._bias_act_backward(*args)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


# ------------------------------------------------------------------------------------------------
# relu's masked forward: with a backward to come, bias_act saves one bit an element (z > 0)


def mask_bits(mask, numel):
    """The mask's bits in element order and its padding bits, read from the int32 words' bytes in
    memory (little-endian) lowest bit first, independently of the op's own unpacking."""
    raw = np.unpackbits(mask.cpu().numpy().view(np.uint8), bitorder="little")
    return torch.from_numpy(raw[:numel].astype(bool)), torch.from_numpy(raw[numel:])


def z64_of(x, bias, scale, residual):
    z = x.double() * scale
    if bias is not None:
        z = z + bias.double()
    if residual is not None:
        z = z + residual.double()
    return z


# 16-byte vectors over rows one after another (c1000; c24, whose 32-element mask words span rows)
# and rows apart; the scalar path (c7 and c4097, whose last word is partial; an unaligned base);
# a 1-D x and no rows.
MASK_CASES = {
    "c1000": lambda d, t: rand(37, 1000, device=d, dtype=t),
    "c24": lambda d, t: rand(999, 24, device=d, dtype=t),
    "rows_apart": lambda d, t: rand(40, 320, device=d, dtype=t)[:, 64:320],
    "c7": lambda d, t: rand(5, 7, device=d, dtype=t),
    "c4097": lambda d, t: rand(9, 4097, device=d, dtype=t),
    "offset": lambda d, t: rand(64 * 64 + 1, device=d, dtype=t)[1:].view(64, 64),
    "vector": lambda d, t: rand(48, device=d, dtype=t),
    "zero_rows": lambda d, t: rand(0, 64, device=d, dtype=t),
    "expanded_rows": lambda d, t: rand(1, 256, device=d, dtype=t).expand(50, 256),  # row stride 0
    "transposed": lambda d, t: rand(64, 72, device=d, dtype=t).t(),  # copied to rows
}


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("case", list(MASK_CASES))
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_bias_relu_masked(device, dtype_name, case, with_residual):
    dtype = DTYPES[dtype_name]
    x = MASK_CASES[case](device, dtype)
    bias = rand(x.shape[-1], device=device, dtype=dtype)
    residual = MASK_CASES[case](device, dtype) if with_residual else None
    y, mask = torch.ops.cutlass_ext._bias_relu_masked(x, bias, 0.75, residual)
    assert mask.dtype == torch.int32 and mask.shape == ((x.numel() + 31) // 32,)
    z64 = z64_of(x, bias, 0.75, residual)
    assert_close_to_reference(y, torch.relu(z64), ref_bias_act(x, bias, "relu", 0.75, residual), dtype_name)
    bits, padding = mask_bits(mask, x.numel())
    z64 = z64.cpu().reshape(-1)
    decided = z64.abs() > 1e-5  # where fp32 rounding cannot flip the sign
    assert torch.equal(bits[decided], (z64 > 0)[decided])
    assert not padding.any(), "the last word's unused bits must be 0"


def test_bias_relu_mask_of_zero_nan_and_infinities(device):
    vals = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-45, -1e-45, 3.0, -3.0]
    x = torch.tensor(vals * 5, device=device, dtype=torch.float32).view(5, 9)
    y, mask = torch.ops.cutlass_ext._bias_relu_masked(x, None, 1.0, None)
    bits, _ = mask_bits(mask, x.numel())
    assert bits.view(5, 9)[0].tolist() == [False, False, False, True, False, True, False, True, False]
    assert torch.isnan(y[:, 2]).all() and torch.equal(y[:, 3:], torch.relu(x[:, 3:]))


@pytest.mark.parametrize("case", list(MASK_CASES))
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_bias_relu_mask_backward(device, dtype_name, case):
    dtype = DTYPES[dtype_name]
    x = MASK_CASES[case](device, dtype)
    bias = rand(x.shape[-1], device=device, dtype=dtype)
    _, mask = torch.ops.cutlass_ext._bias_relu_masked(x, bias, 1.0, None)
    grad = MASK_CASES[case](device, dtype)  # strided, offset and scalar layouts as x's
    dx, db, dres = torch.ops.cutlass_ext._bias_relu_mask_backward(grad, mask, 1.5, True, True, True)
    bits, _ = mask_bits(mask, x.numel())
    dz = torch.where(bits.view(x.shape).to(device), grad.double(), 0)
    dz_peer = torch.where(bits.view(x.shape).to(device), grad, 0)
    assert_close_to_reference(dx, 1.5 * dz, 1.5 * dz_peer, dtype_name, what="dx")
    assert_close_to_reference(dres, dz, dz_peer, dtype_name, what="dresidual")
    if x.numel() == 0:
        assert torch.equal(db, torch.zeros_like(db))
    else:
        c = x.shape[-1]
        typical = dz.reshape(-1, c).abs().sum(0) / max(dz.numel() // c, 1) ** 0.5
        assert_close_to_reference(db, dz.reshape(-1, c).sum(0), dz_peer.reshape(-1, c).sum(0), dtype_name,
                                  what="dbias", scale=typical)


def saved_by_backward(fn):
    """The tensors autograd saves while fn runs, as (dtype, shape)."""
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


def test_bias_act_relu_saves_its_mask_only(device, monkeypatch):
    x = rand(30, 40, device=device, dtype=torch.bfloat16).requires_grad_()
    bias = rand(40, device=device, dtype=torch.bfloat16).requires_grad_()
    residual = rand(30, 40, device=device, dtype=torch.bfloat16).requires_grad_()
    saved = saved_by_backward(lambda: cutlass_ext.bias_act(x, bias, "relu", residual=residual))
    assert saved == [(torch.int32, (38,))]  # 1200 bits
    # Other activations save x, bias and residual to recompute z; so does relu past the masked
    # kernel's row length, and no grad mode saves nothing.
    assert len(saved_by_backward(lambda: cutlass_ext.bias_act(x, bias, "gelu", residual=residual))) == 3
    with torch.no_grad():
        y = cutlass_ext.bias_act(x, bias, "relu", residual=residual)
    assert y.grad_fn is None
    monkeypatch.setattr(pointwise, "MAX_MASK_COLS", 32)
    saved = saved_by_backward(lambda: cutlass_ext.bias_act(x, bias, "relu", residual=residual))
    assert [d for d, _ in saved] == [torch.bfloat16] * 3
    out = cutlass_ext.bias_act(x, bias, "relu", residual=residual)
    out.backward(torch.ones_like(out))
    assert torch.equal(x.grad, ((x + bias + residual).float() > 0).to(x.dtype))


@requires_cuda
def test_bias_act_relu_backward_reads_the_mask():
    x = rand(4096, 512, device="cuda", dtype=torch.float32).requires_grad_()
    bias = rand(512, device="cuda", dtype=torch.float32).requires_grad_()
    out = cutlass_ext.bias_act(x, bias, "relu")
    grad = torch.ones_like(out)
    _, names = cuda_kernels_run(lambda: out.backward(grad))
    backward = [n for n in names if "bias_act_backward_kernel" in n]
    assert len(backward) == 1 and "true>" in backward[0], names


@requires_cuda
def test_bias_relu_mask_past_32_bit_vector_indices():
    # More than 2^31 vectors (the scalar path of odd-length rows: one element a vector) take
    # launches of row chunks that each start a mask word; y and every bit must still be right.
    free, _ = torch.cuda.mem_get_info()
    if free < 24 * 2**30:
        pytest.skip("needs 24 GiB of free GPU memory")
    cols = 4097
    rows = (2**31 + 2**22) // cols
    x = torch.empty(rows, cols, device="cuda", dtype=torch.float16)
    for r in range(0, rows, 2**16):
        x[r:r + 2**16].normal_()
    y, mask = torch.ops.cutlass_ext._bias_relu_masked(x, None, 1.0, None)
    flat_x, flat_y = x.view(-1), y.view(-1)
    shifts = torch.arange(32, device="cuda", dtype=torch.int64)
    step = 2**22  # words at a time
    for w in range(0, mask.numel(), step):
        words = mask[w:w + step]
        bits = ((words.to(torch.int64).unsqueeze(1) >> shifts) & 1).view(-1).bool()
        part = flat_x[w * 32:(w + step) * 32]
        assert torch.equal(bits[:part.numel()], part > 0), f"mask words from {w}"
        assert not bits[part.numel():].any()
        assert torch.equal(flat_y[w * 32:(w + step) * 32], torch.relu(part)), f"y from element {w * 32}"


def test_bias_relu_mask_backward_rejects_a_foreign_mask(device):
    grad = rand(8, 16, device=device, dtype=torch.float32)
    op = torch.ops.cutlass_ext._bias_relu_mask_backward
    with pytest.raises((RuntimeError, ValueError), match="mask must be"):
        op(grad, torch.zeros(5, device=device, dtype=torch.int32), 1.0, True, False, False)
    with pytest.raises((RuntimeError, ValueError), match="mask must be"):
        op(grad, torch.zeros(4, device=device, dtype=torch.int64), 1.0, True, False, False)


# ------------------------------------------------------------------------------------------------
# sum


def check_sum(x, dim, keepdim, dtype_name):
    out = cutlass_ext.sum(x, dim, keepdim=keepdim)
    dims = [dim] if isinstance(dim, int) else list(dim)
    assert out.dtype == x.dtype and out.is_contiguous()
    ref = torch.sum(x.double(), dims, keepdim=keepdim)
    # A sum of n zero-mean values is typically sqrt(n) in size, but one can cancel to near zero,
    # where the rounding of its partial sums is large relative to it (not to its inputs): errors
    # are taken relative to at least the typical size, sum(|x|) / sqrt(n).
    n = max(out.numel() and x.numel() // out.numel(), 1)
    typical = torch.sum(x.double().abs(), dims, keepdim=keepdim) / n**0.5
    assert_close_to_reference(out, ref, torch.sum(x, dims, keepdim=keepdim), dtype_name, scale=typical)


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dim", [0, -1, 1, (0, 2), [2, 0, 1], (-1, -2)])
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_sum_dims(device, dtype_name, dim, keepdim):
    x = rand(12, 33, 40, device=device, dtype=DTYPES[dtype_name])
    check_sum(x, dim, keepdim, dtype_name)


# name -> (builder of x given (device, dtype), dim)
SUM_CASES = {
    "row_1": (lambda d, t: rand(64, 1, device=d, dtype=t), -1),
    "row_7": (lambda d, t: rand(100, 7, device=d, dtype=t), -1),
    "row_1000": (lambda d, t: rand(50, 1000, device=d, dtype=t), -1),
    "row_4097": (lambda d, t: rand(9, 4097, device=d, dtype=t), -1),
    "long_rows": (lambda d, t: rand(3, 262144, device=d, dtype=t), -1),
    # long rows, one block a row where the rows fill a quarter of the grid target or more (four
    # blocks an SM): on 132 SMs 1024-thread blocks at 200 rows, 512 at 400 (an odd tail too),
    # split rows at 100
    "long_rows_200": (lambda d, t: rand(200, 20000, device=d, dtype=t), -1),
    "long_rows_400": (lambda d, t: rand(400, 9003, device=d, dtype=t), -1),
    "long_rows_100": (lambda d, t: rand(100, 40000, device=d, dtype=t), -1),
    "one_long_row": (lambda d, t: rand(100003, device=d, dtype=t), 0),
    "many_short_rows": (lambda d, t: rand(50000, 12, device=d, dtype=t), 1),
    # one 16-byte vector a lane and enough rows for a block an SM: lane groups sum four rows at
    # once; 40003 rows end in a partial batch. 16-byte rows of 100 columns (104 apart: 4 tail
    # elements a 16-bit row), and contiguous ones (16-bit rows 200 bytes apart: 8-byte packs, four
    # rows a lane group; fp32 rows 400 bytes apart are 16-byte aligned)
    "batched_short_rows": (lambda d, t: rand(40003, 104, device=d, dtype=t)[:, :100], -1),
    "batched_short_rows_contiguous": (lambda d, t: rand(40003, 100, device=d, dtype=t), -1),
    # 16-bit rows 260 bytes apart: 4-byte packs, three a lane, four rows a group; and rows of 36
    # from a base 4 bytes off 16 (4-byte packs; fp32 rows there take the head form)
    "packed_rows_130": (lambda d, t: rand(8192, 130, device=d, dtype=t), -1),
    "packed_rows_offset": (lambda d, t: rand(40003 * 36 + 2, device=d, dtype=t)[2:].view(40003, 36), -1),
    # a warp a row up to 512 16-byte vectors, eight loads a lane at once from 256 (fp32 2000
    # columns: 500 vectors, lanes ending on 4 or 3 single loads; 16-bit 2000 columns: 250 vectors;
    # 16-bit 4000 columns: 500 vectors)
    "warp_rows_2000": (lambda d, t: rand(300, 2000, device=d, dtype=t), -1),
    "warp_rows_4000": (lambda d, t: rand(300, 4000, device=d, dtype=t), -1),
    # rows off 16-byte boundaries (row_4097, long_rows_400 and offset too): each row's head up to
    # the next boundary read an element at a time, then vectors. Odd pitches, heads varying by row:
    # a warp a row with eight loads a lane (16-bit) or a block a row (fp32); split rows of one
    # offset view, a shared head
    "peeled_rows_3001": (lambda d, t: rand(300, 3001, device=d, dtype=t), -1),
    # lanes whose vector counts are not a multiple of four, loaded together first (16-bit 1020
    # columns, odd pitch: 127 vectors after the head, lanes of 3 and 4; 600 columns: 75, lanes of 2
    # and 3; 36 columns: 4 vectors and a tail, a lane each)
    "group_rest_1020": (lambda d, t: rand(200, 1020, device=d, dtype=t), -1),
    "group_rest_600": (lambda d, t: rand(200, 600, device=d, dtype=t), -1),
    "group_rest_36": (lambda d, t: rand(3000, 36, device=d, dtype=t), -1),
    "peeled_split_rows": (lambda d, t: rand(20, 100001, device=d, dtype=t)[:, 1:], -1),
    "col_7": (lambda d, t: rand(300, 7, device=d, dtype=t), 0),
    "col_4097": (lambda d, t: rand(33, 4097, device=d, dtype=t), 0),
    "tall_columns": (lambda d, t: rand(20000, 24, device=d, dtype=t), 0),
    # split column sums: several outer indices, a partial last column chunk (200 and 72 columns)
    "split_columns_batched": (lambda d, t: rand(4, 5000, 200, device=d, dtype=t), 1),
    "split_columns_tail": (lambda d, t: rand(30000, 72, device=d, dtype=t), 0),
    # rows of 128 loads or more: 32-thread chunks split to two blocks an SM; 16-bit rows 3000 bytes
    # apart read 8-byte packs, fp32 rows 6008 bytes apart too, 16-bit rows 3004 apart an element a
    # thread
    "wide_split_columns_1500": (lambda d, t: rand(2048, 1500, device=d, dtype=t), 0),
    "wide_split_columns_1502": (lambda d, t: rand(2048, 1502, device=d, dtype=t), 0),
    # short rows 260 bytes apart (16-bit: 4-byte loads; fp32 520: 8-byte loads), split to the target
    "short_columns_130": (lambda d, t: rand(4096, 130, device=d, dtype=t), 0),
    # 132-528 splits a column: the second stage's lanes for one round of loads (100 columns: fewer
    # float4 columns a block; 50: the element form at 1024 threads)
    "many_splits_100": (lambda d, t: rand(65536, 100, device=d, dtype=t), 0),
    "many_splits_50": (lambda d, t: rand(65536, 50, device=d, dtype=t), 0),
    # enough 512-byte column chunks to fill the GPU without splitting the rows
    "wide_columns": (lambda d, t: rand(40, 140000, device=d, dtype=t), 0),
    "middle": (lambda d, t: rand(6, 500, 10, device=d, dtype=t), 1),
    "zero_rows_reduced": (lambda d, t: rand(0, 16, device=d, dtype=t), 0),
    "zero_rows_kept": (lambda d, t: rand(0, 16, device=d, dtype=t), 1),
    "noncontig_rows": (lambda d, t: rand(96, 200, device=d, dtype=t)[:, 8:136], -1),
    "noncontig_cols": (lambda d, t: rand(96, 200, device=d, dtype=t)[:, 8:136], 0),
    "offset": (lambda d, t: rand(64 * 64 + 1, device=d, dtype=t)[1:].view(64, 64), -1),
    "transposed": (lambda d, t: rand(64, 72, device=d, dtype=t).t(), 0),
    "permuted": (lambda d, t: rand(5, 6, 32, device=d, dtype=t).permute(2, 0, 1), (0, 2)),
    "expanded": (lambda d, t: rand(1, 48, device=d, dtype=t).expand(30, 48), 0),
    "all_dims": (lambda d, t: rand(7, 9, 11, device=d, dtype=t), (0, 1, 2)),
}


@pytest.mark.parametrize("case", list(SUM_CASES))
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_sum_shapes(device, dtype_name, case):
    make, dim = SUM_CASES[case]
    check_sum(make(device, DTYPES[dtype_name]), dim, False, dtype_name)


@requires_cuda
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_sum_bias_grad_shape(dtype_name):
    x = rand(65536, 512, device="cuda", dtype=DTYPES[dtype_name])
    check_sum(x, 0, False, dtype_name)
    check_sum(x[:, :200], 0, False, dtype_name)  # strided columns: scalar path, no copy


@requires_cuda
def test_sum_is_deterministic():
    for shape, dim in (((65536, 512), 0), ((4, 262144), 1)):
        x = rand(*shape, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(cutlass_ext.sum(x, dim), cutlass_ext.sum(x, dim))


@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("dim", [0, (0, 2), -1])
def test_sum_backward(device, dim, keepdim):
    x = rand(4, 6, 8, device=device, dtype=torch.float32)
    dims = [dim] if isinstance(dim, int) else list(dim)
    grad_out = rand(*torch.sum(x, dims, keepdim=keepdim).shape, device=device, dtype=torch.float32)
    _, (mine,) = grads_of(lambda t: cutlass_ext.sum(t, dim, keepdim=keepdim), [x], grad_out)
    _, (ref,) = grads_of(lambda t: torch.sum(t, dims, keepdim=keepdim), [x.double()], grad_out.double())
    assert mine.shape == x.shape
    torch.testing.assert_close(mine.double(), ref, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# add

ADD_CASES = {
    "one": lambda d, t: rand(1, device=d, dtype=t),
    "tail": lambda d, t: rand(1000003, device=d, dtype=t),  # numel % 8 != 0
    "batched": lambda d, t: rand(3, 17, 40, device=d, dtype=t),
    "zero": lambda d, t: rand(0, 5, device=d, dtype=t),
    "noncontig": lambda d, t: rand(96, 200, device=d, dtype=t)[:, 8:136],
    "offset": lambda d, t: rand(64 * 64 + 1, device=d, dtype=t)[1:].view(64, 64),
    "transposed": lambda d, t: rand(64, 72, device=d, dtype=t).t(),
}


@pytest.mark.parametrize("b_case", ["same", "contiguous"])
@pytest.mark.parametrize("case", list(ADD_CASES))
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_add(device, dtype_name, case, b_case):
    dtype = DTYPES[dtype_name]
    a = ADD_CASES[case](device, dtype)
    b = ADD_CASES[case](device, dtype) if b_case == "same" else rand(*a.shape, device=device, dtype=dtype)
    out = cutlass_ext.add(a, b)
    assert out.dtype == dtype and out.is_contiguous() and out.shape == a.shape
    if a.numel() == 0:
        return
    assert_close_to_reference(out, a.double() + b.double(), a + b, dtype_name)


def test_add_backward(device):
    a = rand(5, 9, device=device, dtype=torch.bfloat16)
    b = rand(5, 9, device=device, dtype=torch.bfloat16)
    grad_out = rand(5, 9, device=device, dtype=torch.bfloat16)
    _, (ga, gb) = grads_of(cutlass_ext.add, [a, b], grad_out)
    assert torch.equal(ga, grad_out) and torch.equal(gb, grad_out)


# ------------------------------------------------------------------------------------------------
# torch.library.opcheck, torch.compile, CUDA graphs, streams


@pytest.mark.parametrize("act", ["none", "relu", "gelu", "sigmoid"])
def test_opcheck_bias_act(device, act):
    x = rand(2, 24, 40, device=device, dtype=torch.bfloat16).requires_grad_()
    bias = rand(40, device=device, dtype=torch.bfloat16).requires_grad_()
    residual = rand(2, 24, 40, device=device, dtype=torch.bfloat16).requires_grad_()
    op = torch.ops.cutlass_ext.bias_act.default
    torch.library.opcheck(op, (x, bias, act, 0.5, residual))
    torch.library.opcheck(op, (x, None, act, 1.0, None))


@pytest.mark.parametrize("act", ["none", "relu", "silu"])
def test_opcheck_bias_act_backward(device, act):
    x = rand(2, 24, 40, device=device, dtype=torch.float16)
    grad = rand(2, 24, 40, device=device, dtype=torch.float16)
    bias = rand(40, device=device, dtype=torch.float16)
    residual = rand(2, 24, 40, device=device, dtype=torch.float16)
    op = torch.ops.cutlass_ext._bias_act_backward.default
    for needs in [(True, True, True), (True, False, False), (False, True, False), (False, False, True)]:
        torch.library.opcheck(op, (grad, x, bias, residual, act, 2.0, *needs))
    torch.library.opcheck(op, (grad, x, None, None, act, 1.0, True, False, False))


def test_opcheck_bias_relu_masked(device):
    x = rand(2, 24, 40, device=device, dtype=torch.bfloat16).requires_grad_()
    bias = rand(40, device=device, dtype=torch.bfloat16).requires_grad_()
    residual = rand(2, 24, 40, device=device, dtype=torch.bfloat16).requires_grad_()
    op = torch.ops.cutlass_ext._bias_relu_masked.default
    torch.library.opcheck(op, (x, bias, 0.5, residual))
    torch.library.opcheck(op, (x, None, 1.0, None))
    grad = rand(2, 24, 40, device=device, dtype=torch.bfloat16)
    _, mask = op(x.detach(), bias.detach(), 0.5, residual.detach())
    backward = torch.ops.cutlass_ext._bias_relu_mask_backward.default
    for needs in [(True, True, True), (True, False, False), (False, True, False), (False, False, True)]:
        torch.library.opcheck(backward, (grad, mask, 2.0, *needs))


def test_opcheck_sum_and_add(device):
    x = rand(6, 10, 12, device=device, dtype=torch.float32).requires_grad_()
    y = rand(6, 10, 12, device=device, dtype=torch.float32).requires_grad_()
    for dim, keepdim in [([0], False), ([2], True), ([0, 2], False), ([-1, 0, 1], True)]:
        torch.library.opcheck(torch.ops.cutlass_ext.sum.default, (x, dim, keepdim))
    torch.library.opcheck(torch.ops.cutlass_ext.add.default, (x, y))
    torch.library.opcheck(torch.ops.cutlass_ext.add.default, (x.detach().transpose(0, 2), y.detach().transpose(0, 2)))


def _compile_backend(device):
    return "inductor" if device == "cuda" else "aot_eager"


@pytest.mark.parametrize("act", ["gelu", "relu"])  # relu: the masked forward
def test_compile_fullgraph(device, act):
    torch._dynamo.reset()
    x = rand(64, 96, device=device, dtype=torch.float32).requires_grad_()
    bias = rand(96, device=device, dtype=torch.float32).requires_grad_()
    residual = rand(64, 96, device=device, dtype=torch.float32).requires_grad_()

    def step(x, b, r):
        h = cutlass_ext.bias_act(x, b, act, scale=0.5, residual=r)
        h = cutlass_ext.add(h, r)
        return cutlass_ext.sum(h.square(), (0, 1))

    compiled = torch.compile(step, fullgraph=True, backend=_compile_backend(device))
    loss = compiled(x, bias, residual)
    loss.backward()
    grads = [t.grad.clone() for t in (x, bias, residual)]
    for t in (x, bias, residual):
        t.grad = None
    eager = step(x, bias, residual)
    eager.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-5)
    for g, t in zip(grads, (x, bias, residual)):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-5)


@requires_cuda
def test_cuda_graph_capture():
    x = rand(512, 256, device="cuda", dtype=torch.bfloat16)
    bias = rand(256, device="cuda", dtype=torch.bfloat16)
    residual = rand(512, 256, device="cuda", dtype=torch.bfloat16)

    def run():
        y = cutlass_ext.bias_act(x, bias, "silu", scale=2.0, residual=residual)
        dx, db, dr = torch.ops.cutlass_ext._bias_act_backward(y, x, bias, residual, "silu", 2.0, True, True, True)
        ym, mask = torch.ops.cutlass_ext._bias_relu_masked(x, bias, 2.0, residual)
        masked = torch.ops.cutlass_ext._bias_relu_mask_backward(y, mask, 2.0, True, True, True)
        return (y, cutlass_ext.sum(x, 0), cutlass_ext.sum(x, 1), cutlass_ext.add(y, residual), dx, db, dr, ym, mask,
                *masked)

    graph, outs = capture_cuda_graph(run)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        residual.copy_(torch.randn_like(residual))
        graph.replay()
        torch.cuda.synchronize()
        for got, expected in zip(outs, run()):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


@requires_cuda
def test_runs_on_current_stream():
    side = torch.cuda.Stream()
    x = rand(4096, 1024, device="cuda", dtype=torch.float16)
    bias = rand(1024, device="cuda", dtype=torch.float16)
    expected = (cutlass_ext.bias_act(x, bias, "gelu"), cutlass_ext.sum(x, 0), cutlass_ext.add(x, x))
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x2 = x * 1  # produced on the side stream, consumed by the next launches on it
        got = (cutlass_ext.bias_act(x2, bias, "gelu"), cutlass_ext.sum(x2, 0), cutlass_ext.add(x2, x2))
    side.synchronize()
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Bad input: every error names the argument


def _x():
    return rand(8, 16, device="cpu", dtype=torch.float16)


@pytest.mark.parametrize(
    "call,exc,pattern",
    [
        (lambda x: cutlass_ext.bias_act(x.double()), TypeError, "x has dtype torch.float64"),
        (lambda x: cutlass_ext.bias_act(x, torch.zeros(16)), TypeError, "bias has dtype torch.float32 but x"),
        (lambda x: cutlass_ext.bias_act(x, x[0].to("meta")), ValueError, "bias is on meta but x is on cpu"),
        (lambda x: cutlass_ext.bias_act(x, x[0, :5]), ValueError, r"bias must have shape \[C\]"),
        (lambda x: cutlass_ext.bias_act(x, residual=x[:4]), ValueError, "residual must have x's shape"),
        (lambda x: cutlass_ext.bias_act(x, residual=x.float()), TypeError, "residual has dtype"),
        (lambda x: cutlass_ext.bias_act(x, activation="tanh"), ValueError, "activation must be one of"),
        (lambda x: cutlass_ext.bias_act(x, scale=x), TypeError, "scale must be a Python number"),
        (lambda x: cutlass_ext.bias_act(x.sum()), ValueError, "x must have at least 1 dimension"),
        (lambda x: cutlass_ext.bias_act(x.numpy()), TypeError, "x must be a torch.Tensor"),
        (lambda x: cutlass_ext.sum(x.int(), 0), TypeError, "x has dtype torch.int32"),
        (lambda x: cutlass_ext.sum(x, 2), IndexError, "dim 2 is out of range"),
        (lambda x: cutlass_ext.sum(x, (0, -2)), ValueError, "dim lists dimension 0 twice"),
        (lambda x: cutlass_ext.sum(x, ()), ValueError, "dim must name at least one dimension"),
        (lambda x: cutlass_ext.sum(x, 0.5), TypeError, "dim must be an int"),
        (lambda x: cutlass_ext.sum(x.sum(), 0), ValueError, "x must have at least 1 dimension"),
        (lambda x: cutlass_ext.add(x, x.float()), TypeError, "b has dtype torch.float32 but a"),
        (lambda x: cutlass_ext.add(x, x.t()), ValueError, "b has shape"),
        (lambda x: cutlass_ext.add(x, x.to("meta")), ValueError, "b is on meta but a is on cpu"),
        (lambda x: cutlass_ext.add(x.double(), x.double()), TypeError, "a has dtype torch.float64"),
        (lambda x: cutlass_ext.add([1.0], x), TypeError, "a must be a torch.Tensor"),
    ],
)
def test_rejects_bad_input(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(_x())


@requires_cuda
def test_device_mix_with_cuda_is_rejected():
    x = _x()
    with pytest.raises(ValueError, match="bias is on cuda:0 but x is on cpu"):
        cutlass_ext.bias_act(x, x[0].cuda())
    with pytest.raises(ValueError, match="b is on cuda:0 but a is on cpu"):
        cutlass_ext.add(x, x.cuda())
