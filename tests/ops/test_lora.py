"""cutlass_ext.lora_linear / _lora_linear_backward / lora_merge against float64 references, on CPU
(reference kernels) and CUDA (extension kernels); and against PEFT's LoRA layer when peft is installed."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import cutlass_ext
from cutlass_ext import _kernel_table
from cutlass_ext.ops import _activation, _rng
from cutlass_ext.ops import lora as lora_ops

from ..conftest import requires_cuda
from ..helpers import (
    DTYPES,
    assert_close_to_reference,
    capture_cuda_graph,
    cuda_kernels_run,
    fp32_precision,
    gemm_kernels_run,
    wide_tile,
)

DTYPE_NAMES = ["fp16", "bf16", "fp32"]
ACTS = ["none", "relu", "gelu"]
SCALING = 2.0


def rand(*shape, device, dtype, scale=1.0):
    return torch.randn(*shape, device=device, dtype=torch.float32).mul_(scale).to(dtype)


def make_params(in_f, out_f, r, device, dtype, bias=True):
    """weight [out, in], lora_A [r, in], lora_B [out, r] (non-zero, unlike a fresh adapter), bias [out]."""
    weight = rand(out_f, in_f, device=device, dtype=dtype, scale=1 / math.sqrt(in_f))
    lora_A = rand(r, in_f, device=device, dtype=dtype, scale=1 / math.sqrt(in_f))
    lora_B = rand(out_f, r, device=device, dtype=dtype, scale=1 / math.sqrt(r))
    b = rand(out_f, device=device, dtype=dtype) if bias else None
    return weight, lora_A, lora_B, b


def keep_mask(x, seed, p):
    """The dropout keep-mask of x: flat row-major index over x's logical shape, from _rng."""
    index = torch.arange(x.numel(), device=x.device, dtype=torch.int64).view(x.shape)
    return _rng.dropout_keep(seed, index, p)


def _dropped(x, keep, p):
    if keep is None:
        return x
    return x * keep.to(x.dtype) * _rng.keep_scale(p)


def ref_lora(x, weight, lora_A, lora_B, bias, scaling, act, keep=None, p=0.0):
    """The formula in float64."""
    x64 = x.double()
    z = x64 @ weight.double().t() + scaling * (_dropped(x64, keep, p) @ lora_A.double().t()) @ lora_B.double().t()
    if bias is not None:
        z = z + bias.double()
    return _activation.apply(z, act)


def peer_lora(x, weight, lora_A, lora_B, bias, scaling, act, keep=None, p=0.0):
    """torch's own result in the same dtype: the eager LoRA formula PEFT runs."""
    z = F.linear(x, weight, bias) + F.linear(F.linear(_dropped(x, keep, p), lora_A), lora_B) * scaling
    return _activation.apply(z, act)


def call_op(x, weight, lora_A, lora_B, bias, act, p=0.0, seed=None, scaling=SCALING):
    """The raw op, saving the pre-activation so the backward works for every activation; t comes
    back as [r, rows] and is returned in x's logical shape [..., r]."""
    y, t, _ = torch.ops.cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, scaling, act, p, seed, True)
    return y, t.t().reshape(*x.shape[:-1], lora_A.shape[0])


def make_seed(device, value=0x1234_5678_9ABC):
    return torch.tensor([value], dtype=torch.int64, device=device)


# ------------------------------------------------------------------------------------------------
# Forward


@pytest.mark.parametrize("r", [1, 8, 16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_forward(device, dtype_name, with_bias, act, r):
    dtype = DTYPES[dtype_name]
    x = rand(3, 17, 72, device=device, dtype=dtype)
    weight, lora_A, lora_B, bias = make_params(72, 40, r, device, dtype, with_bias)
    with fp32_precision(dtype_name):
        out = cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, scaling=SCALING, activation=act)
        peer = peer_lora(x, weight, lora_A, lora_B, bias, SCALING, act)
    assert out.dtype == dtype and out.is_contiguous() and out.shape == (3, 17, 40)
    assert_close_to_reference(out, ref_lora(x, weight, lora_A, lora_B, bias, SCALING, act), peer, dtype_name)


# name -> builder of x [..., 72] given (device, dtype), each with the described layout.
X_CASES = {
    "2d": lambda d, t: rand(129, 72, device=d, dtype=t),
    "one": lambda d, t: rand(1, 72, device=d, dtype=t),
    "vector": lambda d, t: rand(72, device=d, dtype=t),
    "m_zero": lambda d, t: rand(0, 72, device=d, dtype=t),
    "batched": lambda d, t: rand(2, 3, 7, 72, device=d, dtype=t),
    # a column slice of a wider tensor: row stride 100 > in
    "noncontig": lambda d, t: rand(33, 100, device=d, dtype=t)[:, 8:80],
    # the transpose of a row-major [in, M] tensor
    "transposed": lambda d, t: rand(72, 48, device=d, dtype=t).t(),
    # batch dims that cannot be flattened without a copy
    "permuted": lambda d, t: rand(5, 6, 72, device=d, dtype=t).transpose(0, 1),
}


@pytest.mark.parametrize("case", list(X_CASES))
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_forward_layouts(device, dtype_name, case):
    dtype = DTYPES[dtype_name]
    x = X_CASES[case](device, dtype)
    weight, lora_A, lora_B, bias = make_params(72, 40, 8, device, dtype)
    with fp32_precision(dtype_name):
        out = cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, scaling=SCALING, activation="gelu")
        peer = peer_lora(x, weight, lora_A, lora_B, bias, SCALING, "gelu")
    assert out.is_contiguous()
    assert_close_to_reference(out, ref_lora(x, weight, lora_A, lora_B, bias, SCALING, "gelu"), peer, dtype_name)


@pytest.mark.parametrize("act", ["gelu_tanh", "silu", "sigmoid"])
def test_forward_other_activations(device, act):
    x = rand(64, 72, device=device, dtype=torch.bfloat16)
    weight, lora_A, lora_B, bias = make_params(72, 40, 8, device, torch.bfloat16)
    out = cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, scaling=0.5, activation=act)
    peer = peer_lora(x, weight, lora_A, lora_B, bias, 0.5, act)
    assert_close_to_reference(out, ref_lora(x, weight, lora_A, lora_B, bias, 0.5, act), peer, "bf16")


@pytest.mark.parametrize("act,stored", [("none", False), ("relu", False), ("gelu", True), ("silu", True)])
def test_outputs_t_and_preact(device, act, stored):
    x = rand(4, 9, 72, device=device, dtype=torch.float32)
    weight, lora_A, lora_B, bias = make_params(72, 40, 8, device, torch.float32)
    with fp32_precision("fp32"):
        y, t, preact = torch.ops.cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, SCALING, act, 0.0, None,
                                                          True)
    # t is returned transposed: [r, rows], contiguous.
    assert t.shape == (8, 36) and t.is_contiguous()
    assert_close_to_reference(t, (x.double() @ lora_A.double().t()).reshape(36, 8).t(), None, "fp32", what="t")
    if stored:
        assert_close_to_reference(preact, ref_lora(x, weight, lora_A, lora_B, bias, SCALING, "none"), None, "fp32",
                                  what="preact")
    else:
        assert preact.numel() == 0


# ------------------------------------------------------------------------------------------------
# Dropout


def test_dropout_same_seed_reproduces(device):
    x = rand(64, 72, device=device, dtype=torch.bfloat16)
    weight, lora_A, lora_B, bias = make_params(72, 40, 8, device, torch.bfloat16)
    first = call_op(x, weight, lora_A, lora_B, bias, "gelu", 0.3, make_seed(device))
    second = call_op(x, weight, lora_A, lora_B, bias, "gelu", 0.3, make_seed(device))
    other = call_op(x, weight, lora_A, lora_B, bias, "gelu", 0.3, make_seed(device, 99))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not torch.equal(first[1], other[1])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_mask_matches_rng(device, p):
    # With lora_A = I, t = drop(x) @ I = drop(x): the op's mask, read back element by element.
    x = rand(5, 3, 16, device=device, dtype=torch.float32).transpose(0, 1)  # logical [3, 5, 16], not contiguous
    weight, _, lora_B, bias = make_params(16, 24, 16, device, torch.float32)
    eye = torch.eye(16, device=device, dtype=torch.float32)
    seed = make_seed(device, 2**62 - 12345)
    with fp32_precision("fp32"):
        _, t = call_op(x, weight, eye, lora_B, bias, "none", p, seed)
    keep = keep_mask(x, seed, p)
    assert torch.equal(t != 0, keep), "dropout mask differs from _rng.dropout_keep over x's row-major index"
    torch.testing.assert_close(t, torch.where(keep, x / (1 - p), 0.0), rtol=1e-6, atol=0)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.12


def test_dropout_p_one_drops_everything(device):
    x = rand(32, 72, device=device, dtype=torch.float32)
    weight, lora_A, lora_B, bias = make_params(72, 40, 8, device, torch.float32)
    with fp32_precision("fp32"):
        y, t = call_op(x, weight, lora_A, lora_B, bias, "none", 1.0, make_seed(device))
        base = F.linear(x, weight, bias)
    assert torch.count_nonzero(t) == 0
    torch.testing.assert_close(y, base)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_dropout_forward_and_backward(device, dtype_name, act):
    dtype = DTYPES[dtype_name]
    p = 0.3
    x = rand(3, 21, 72, device=device, dtype=dtype)
    weight, lora_A, lora_B, bias = make_params(72, 40, 8, device, dtype)
    grad_out = rand(3, 21, 40, device=device, dtype=dtype)
    seed = make_seed(device)
    keep = keep_mask(x, seed, p)
    if act == "relu":
        # Where the pre-activation is within the input dtype's rounding of zero, ReLU's mask is a
        # coin toss for ours and torch's alike (and one flip moves dx by a whole gradient entry):
        # no gradient flows from there.
        z = ref_lora(*(v.double() for v in (x, weight, lora_A, lora_B, bias)), SCALING, "none", keep, p)
        grad_out = grad_out.masked_fill(z.abs() < 1e-2 * z.std(), 0)
    with fp32_precision(dtype_name):
        ours_out, ours = grads_of(lambda *a: call_op(*a, act, p, seed)[0], [x, weight, lora_A, lora_B, bias],
                                  grad_out)
        peer_out, peer = grads_of(lambda *a: peer_lora(*a, SCALING, act, keep, p), [x, weight, lora_A, lora_B, bias],
                                  grad_out)
    ref_out, ref = grads_of(lambda *a: ref_lora(*a, SCALING, act, keep, p),
                            [v.double() for v in (x, weight, lora_A, lora_B, bias)], grad_out.double())
    assert_close_to_reference(ours_out, ref_out, peer_out, dtype_name)
    for name, o, pe, r in zip(("dx", "dweight", "dA", "dB", "dbias"), ours, peer, ref):
        assert o.dtype == dtype
        assert_close_to_reference(o, r, pe, dtype_name, what=name)


def test_public_function_dropout_only_when_training(device):
    x = rand(64, 72, device=device, dtype=torch.float32)
    weight, lora_A, lora_B, bias = make_params(72, 40, 8, device, torch.float32)
    with fp32_precision("fp32"):
        plain = cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, scaling=SCALING)
        evaluated = cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, scaling=SCALING, dropout_p=0.5,
                                            training=False)
        first = cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, scaling=SCALING, dropout_p=0.5)
        second = cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, scaling=SCALING, dropout_p=0.5)
    assert torch.equal(plain, evaluated)
    assert not torch.equal(first, plain) and not torch.equal(first, second)  # a fresh seed per call


def test_dropout_without_seed_fails_clearly(device):
    x = rand(8, 16, device=device, dtype=torch.float32)
    weight, lora_A, lora_B, bias = make_params(16, 8, 4, device, torch.float32)
    with pytest.raises(Exception, match="needs a seed"):
        call_op(x, weight, lora_A, lora_B, bias, "none", 0.2, None)


# ------------------------------------------------------------------------------------------------
# Backward


def grads_of(fn, inputs, grad_out):
    inputs = [v.detach().requires_grad_(True) if v is not None else None for v in inputs]
    out = fn(*inputs)
    out.backward(grad_out)
    return out, [v.grad if v is not None else None for v in inputs]


def reference_grads(y, inputs, grad_out, act):
    """The formula's output and gradients in float64. relu's derivative jumps at 0: its mask is
    taken from our own output y, so that a z near 0 that rounds to the other side in low precision
    is not counted as a backward error."""
    if act == "relu":
        mask = (y.detach() > 0).double()
        ref_fn = lambda *a: ref_lora(*a, SCALING, "none") * mask  # noqa: E731
    else:
        ref_fn = lambda *a: ref_lora(*a, SCALING, act)  # noqa: E731
    return grads_of(ref_fn, [v.double() for v in inputs], grad_out.double())


@pytest.mark.parametrize("r", [1, 16])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_backward(device, dtype_name, act, r):
    dtype = DTYPES[dtype_name]
    x = rand(3, 50, 72, device=device, dtype=dtype)
    weight, lora_A, lora_B, bias = make_params(72, 40, r, device, dtype)
    grad_out = rand(3, 50, 40, device=device, dtype=dtype)
    inputs = [x, weight, lora_A, lora_B, bias]

    def ours_fn(*a):
        return cutlass_ext.lora_linear(*a, scaling=SCALING, activation=act)

    with fp32_precision(dtype_name):
        y, ours = grads_of(ours_fn, inputs, grad_out)
        _, peer = grads_of(lambda *a: peer_lora(*a, SCALING, act), inputs, grad_out)
    _, ref = reference_grads(y, inputs, grad_out, act)
    for name, o, p, rf in zip(("dx", "dweight", "dA", "dB", "dbias"), ours, peer, ref):
        assert o.dtype == dtype and o.shape == rf.shape and o.is_contiguous()
        assert_close_to_reference(o, rf, p, dtype_name, what=name)


def test_backward_noncontiguous_x_and_grad(device):
    x = rand(40, 100, device=device, dtype=torch.bfloat16)[:, 10:82]
    weight, lora_A, lora_B, bias = make_params(72, 40, 8, device, torch.bfloat16)
    grad_out = rand(40, 40, device=device, dtype=torch.bfloat16).t()  # column-major incoming gradient
    inputs = [x, weight, lora_A, lora_B, bias]
    # A smooth activation: with ReLU, a pre-activation within rounding distance of 0 flips the
    # mask, and on a 40x40 output one flip moves dx by several percent for any rounding order.
    act = "gelu"
    _, ours = grads_of(lambda *a: cutlass_ext.lora_linear(*a, scaling=SCALING, activation=act), inputs, grad_out)
    _, peer = grads_of(lambda *a: peer_lora(*a, SCALING, act), inputs, grad_out)
    _, ref = grads_of(lambda *a: ref_lora(*a, SCALING, act), [v.double() for v in inputs], grad_out.double())
    for name, o, p, rf in zip(("dx", "dweight", "dA", "dB", "dbias"), ours, peer, ref):
        assert_close_to_reference(o, rf, p, "bf16", what=name)


class RecordBackwardCalls(TorchDispatchMode):
    """Records the need_* flags of every _lora_linear_backward call (on any device)."""

    def __init__(self):
        super().__init__()
        self.needs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.cutlass_ext._lora_linear_backward.default:
            self.needs.append(tuple(args[-5:]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("trainable", ["A+B", "x+A+B", "x", "B", "x+weight+bias+A+B", "weight"])
def test_backward_computes_only_needed_grads(device, trainable):
    wanted = trainable.split("+")
    names = ("x", "weight", "A", "B", "bias")
    x = rand(4, 10, 72, device=device, dtype=torch.bfloat16)
    tensors = [x, *make_params(72, 40, 8, device, torch.bfloat16)]
    tensors = [t.requires_grad_(n in wanted) for t, n in zip(tensors, names)]
    out = cutlass_ext.lora_linear(*tensors, scaling=SCALING, activation="gelu")
    with RecordBackwardCalls() as rec:
        out.float().square().sum().backward()
    assert rec.needs == [tuple(n in wanted for n in names)]
    for t, n in zip(tensors, names):
        assert (t.grad is not None) == (n in wanted), n


def test_backward_without_saved_preactivation_fails_clearly(device):
    x = rand(8, 16, device=device, dtype=torch.float32).requires_grad_()
    weight, lora_A, lora_B, bias = make_params(16, 8, 4, device, torch.float32)
    y, _, _ = torch.ops.cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, 1.0, "gelu", 0.0, None, False)
    with pytest.raises(RuntimeError, match="save_preact=True"):
        y.sum().backward()


def test_no_grad_saves_no_preactivation(device):
    x = rand(8, 16, device=device, dtype=torch.float32)
    weight, lora_A, lora_B, bias = make_params(16, 8, 4, device, torch.float32)
    lora_A.requires_grad_()
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.cutlass_ext.lora_linear.default:
                seen.append(args[-1])
            return func(*args, **(kwargs or {}))

    with Record():
        with torch.no_grad():
            cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, scaling=1.0, activation="gelu")
        cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, scaling=1.0, activation="gelu")
    assert seen == [False, True]


# dA = s U^T drop(x) beside the dx GEMM: from 2^23 elements of x the backward runs it on a second
# stream that waits for the work before the dx GEMM, and the caller's stream waits for it.
OVERLAP_ROWS, OVERLAP_IN, OVERLAP_OUT = 2048, 4096, 1024  # 2048 x 4096 = 2^23: the smallest that overlaps


def kernel_streams(fn):
    """The CUDA streams the kernels launched by fn() ran on, from the profiler's trace."""
    import json
    import tempfile

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    return {e["args"]["stream"] for e in trace["traceEvents"] if e.get("cat") == "kernel"}


def overlap_step(p=0.0, seed=None, act="gelu"):
    """Inputs of a training step whose backward overlaps dA, and a function running the step
    (returns y, dx, dA, dB): x, A and B require grad, the base weight and bias are frozen."""
    dtype = torch.bfloat16
    x = rand(OVERLAP_ROWS, OVERLAP_IN, device="cuda", dtype=dtype)
    weight, lora_A, lora_B, bias = make_params(OVERLAP_IN, OVERLAP_OUT, 16, "cuda", dtype)
    grad_out = rand(OVERLAP_ROWS, OVERLAP_OUT, device="cuda", dtype=dtype)
    inputs = [x, weight, lora_A, lora_B, bias]

    def step():
        leaves = [v.detach().requires_grad_(i in (0, 2, 3)) for i, v in enumerate(inputs)]
        if p > 0.0:
            y = call_op(leaves[0], *leaves[1:], act, p, seed)[0]
        else:
            y = cutlass_ext.lora_linear(*leaves, scaling=SCALING, activation=act)
        y.backward(grad_out)
        return y, leaves[0].grad, leaves[2].grad, leaves[3].grad

    return inputs, grad_out, step


@requires_cuda
def test_dA_beside_the_dx_gemm_matches_the_reference(monkeypatch):
    monkeypatch.setenv("CUTLASS_EXT_LORA_OVERLAP", "1")
    inputs, grad_out, step = overlap_step()
    y, dx, dA, dB = step()
    _, ref = reference_grads(y, inputs, grad_out, "gelu")
    _, peer = grads_of(lambda *a: peer_lora(*a, SCALING, "gelu"), inputs, grad_out)
    for name, i, o in (("dx", 0, dx), ("dA", 2, dA), ("dB", 3, dB)):
        assert_close_to_reference(o, ref[i], peer[i], "bf16", what=name)


@requires_cuda
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_dA_beside_the_dx_gemm_is_the_same_on_one_stream(monkeypatch, p):
    _, _, step = overlap_step(p, make_seed("cuda"))
    monkeypatch.setenv("CUTLASS_EXT_LORA_OVERLAP", "1")
    beside = step()
    streams_beside = kernel_streams(step)
    monkeypatch.setenv("CUTLASS_EXT_LORA_OVERLAP", "0")
    alone = step()
    streams_alone = kernel_streams(step)
    for name, a, b in zip(("y", "dx", "dA", "dB"), beside, alone):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert len(streams_alone) == 1
    assert len(streams_beside) == 2  # the overlap was taken: dA ran on a second stream


@requires_cuda
def test_dA_beside_the_dx_gemm_on_a_side_stream_and_in_a_graph(monkeypatch):
    monkeypatch.setenv("CUTLASS_EXT_LORA_OVERLAP", "1")
    _, _, step = overlap_step()
    expected = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = step()
    torch.cuda.current_stream().wait_stream(side)
    graph, captured = capture_cuda_graph(step)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    for name, e, a, b in zip(("y", "dx", "dA", "dB"), expected, on_side, captured):
        torch.testing.assert_close(a, e, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(b, e, rtol=0, atol=0, msg=name)


# ------------------------------------------------------------------------------------------------
# lora_merge

MERGE_SHAPES = [(40, 72, 8), (1, 1, 1), (257, 129, 16), (64, 64, 64)]


@pytest.mark.parametrize("shape", MERGE_SHAPES)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_merge_in_place(device, dtype_name, shape):
    dtype = DTYPES[dtype_name]
    out_f, in_f, r = shape
    weight, lora_A, lora_B, _ = make_params(in_f, out_f, r, device, dtype, bias=False)
    original = weight.clone()
    ptr, version = weight.data_ptr(), weight._version
    with fp32_precision(dtype_name):
        returned = cutlass_ext.lora_merge(weight, lora_A, lora_B, 0.75)
        peer = original + 0.75 * (lora_B @ lora_A)
    assert returned is weight and weight.data_ptr() == ptr and weight._version > version
    ref = original.double() + 0.75 * (lora_B.double() @ lora_A.double())
    assert_close_to_reference(weight, ref, peer, dtype_name, what="merged weight")


def rank_update_takes(weight, r):
    """Whether lora_merge runs as the rank-r update pass (csrc/gemm/rank_update.h) rather than a
    GEMM with the weight as its C operand: a 16-bit weight with r <= 64, a multiple of 8 columns,
    unit column stride and rows in 16-byte pieces (lora_A and lora_B may have any strides)."""
    return (weight.dtype != torch.float32 and 1 <= r <= 64 and weight.size(1) % 8 == 0 and weight.stride(1) == 1
            and weight.stride(0) % 8 == 0 and weight.stride(0) >= weight.size(1) and weight.data_ptr() % 16 == 0)


def merge_operands(out_f, in_f, r, layout, dtype):
    """(weight, lora_A, lora_B, storage of weight) on CUDA, laid out as `layout` says: weight a
    column slice of a wider matrix (a row stride of in_f + 24, or in_f + 3 that no 16-byte piece
    fits), or lora_A and lora_B transposed views (column-major)."""
    weight, lora_A, lora_B, _ = make_params(in_f, out_f, r, "cuda", dtype, bias=False)
    storage = weight
    if layout in ("weight_slice", "weight_odd_stride"):
        pad = 24 if layout == "weight_slice" else 3
        storage = rand(out_f, in_f + pad, device="cuda", dtype=dtype, scale=1 / math.sqrt(in_f))
        weight = storage[:, 8:8 + in_f] if layout == "weight_slice" else storage[:, :in_f]
    elif layout == "factors_transposed":
        lora_A = lora_A.t().contiguous().t()
        lora_B = lora_B.t().contiguous().t()
    return weight, lora_A, lora_B, storage


def large_tile_fits():
    """Whether a block may have the 256 x 256 tile's 103 KB of shared memory (not on compute
    capability 8.6 and 8.9, whose blocks have 99 KB)."""
    props = torch.cuda.get_device_properties(0)
    return (props.major, props.minor) not in ((8, 6), (8, 9))


def rank_update_tile(out_f, in_f, r):
    """The block tile the pass picks by its rule (csrc/gemm/rank_update.cu, rank_update_tile): the
    256 x 256 tile up to r = 32, and above where its blocks fill their rounds of 2 an SM to half or
    more; the small tile wherever the large one does not fit."""
    if not large_tile_fits():
        return "128x64"
    slots = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    blocks = math.ceil(out_f / 256) * math.ceil(in_f / 256)
    rounds = math.ceil(blocks / slots)
    fill = blocks / (rounds * slots)
    large = r <= 32 or fill >= 0.5
    return "256x256" if large else "128x64"


def tile_of(names):
    """The tile of the rank-r update kernel among the kernels that ran ("128x64" or "256x256")."""
    tiles = {f"{m}x{n}" for name in names for m, n in re.findall(r"rank_update_kernel<.*Tile<(\d+), (\d+)", name)}
    assert len(tiles) == 1, names
    return tiles.pop()


@requires_cuda
@pytest.mark.parametrize("shape", [(257, 136, 16), (300, 200, 24), (130, 4104, 40), (96, 64, 5), (128, 64, 64),
                                   (128, 64, 65), (64, 60, 8), (520, 584, 16)])
@pytest.mark.parametrize("layout", ["contiguous", "weight_slice", "weight_odd_stride", "factors_transposed"])
@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
@pytest.mark.parametrize("tile", ["1", "128x64", "256x256"])
def test_merge_rank_update(dtype_name, shape, layout, tile, monkeypatch):
    # Tails in both dimensions (rows past a 128- and a 256-row tile, 8 columns past a 64- and a
    # 256-column one), r from 5 to 65, both block tiles and the rule's pick ("1"), and every
    # layout: where the rank-r pass takes the operands it must be the kernel that ran, on the tile
    # asked for, and the storage around a sliced weight must be untouched.
    if tile == "256x256" and not large_tile_fits():
        pytest.skip("a block of this GPU may not have the 256 x 256 tile's shared memory")
    dtype = DTYPES[dtype_name]
    out_f, in_f, r = shape
    weight, lora_A, lora_B, storage = merge_operands(out_f, in_f, r, layout, dtype)
    original, storage_before = weight.clone(), storage.clone()
    monkeypatch.setenv("CUTLASS_EXT_LORA_MERGE_PASS", tile)
    _, names = cuda_kernels_run(lambda: cutlass_ext.lora_merge(weight, lora_A, lora_B, 0.75))
    assert any("rank_update_kernel" in n for n in names) == rank_update_takes(weight, r), names
    if rank_update_takes(weight, r):
        assert tile_of(names) == (rank_update_tile(out_f, in_f, r) if tile == "1" else tile)
    peer = original + 0.75 * (lora_B @ lora_A)
    ref = original.double() + 0.75 * (lora_B.double() @ lora_A.double())
    assert_close_to_reference(weight, ref, peer, dtype_name, what="merged weight")
    if storage is not weight:
        outside = torch.ones_like(storage, dtype=torch.bool)
        offset = 8 if layout == "weight_slice" else 0
        outside[:, offset:offset + in_f] = False
        assert torch.equal(storage[outside], storage_before[outside])


@requires_cuda
def test_cuda_graph_capture_merge():
    # The rank-r pass launches on the current stream: captured in a CUDA graph (on a side stream),
    # each replay adds the product once more, bitwise as eager calls do.
    weight, lora_A, lora_B, _ = merge_operands(300, 200, 16, "contiguous", torch.bfloat16)
    assert rank_update_takes(weight, 16)
    expected = weight.clone()
    graph, _ = capture_cuda_graph(lambda: cutlass_ext.lora_merge(weight, lora_A, lora_B, 0.5))  # runs once
    graph.replay()
    graph.replay()
    for _ in range(3):
        cutlass_ext.lora_merge(expected, lora_A, lora_B, 0.5)
    torch.cuda.synchronize()
    torch.testing.assert_close(weight, expected, rtol=0, atol=0)


@requires_cuda
def test_merge_pass_switch(monkeypatch):
    # CUTLASS_EXT_LORA_MERGE_PASS=0 runs the merge as the GEMM with W as C (comparison runs).
    weight, lora_A, lora_B, _ = merge_operands(300, 200, 16, "contiguous", torch.bfloat16)
    original = weight.clone()
    monkeypatch.setenv("CUTLASS_EXT_LORA_MERGE_PASS", "0")
    _, names = cuda_kernels_run(lambda: cutlass_ext.lora_merge(weight, lora_A, lora_B, 0.75))
    assert not any("rank_update_kernel" in n for n in names) and len(names) == 1, names
    ref = original.double() + 0.75 * (lora_B.double() @ lora_A.double())
    assert_close_to_reference(weight, ref, original + 0.75 * (lora_B @ lora_A), "bf16", what="merged weight")


@requires_cuda
@pytest.mark.parametrize("out_f, in_f, r", [(4096, 4096, 8), (11008, 4096, 16), (11008, 4096, 32), (2048, 2048, 64),
                                            (2048, 2048, 16), (2048, 2048, 40), (8192, 8192, 16), (5120, 5120, 24),
                                            (14336, 4096, 16)])
def test_merge_tile_rule(out_f, in_f, r):
    # The tile the pass picks on real sizes (the bench's merges among them) is the rule's.
    weight = rand(out_f, in_f, device="cuda", dtype=torch.bfloat16)
    lora_A = rand(r, in_f, device="cuda", dtype=torch.bfloat16)
    lora_B = rand(out_f, r, device="cuda", dtype=torch.bfloat16)
    _, names = cuda_kernels_run(lambda: cutlass_ext.lora_merge(weight, lora_A, lora_B, 0.5))
    assert tile_of(names) == rank_update_tile(out_f, in_f, r)


@requires_cuda
def test_merge_pass_setting_rejected(monkeypatch):
    weight, lora_A, lora_B, _ = merge_operands(64, 64, 8, "contiguous", torch.bfloat16)
    monkeypatch.setenv("CUTLASS_EXT_LORA_MERGE_PASS", "64x64")
    with pytest.raises(RuntimeError, match="CUTLASS_EXT_LORA_MERGE_PASS=64x64 is not one of 0"):
        cutlass_ext.lora_merge(weight, lora_A, lora_B, 0.5)


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_merge_unmerge_round_trip(device, dtype_name):
    dtype = DTYPES[dtype_name]
    weight, lora_A, lora_B, _ = make_params(72, 40, 16, device, dtype, bias=False)
    original = weight.clone()
    with fp32_precision(dtype_name):
        cutlass_ext.lora_merge(weight, lora_A, lora_B, SCALING)
        merged = weight.clone()
        cutlass_ext.lora_merge(weight, lora_A, lora_B, SCALING, sign=-1)
    assert not torch.equal(merged, original)
    # Two roundings to the weight's dtype, each at most half an ulp of the merged magnitude.
    eps = torch.finfo(dtype).eps
    atol = 2 * eps * merged.abs().max().item() if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(weight, original, rtol=0, atol=atol)


def test_merge_sign_is_negated_scaling(device):
    weight, lora_A, lora_B, _ = make_params(24, 16, 4, device, torch.float32, bias=False)
    with fp32_precision("fp32"):
        a = cutlass_ext.lora_merge(weight.clone(), lora_A, lora_B, 0.5, sign=-1)
        b = cutlass_ext.lora_merge(weight.clone(), lora_A, lora_B, -0.5)
    assert torch.equal(a, b)


def test_merge_of_a_trainable_parameter(device):
    # Runs under no_grad, so a leaf that requires grad can be merged in place.
    weight = torch.nn.Parameter(rand(16, 24, device=device, dtype=torch.float32))
    _, lora_A, lora_B, _ = make_params(24, 16, 4, device, torch.float32, bias=False)
    cutlass_ext.lora_merge(weight, lora_A, lora_B, 1.0)
    assert weight.requires_grad and weight.grad_fn is None


def test_merge_after_forward_is_caught_by_autograd(device):
    # lora_merge bumps the weight's version (on every backend), so a backward that saved it fails loudly.
    x = rand(8, 24, device=device, dtype=torch.float32).requires_grad_()
    weight, lora_A, lora_B, _ = make_params(24, 16, 4, device, torch.float32, bias=False)
    weight.requires_grad_()
    y = cutlass_ext.lora_linear(x, weight, lora_A, lora_B, scaling=1.0)
    cutlass_ext.lora_merge(weight, lora_A, lora_B, 1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.skipif(lora_ops._BELOW_AD_INPLACE is None, reason="this torch lacks the dispatcher guard")
def test_merge_below_autograd_path(device):
    # lora_merge's eager CUDA path (below the autograd and ADInplaceOrView keys, the version bumped
    # by hand), run on every device here: a trainable leaf is merged in place without a grad_fn,
    # lora_A's requires_grad records nothing, and a backward that saved the weight still fails.
    x = rand(8, 24, device=device, dtype=torch.float32).requires_grad_()
    weight, lora_A, lora_B, _ = make_params(24, 16, 4, device, torch.float32, bias=False)
    weight = torch.nn.Parameter(weight)
    lora_A.requires_grad_()
    ref = weight.detach().double() + 0.5 * (lora_B.detach().double() @ lora_A.detach().double())
    y = torch.nn.functional.linear(x, weight)
    version = weight._version
    with fp32_precision("fp32"):
        lora_ops._merge_below_autograd(weight, lora_A, lora_B, 0.5)
    assert weight._version > version and weight.requires_grad and weight.grad_fn is None
    torch.testing.assert_close(weight.detach().double(), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_merged_weight_matches_unmerged_forward(device):
    x = rand(3, 31, 72, device=device, dtype=torch.float32)
    weight, lora_A, lora_B, bias = make_params(72, 40, 8, device, torch.float32)
    with fp32_precision("fp32"):
        unmerged = cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, scaling=SCALING, activation="silu")
        cutlass_ext.lora_merge(weight, lora_A, lora_B, SCALING)
        merged = cutlass_ext.linear(x, weight.t(), bias, activation="silu")
    torch.testing.assert_close(merged, unmerged, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# torch.library.opcheck, torch.compile, CUDA graphs


def _opcheck_inputs(device, grad=True):
    x = rand(2, 24, 40, device=device, dtype=torch.bfloat16)
    weight, lora_A, lora_B, bias = make_params(40, 32, 8, device, torch.bfloat16)
    return [t.requires_grad_(grad) for t in (x, weight, lora_A, lora_B, bias)]


@pytest.mark.parametrize("act,save,p", [("none", False, 0.0), ("relu", False, 0.2), ("gelu", True, 0.0),
                                        ("silu", True, 0.5)])
def test_opcheck_lora_linear(device, act, save, p):
    x, weight, lora_A, lora_B, bias = _opcheck_inputs(device)
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    seed = make_seed(device) if p > 0 else None
    op = torch.ops.cutlass_ext.lora_linear.default
    torch.library.opcheck(op, (x, weight, lora_A, lora_B, bias, SCALING, act, p, seed, save))
    torch.library.opcheck(op, (x, weight.detach().requires_grad_(), lora_A, lora_B, None, SCALING, act, p, seed, save))


@pytest.mark.parametrize("act,p", [("none", 0.0), ("relu", 0.3), ("gelu", 0.0)])
def test_opcheck_lora_linear_backward(device, act, p):
    x, weight, lora_A, lora_B, _ = _opcheck_inputs(device, grad=False)
    grad = rand(2, 24, 32, device=device, dtype=torch.bfloat16)
    t = rand(8, 48, device=device, dtype=torch.bfloat16)  # lora_linear's [r, rows] second output
    saved = rand(2, 24, 32, device=device, dtype=torch.bfloat16) if act != "none" else None
    seed = make_seed(device) if p > 0 else None
    for needs in [(True, True, True, True, True), (True, False, True, True, False), (False, False, True, True, False),
                  (False, True, False, False, True), (True, False, False, False, False)]:
        torch.library.opcheck(torch.ops.cutlass_ext._lora_linear_backward.default,
                              (grad, x, weight, lora_A, lora_B, t, saved, act, SCALING, p, seed, *needs))


def test_opcheck_lora_merge(device):
    _, weight, lora_A, lora_B, _ = _opcheck_inputs(device, grad=False)
    torch.library.opcheck(torch.ops.cutlass_ext.lora_merge.default, (weight, lora_A, lora_B, 0.5))


def _compile_backend(device):
    return "inductor" if device == "cuda" else "aot_eager"


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_compile_fullgraph(device, act):
    torch._dynamo.reset()
    x, weight, lora_A, lora_B, bias = _opcheck_inputs(device)
    weight.requires_grad_(False)
    seed = make_seed(device)

    weight2, lora_A2, lora_B2, _ = make_params(32, 16, 4, device, torch.bfloat16)

    def step(x, weight, lora_A, lora_B, bias):
        h = cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, scaling=SCALING, activation=act)
        # the raw op with a fixed seed: dropout that compiled and eager runs draw alike
        y, _, _ = torch.ops.cutlass_ext.lora_linear(h, weight2, lora_A2, lora_B2, None, 0.5, "none", 0.25, seed, False)
        return y.float().square().mean()

    inputs = (x, weight, lora_A, lora_B, bias)
    compiled = torch.compile(step, fullgraph=True, backend=_compile_backend(device))
    loss = compiled(*inputs)
    loss.backward()
    trainable = (x, lora_A, lora_B, bias)
    grads = [v.grad.clone() for v in trainable]
    for v in trainable:
        v.grad = None
    eager_loss = step(*inputs)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-2, atol=1e-3)
    for g, v in zip(grads, trainable):
        torch.testing.assert_close(g, v.grad, rtol=2e-2, atol=2e-2)


def test_compile_fullgraph_merge(device):
    torch._dynamo.reset()
    _, weight, lora_A, lora_B, _ = _opcheck_inputs(device, grad=False)
    expected = cutlass_ext.lora_merge(weight.clone(), lora_A, lora_B, 0.5)
    compiled = torch.compile(lambda w, a, b: cutlass_ext.lora_merge(w, a, b, 0.5), fullgraph=True,
                             backend=_compile_backend(device))
    merged = weight.clone()
    compiled(merged, lora_A, lora_B)
    torch.testing.assert_close(merged, expected, rtol=0, atol=0)


def test_compile_fullgraph_training_dropout(device):
    # The public function draws its seed inside the compiled graph.
    torch._dynamo.reset()
    layer = cutlass_ext.FusedLoRALinear(40, 32, r=8, lora_dropout=0.1, activation="gelu", device=device,
                                        dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.lora_B.weight)
    x = rand(2, 24, 40, device=device, dtype=torch.bfloat16).requires_grad_()
    compiled = torch.compile(layer, fullgraph=True, backend=_compile_backend(device))
    compiled(x).float().sum().backward()
    assert torch.isfinite(layer.lora_A.weight.grad).all() and torch.isfinite(x.grad).all()
    assert layer.weight.grad is None


@requires_cuda
def test_cuda_graph_capture_forward():
    x = rand(256, 128, device="cuda", dtype=torch.bfloat16)
    weight, lora_A, lora_B, bias = make_params(128, 192, 16, "cuda", torch.bfloat16)
    seed = make_seed("cuda")

    def run():
        return call_op(x, weight, lora_A, lora_B, bias, "gelu", 0.1, seed)[0]

    graph, out = capture_cuda_graph(run)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, run(), rtol=0, atol=0)


@requires_cuda
def test_cuda_graph_training_step():
    layer = cutlass_ext.FusedLoRALinear(128, 64, r=16, activation="gelu", device="cuda", dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.lora_B.weight, std=0.02)
    x = rand(512, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
    graphed = torch.cuda.make_graphed_callables(layer, (x,))
    x2 = rand(512, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
    graphed(x2).float().square().sum().backward()
    trainable = (x2, layer.lora_A.weight, layer.lora_B.weight)
    g_graph = [v.grad.clone() for v in trainable]
    for v in trainable:
        v.grad = None
    layer(x2).float().square().sum().backward()
    for a, v in zip(g_graph, trainable):
        torch.testing.assert_close(a, v.grad, rtol=0, atol=0)


@requires_cuda
def test_runs_on_current_stream():
    side = torch.cuda.Stream()
    x = rand(1024, 512, device="cuda", dtype=torch.float16)
    weight, lora_A, lora_B, bias = make_params(512, 768, 16, "cuda", torch.float16)
    expected = cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, scaling=SCALING, activation="silu")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x2 = x * 1  # produced on the side stream, consumed by the next launch on it
        out = cutlass_ext.lora_linear(x2, weight, lora_A, lora_B, bias, scaling=SCALING, activation="silu")
    side.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Bad input: every error names the argument


def _good():
    x = rand(8, 16, device="cpu", dtype=torch.float16)
    return (x, *make_params(16, 12, 4, "cpu", torch.float16))


@pytest.mark.parametrize(
    "mutate,exc,pattern",
    [
        (lambda x, w, a, b, c, kw: ((x.double(), w, a, b, c), kw), TypeError, "x has dtype torch.float64"),
        (lambda x, w, a, b, c, kw: ((x, w.float(), a, b, c), kw), TypeError, "weight has dtype torch.float32 but x"),
        (lambda x, w, a, b, c, kw: ((x, w, a.float(), b, c), kw), TypeError, "lora_A has dtype torch.float32"),
        (lambda x, w, a, b, c, kw: ((x, w, a, b.bfloat16(), c), kw), TypeError, "lora_B has dtype torch.bfloat16"),
        (lambda x, w, a, b, c, kw: ((x, w, a, b, c.float()), kw), TypeError, "bias has dtype"),
        (lambda x, w, a, b, c, kw: ((x, w, a.to("meta"), b, c), kw), ValueError, "lora_A is on meta"),
        (lambda x, w, a, b, c, kw: ((x[:, :8], w, a, b, c), kw), ValueError, r"x must be \[..., in_features\]"),
        (lambda x, w, a, b, c, kw: ((x.sum(), w, a, b, c), kw), ValueError, r"x must be \[..., in_features\]"),
        (lambda x, w, a, b, c, kw: ((x, w[0], a, b, c), kw), ValueError, "weight must be 2-D"),
        (lambda x, w, a, b, c, kw: ((x, w, a[:, :8], b, c), kw), ValueError, r"lora_A must be \[r, in_features\]"),
        (lambda x, w, a, b, c, kw: ((x, w, a.t(), b, c), kw), ValueError, "not its transpose"),
        (lambda x, w, a, b, c, kw: ((x, w, a, b[:, :2], c), kw), ValueError, r"lora_B must be \[out_features, r\]"),
        (lambda x, w, a, b, c, kw: ((x, w, a, b.t(), c), kw), ValueError, r"lora_B must be \[out_features, r\]"),
        (lambda x, w, a, b, c, kw: ((x, w, a, b, c[:5]), kw), ValueError, r"bias must have shape \[out_features\]"),
        (lambda x, w, a, b, c, kw: ((x, w, a, b, c), {**kw, "dropout_p": 1.5}), ValueError, "dropout_p must be"),
        (lambda x, w, a, b, c, kw: ((x, w, a, b, c), {**kw, "dropout_p": -0.1}), ValueError, "dropout_p must be"),
        (lambda x, w, a, b, c, kw: ((x, w, a, b, c), {**kw, "activation": "tanh"}), ValueError,
         "activation must be one of"),
        (lambda x, w, a, b, c, kw: ((x, w, a, b, c), {**kw, "scaling": torch.tensor(2.0)}), TypeError,
         "scaling must be a Python number"),
        (lambda x, w, a, b, c, kw: ((x.numpy(), w, a, b, c), kw), TypeError, "x must be a torch.Tensor"),
    ],
)
def test_lora_linear_rejects_bad_input(mutate, exc, pattern):
    args, kwargs = mutate(*_good(), {"scaling": 2.0})
    with pytest.raises(exc, match=pattern):
        cutlass_ext.lora_linear(*args, **kwargs)


@pytest.mark.parametrize(
    "mutate,exc,pattern",
    [
        (lambda w, a, b: (w, a, b.t(), 1.0, {}), ValueError, "lora_B must be"),
        (lambda w, a, b: (w, a[:, :3], b, 1.0, {}), ValueError, "lora_A must be"),
        (lambda w, a, b: (w.double(), a, b, 1.0, {}), TypeError, "weight has dtype torch.float64"),
        (lambda w, a, b: (w, a.float(), b, 1.0, {}), TypeError, "lora_A has dtype"),
        (lambda w, a, b: (w, a, b, 1.0, {"sign": 2}), ValueError, "sign must be"),
        (lambda w, a, b: (w, a, b, None, {}), TypeError, "scaling must be"),
    ],
)
def test_lora_merge_rejects_bad_input(mutate, exc, pattern):
    _, w, a, b, _ = _good()
    weight, lora_A, lora_B, scaling, kwargs = mutate(w, a, b)
    with pytest.raises(exc, match=pattern):
        cutlass_ext.lora_merge(weight, lora_A, lora_B, scaling, **kwargs)


@requires_cuda
def test_device_mix_with_cuda_is_rejected():
    x, w, a, b, c = _good()
    with pytest.raises(ValueError, match="lora_B is on cuda:0 but weight is on cpu"):
        cutlass_ext.lora_linear(x, w, a, b.cuda(), c, scaling=1.0)


def test_cpu_runs_without_extension():
    from cutlass_ext import _build

    x, w, a, b, c = _good()
    cutlass_ext.lora_linear(x, w, a, b, c, scaling=1.0, activation="relu")
    cutlass_ext.lora_merge(w, a, b, 1.0)
    if not torch.cuda.is_available():
        assert _build._module is None


# ------------------------------------------------------------------------------------------------
# Against PEFT's LoRA layer (skipped where peft is not installed)


class _Model(torch.nn.Module):
    def __init__(self, in_f, out_f, device, dtype):
        super().__init__()
        self.proj = torch.nn.Linear(in_f, out_f, device=device, dtype=dtype)

    def forward(self, x):
        return self.proj(x)


def _peft_model(device, dtype, r=8, lora_alpha=16, use_rslora=False, lora_dropout=0.0):
    peft = pytest.importorskip("peft")
    model = _Model(72, 40, device, dtype)
    config = peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=["proj"], lora_dropout=lora_dropout,
                             use_rslora=use_rslora)
    peft_model = peft.get_peft_model(model, config)
    layer = peft_model.base_model.model.proj
    with torch.no_grad():
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)  # PEFT's B starts at zero
    return peft_model, layer


@pytest.mark.parametrize("use_rslora", [False, True])
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_matches_peft(device, dtype_name, use_rslora):
    dtype = DTYPES[dtype_name]
    peft_model, peft_layer = _peft_model(device, dtype, use_rslora=use_rslora)
    fused = cutlass_ext.FusedLoRALinear.from_peft(peft_layer)
    assert fused.scaling == peft_layer.scaling["default"]
    assert fused.weight is peft_layer.base_layer.weight
    peft_factors = (peft_layer.lora_A["default"].weight, peft_layer.lora_B["default"].weight)
    x = rand(3, 17, 72, device=device, dtype=dtype)
    grad_out = rand(3, 17, 40, device=device, dtype=dtype)

    def run(model, factors):
        for v in factors:
            v.grad = None
        xg = x.clone().requires_grad_()
        with fp32_precision(dtype_name):
            out = model(xg)
            out.backward(grad_out)
        return out, [xg.grad, *(v.grad.clone() for v in factors)]

    out_peft, grads_peft = run(peft_model, peft_factors)
    out_fused, grads_fused = run(fused, (fused.lora_A.weight, fused.lora_B.weight))
    # float32 adapters (PEFT keeps them so over 16-bit bases) in float64 are the reference
    ref_inputs = [v.double() for v in (x, peft_layer.base_layer.weight, *peft_factors, peft_layer.base_layer.bias)]
    ref_out, ref = grads_of(lambda *a: ref_lora(*a, fused.scaling, "none"), ref_inputs, grad_out.double())
    assert_close_to_reference(out_fused, ref_out, out_peft, dtype_name)
    for name, ours, theirs, r in zip(("dx", "dA", "dB"), grads_fused, grads_peft, (ref[0], ref[2], ref[3])):
        assert_close_to_reference(ours, r, theirs, dtype_name, what=name)


def test_matches_peft_merged_and_unmerged(device):
    peft_model, peft_layer = _peft_model(device, torch.float32)
    x = rand(5, 72, device=device, dtype=torch.float32)
    with fp32_precision("fp32"), torch.no_grad():
        fused = cutlass_ext.FusedLoRALinear.from_peft(peft_layer)
        unmerged = fused(x)
        expected_weight = peft_layer.base_layer.weight + peft_layer.get_delta_weight("default")
        fused.merge()
        torch.testing.assert_close(fused.weight, expected_weight, rtol=1e-5, atol=1e-6)
        merged = fused(x)
        fused.unmerge()
        # PEFT's own merge tests use atol = rtol = 1e-4 in float32.
        torch.testing.assert_close(merged, unmerged, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(peft_model(x), unmerged, rtol=1e-4, atol=1e-4)

        peft_layer.merge()  # PEFT merges into the shared base weight; from_peft sees a merged layer
        fused_of_merged = cutlass_ext.FusedLoRALinear.from_peft(peft_layer)
        assert fused_of_merged.merged
        torch.testing.assert_close(fused_of_merged(x), unmerged, rtol=1e-4, atol=1e-4)
        fused_of_merged.unmerge()
        peft_layer.merged_adapters.clear()  # the weight was unmerged through the fused layer
        torch.testing.assert_close(peft_model(x), unmerged, rtol=1e-4, atol=1e-4)


def test_state_dict_round_trip_with_peft(device):
    peft = pytest.importorskip("peft")
    peft_model, peft_layer = _peft_model(device, torch.float32)
    prefix = "base_model.model.proj."
    adapter_sd = peft.get_peft_model_state_dict(peft_model)  # PEFT's saved-adapter keys
    assert set(adapter_sd) == {prefix + "lora_A.weight", prefix + "lora_B.weight"}
    base = torch.nn.Linear(72, 40, device=device)
    base.load_state_dict(peft_layer.base_layer.state_dict())

    # PEFT adapter file -> FusedLoRALinear: the keys match after the module prefix.
    fused = cutlass_ext.FusedLoRALinear.from_linear(base, r=8, lora_alpha=16)
    missing, unexpected = fused.load_state_dict({k[len(prefix):]: v for k, v in adapter_sd.items()}, strict=False)
    assert set(missing) == {"weight", "bias"} and not unexpected
    x = rand(9, 72, device=device, dtype=torch.float32)
    with fp32_precision("fp32"), torch.no_grad():
        torch.testing.assert_close(fused(x), peft_model(x), rtol=1e-5, atol=1e-5)

    # FusedLoRALinear -> a fresh PEFT model.
    with torch.no_grad():
        torch.nn.init.normal_(fused.lora_A.weight)
    other_model, _ = _peft_model(device, torch.float32)
    other_model.base_model.model.proj.base_layer.load_state_dict(base.state_dict())
    lora_sd = {prefix + k: v for k, v in fused.state_dict().items() if k.startswith("lora_")}
    peft.set_peft_model_state_dict(other_model, lora_sd)
    with fp32_precision("fp32"), torch.no_grad():
        torch.testing.assert_close(other_model(x), fused(x), rtol=1e-5, atol=1e-5)
    # and nn.Linear's own keys for the base
    assert fused.state_dict()["weight"].data_ptr() == base.weight.data_ptr()


def test_from_peft_keeps_dropout_probability():
    _, peft_layer = _peft_model("cpu", torch.float32, lora_dropout=0.1)
    fused = cutlass_ext.FusedLoRALinear.from_peft(peft_layer)
    assert fused.lora_dropout == 0.1


def _lora_step(x, weight, lora_A, lora_B):
    x = x.detach().requires_grad_(True)
    lora_A = lora_A.detach().requires_grad_(True)
    lora_B = lora_B.detach().requires_grad_(True)
    grad = rand(x.shape[0], weight.shape[0], device="cuda", dtype=x.dtype)
    cutlass_ext.lora_linear(x, weight, lora_A, lora_B, scaling=SCALING).backward(grad)
    return x.grad, lora_A.grad, lora_B.grad


@requires_cuda
@pytest.mark.parametrize("rank_pass", ["1", "0"])
def test_rank_r_products_avoid_wide_tiles(monkeypatch, rank_pass):
    # With the rank-r pass, t (forward) and U with dB (backward) are one pass each, and the GEMMs
    # left are the two main ones and dA. Without it (CUTLASS_EXT_LORA_RANK_PASS=0), t, U, dA and
    # dB are kept as [r, rows] so that they run on the transposed small-M kernels; computed as
    # [rows, r] they fell to the 128x128 stream-K tile with r of its 128 columns used (1.4-1.55x
    # slower at 8192 tokens). At 4096 tokens and 4096x4096 every product here fills the machine
    # without splitting K: no stream-K kernel may run (the scheduler's name is part of the
    # kernel's, mangled or not; x @ lora_A.T as [rows, r] runs one).
    monkeypatch.setenv("CUTLASS_EXT_LORA_RANK_PASS", rank_pass)
    x = rand(4096, 4096, device="cuda", dtype=torch.bfloat16)
    weight, lora_A, lora_B, _ = make_params(4096, 4096, 16, "cuda", torch.bfloat16, bias=False)
    grads, names = cuda_kernels_run(lambda: _lora_step(x, weight, lora_A, lora_B))
    gemms = [n for n in names if "Gemm" in n or "gemm" in n]
    passes = [n for n in names if "rank_pass_kernel" in n]
    if rank_pass == "1":
        assert len(passes) == 2 and len(gemms) == 3, (passes, [n[:120] for n in gemms])
    else:
        assert not passes and len(gemms) >= 6, [n[:120] for n in gemms]  # t, main, U, dx, dA, dB
    assert not [n for n in gemms if "StreamK" in n], [n[:200] for n in gemms if "StreamK" in n]
    assert all(g is not None for g in grads)


def layer_case(shape, r, dtype):
    """[x, weight, lora_A, lora_B, bias] and an incoming gradient for a (rows, in, out) layer on CUDA."""
    rows, in_f, out_f = shape
    x = rand(rows, in_f, device="cuda", dtype=dtype)
    weight, lora_A, lora_B, bias = make_params(in_f, out_f, r, "cuda", dtype)
    return [x, weight, lora_A, lora_B, bias], rand(rows, out_f, device="cuda", dtype=dtype)


def check_gelu_step(y, ours, inputs, grad_out, dtype_name, keep=None, p=0.0):
    """y and the five gradients of a GELU layer against float64, the gradients against torch's own
    error too."""
    ref_y, ref = grads_of(lambda *a: ref_lora(*a, SCALING, "gelu", keep, p), [v.double() for v in inputs],
                          grad_out.double())
    _, peer = grads_of(lambda *a: peer_lora(*a, SCALING, "gelu", keep, p), inputs, grad_out)
    assert_close_to_reference(y, ref_y, None, dtype_name, what="y")
    for name, o, pr, rf in zip(("dx", "dweight", "dA", "dB", "dbias"), ours, peer, ref):
        assert_close_to_reference(o, rf, pr, dtype_name, what=name)


# rows, in, out: rows a multiple of 8 or not (then dB is a GEMM: the pass reads t in 16-byte
# pieces), in and out multiples of 8 but not of the pass's 512-column slab; few rows; a wide
# layer (22 slabs, so 6 row groups on 132 SMs).
RANK_PASS_SHAPES = [(1504, 1416, 1544), (1500, 1416, 1544), (8, 520, 1000), (3, 64, 24), (264, 512, 11008)]


@requires_cuda
@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("shape", RANK_PASS_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("r", [1, 8, 16, 24, 32, 40])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
def test_rank_pass_products(dtype_name, r, shape, p):
    # t, U and dB from the rank-r pass (r <= 32; r = 40 takes the GEMMs) against float64, with
    # the pass seen to run once forward and once backward; with dropout the backward's U feeds
    # the masked low-rank dx term instead of the extended-K operand.
    inputs, grad_out = layer_case(shape, r, DTYPES[dtype_name])
    seed = make_seed("cuda") if p > 0 else None
    keep = keep_mask(inputs[0], seed, p) if p > 0 else None
    (y, ours), names = cuda_kernels_run(
        lambda: grads_of(lambda *a: call_op(*a, "gelu", p, seed)[0], inputs, grad_out))
    passes = sum("rank_pass_kernel" in n for n in names)
    assert passes == (2 if r <= 32 else 0), names
    assert all(o.is_contiguous() for o in ours)
    check_gelu_step(y, ours, inputs, grad_out, dtype_name, keep, p)


@requires_cuda
@pytest.mark.parametrize("r", [8, 12])
def test_rank_pass_factor_layouts(r):
    # lora_A and lora_B stored transposed (column-major views): the pass copies each factor along
    # its unit stride (A along the rank, B along the columns; the rank a multiple of 8 or not).
    inputs, grad_out = layer_case(RANK_PASS_SHAPES[0], r, torch.bfloat16)
    inputs[2], inputs[3] = inputs[2].t().contiguous().t(), inputs[3].t().contiguous().t()
    (y, ours), names = cuda_kernels_run(lambda: grads_of(lambda *a: call_op(*a, "gelu")[0], inputs, grad_out))
    assert sum("rank_pass_kernel" in n for n in names) == 2, names
    check_gelu_step(y, ours, inputs, grad_out, "bf16")


# rows, in, out: every product fills an H100/H200 with 128x128 tiles, so the main GEMMs take the
# data-parallel config whose extended-K twin folds in the rank-r term. in and out are not
# multiples of the 64-deep stage (a partial last stage of the first operand pair), rows not of
# the 128-row tile.
EXTK_SHAPE = (1500, 1416, 1544)


@requires_cuda
@pytest.mark.parametrize("r", [8, 16, 24, 72])
@pytest.mark.parametrize("act", ["none", "relu", "gelu"])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
def test_rank_r_term_inside_the_main_gemm(dtype_name, act, r):
    # y = act([x | s t] [W | B]^T + bias) and dx = [dz | s U] [W ; A] each in one GEMM (r = 72:
    # two stages of the second pair); no short-K kernel writes a rank-r term.
    inputs, grad_out = layer_case(EXTK_SHAPE, r, DTYPES[dtype_name])
    (y, ours), names = gemm_kernels_run(
        lambda: grads_of(lambda *a: cutlass_ext.lora_linear(*a, scaling=SCALING, activation=act), inputs, grad_out))
    extk = [n for n in names if "ExtKMainloop" in n]
    assert len(extk) == 2 and all("Pingpong" in n for n in extk), [n[:160] for n in names]
    assert not [n for n in names if "lowk" in n], [n[:160] for n in names]
    _, peer = grads_of(lambda *a: peer_lora(*a, SCALING, act), inputs, grad_out)
    ref_y, ref = reference_grads(y, inputs, grad_out, act)
    assert_close_to_reference(y, ref_y, peer_lora(*inputs, SCALING, act), dtype_name, what="y")
    for name, o, pr, rf in zip(("dx", "dweight", "dA", "dB", "dbias"), ours, peer, ref):
        assert_close_to_reference(o, rf, pr, dtype_name, what=name)


def test_the_extended_k_tests_cover_every_extended_k_config():
    # test_every_kernel (tests/ops/test_linear.py) leaves the extended-K kernels to the two tests
    # around this one, which reach the 128x128 ping-pong config and the 128x256 cooperative one
    # through the selection rule; a new extended-K config needs its own shape and test.
    configs = {k.config.name for k in _kernel_table.all_kernels() if k.ext_k}
    assert configs == {"128x128_1x2_pp", "128x256_2x1_coop"}, configs


# rows, in, out: the forward and dx take 128x256 tiles on an H100/H200 (31 x 17 = 527 of them, 4
# rounds over 132 SMs, against 8 rounds of 128x128 tiles), over K >= 4096 with a partial last
# stage, rows not a multiple of 128.
WIDE_EXTK_SHAPE = (3900, 4104, 4104)


@requires_cuda
@pytest.mark.parametrize("act", ["none", "gelu"])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp16"])
def test_rank_r_term_inside_the_wide_tile(dtype_name, act):
    # Where the frozen layer's products take the cooperative 128x256 tile (select_kernel's rule
    # over K >= 4096), LoRA's forward and dx fold the rank-r term into that
    # tile's extended-K kernels, not into the 128x128 ones.
    built = dict(cutlass_ext.build().kernels())
    suffix = "128x256_2x1_coop"
    needed = [f"sm90_{dtype_name}_{form}_{suffix}" for form in ("kk_extk_bias_act", "kk_extk_bias_act_aux",
                                                                 "kn_extk_bias_act")]
    if not all(name in built for name in needed):
        pytest.skip("the 16-bit 128x256 extended-K kernels are not in this (selective) build")
    rows, in_f, out_f = WIDE_EXTK_SHAPE
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if not (wide_tile(rows, in_f, out_f, sms, extk=True) and wide_tile(rows, out_f, in_f, sms, extk=True)):
        pytest.skip("the frozen layer's products do not take 128x256 tiles on this GPU's SMs")
    inputs, grad_out = layer_case(WIDE_EXTK_SHAPE, 16, DTYPES[dtype_name])

    def step():
        return grads_of(lambda *a: cutlass_ext.lora_linear(*a, scaling=SCALING, activation=act), inputs, grad_out)

    (y, ours), names = gemm_kernels_run(step)
    extk = [n for n in names if "ExtKMainloop" in n]
    # The extended-K kernels are built on the ping-pong 128x128 and the cooperative 128x256 tiles.
    assert len(extk) == 2 and all("Cooperative" in n for n in extk), [n[:160] for n in names]
    _, peer = grads_of(lambda *a: peer_lora(*a, SCALING, act), inputs, grad_out)
    ref_y, ref = reference_grads(y, inputs, grad_out, act)
    assert_close_to_reference(y, ref_y, peer_lora(*inputs, SCALING, act), dtype_name, what="y")
    for name, o, pr, rf in zip(("dx", "dweight", "dA", "dB", "dbias"), ours, peer, ref):
        assert_close_to_reference(o, rf, pr, dtype_name, what=name)


@requires_cuda
@pytest.mark.parametrize("r", [4, 12])
def test_rank_r_term_unaligned_rank_runs_separately(r):
    # A rank whose rows are not 16-byte multiples cannot be read by TMA: the rank-r term runs
    # first and the main GEMM accumulates it, with the same result.
    rows, in_f, out_f = EXTK_SHAPE
    x = rand(rows, in_f, device="cuda", dtype=torch.bfloat16)
    weight, lora_A, lora_B, bias = make_params(in_f, out_f, r, "cuda", torch.bfloat16)
    y, names = gemm_kernels_run(lambda: cutlass_ext.lora_linear(x, weight, lora_A, lora_B, bias, scaling=SCALING))
    assert not [n for n in names if "ExtKMainloop" in n]
    peer = peer_lora(x, weight, lora_A, lora_B, bias, SCALING, "none")
    assert_close_to_reference(y, ref_lora(x, weight, lora_A, lora_B, bias, SCALING, "none"), peer, "bf16")
