"""The second kernels of split reductions (sum_partials after bias_act's backward, _act_grad and
sum; the rank-r pass's finish in lora_linear) launched as programmatic dependents of the kernel
that wrote their partials, lora_linear's extended-K GEMMs as dependents of that finish, and the
Hopper GEMMs that wait for the kernel before them at their start as its dependents: the same
results as launched the usual way and as a float64 reference, back to back on one stream, on two
streams at once, and replayed from CUDA graphs; a GEMM's output written over memory that the GEMM
before it still reads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import cutlass_ext
from cutlass_ext.ops import _runtime

from ..conftest import requires_cuda
from ..helpers import assert_close_to_reference, capture_cuda_graph, cuda_kernels_run

pytestmark = requires_cuda


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=torch.float32).to(dtype)


# Each case: (make inputs, run the op, float64 reference of its outputs, the second kernel's name).
# The shapes split their reductions over many blocks (4096 x 128: one column block, 128 splits).
def _bias_act_case(rows, cols, act, dtype=torch.bfloat16):
    def make():
        return rand(rows, cols, dtype=dtype), rand(rows, cols, dtype=dtype), rand(cols, dtype=dtype)

    def run(grad, x, bias):
        dx, db, _ = torch.ops.cutlass_ext._bias_act_backward(grad, x, bias, None, act, 1.5, True, True, False)
        return dx, db

    def ref(grad, x, bias):
        x64, b64 = x.double().requires_grad_(), bias.double().requires_grad_()
        z = x64 * 1.5 + b64
        {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "none": lambda t: t}[act](z).backward(grad.double())
        return x64.grad, b64.grad

    return make, run, ref, "sum_partials"


def _act_grad_case(rows, cols):
    def make():
        return rand(rows, cols), rand(rows, cols).relu()  # relu's saved output

    def run(grad, saved):
        return torch.ops.cutlass_ext._act_grad(grad, saved, "relu", True, True)

    def ref(grad, saved):
        dz = grad.double() * (saved.double() > 0)
        return dz, dz.sum(0)

    return make, run, ref, "sum_partials"


def _sum_case(shape, dim):
    def make():
        return (rand(*shape),)

    def run(x):
        return (cutlass_ext.sum(x, dim),)

    def ref(x):
        return (x.double().sum(dim),)

    return make, run, ref, "sum_partials"


def _lora_case(tokens, d_in, d_out, r, second="rank_pass_finish"):
    def make():
        return (rand(tokens, d_in), rand(d_out, d_in) / d_in**0.5, rand(r, d_in) / d_in**0.5, rand(d_out, r),
                rand(tokens, d_out))

    def run(x, w, a, b, dy):
        x, a, b = (t.detach().requires_grad_() for t in (x, a, b))
        y = cutlass_ext.lora_linear(x, w, a, b, None, scaling=2.0)
        y.backward(dy)
        return y.detach(), x.grad, a.grad, b.grad

    def ref(x, w, a, b, dy):
        x64, a64, b64 = (t.detach().double().requires_grad_() for t in (x, a, b))
        y = x64 @ w.double().T + 2.0 * (x64 @ a64.T) @ b64.T
        y.backward(dy.double())
        return y.detach(), x64.grad, a64.grad, b64.grad

    return make, run, ref, second


def _linear_chain_case(rows, width, dtype=torch.bfloat16):
    """Two fused layers and their backward: every GEMM follows a kernel that writes what it reads
    (the first layer's output, _act_grad's dZ). The layers round their outputs to ``dtype`` between
    them, which moves some of ReLU's zeros against the float64 reference: the errors are bounded by
    torch's own in the same dtype (the fifth entry)."""
    def make():
        return (rand(rows, width, dtype=dtype), rand(width, width, dtype=dtype) / width**0.5,
                rand(width, dtype=dtype), rand(width, width, dtype=dtype) / width**0.5, rand(width, dtype=dtype),
                rand(rows, width, dtype=dtype))

    def run(x, w1, b1, w2, b2, dy):
        x, w1, w2 = (t.detach().requires_grad_() for t in (x, w1, w2))
        h = cutlass_ext.linear(x, w1.t(), b1, activation="gelu")
        y = cutlass_ext.linear(h, w2.t(), b2, activation="relu")
        y.backward(dy)
        return y.detach(), x.grad, w1.grad, w2.grad

    def ref(x, w1, b1, w2, b2, dy):
        x64, w164, w264 = (t.detach().double().requires_grad_() for t in (x, w1, w2))
        h = torch.nn.functional.gelu(x64 @ w164.T + b1.double())
        y = torch.relu(h @ w264.T + b2.double())
        y.backward(dy.double())
        return y.detach(), x64.grad, w164.grad, w264.grad

    def peer(x, w1, b1, w2, b2, dy):
        x, w1, w2 = (t.detach().requires_grad_() for t in (x, w1, w2))
        h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1))
        y = torch.relu(torch.nn.functional.linear(h, w2, b2))
        y.backward(dy)
        return y.detach(), x.grad, w1.grad, w2.grad

    return make, run, ref, "GemmUniversal", peer


CASES = {
    "bias_act_relu_4096x128": _bias_act_case(4096, 128, "relu"),
    "bias_act_gelu_8192x1000": _bias_act_case(8192, 1000, "gelu"),
    "bias_act_none_fp32_2048x72": _bias_act_case(2048, 72, "none", torch.float32),
    "act_grad_relu_4096x128": _act_grad_case(4096, 128),
    "sum_rows_65536x64": _sum_case((65536, 64), 0),
    "sum_long_row_4x262144": _sum_case((4, 262144), 1),
    "lora_2048x1024x1024_r16": _lora_case(2048, 1024, 1024, 16),
    # 256 output tiles of 128x128 a GEMM: the forward and dx take the extended-K kernels, launched
    # after the rank pass's finish.
    "lora_extk_2048x2048x2048_r16": _lora_case(2048, 2048, 2048, 16, second="ExtKMainloop"),
    # 128 output tiles of 128x128 a layer (one round); the weight gradients over 2048 rows.
    "linear_chain_2048x1024": _linear_chain_case(2048, 1024),
    "linear_chain_fp16_512x4096": _linear_chain_case(512, 4096, torch.float16),
}


def _dtype_name(t):
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[t.dtype]


@pytest.mark.parametrize("case", list(CASES))
def test_both_launches_match_the_reference(case):
    make, run, ref, second, *peer = CASES[case]
    args = make()
    expected = ref(*args)
    peers = peer[0](*args) if peer else [None] * len(expected)
    results = {}
    for enabled in (True, False):
        with _runtime.dependent_launch(enabled):
            got, names = cuda_kernels_run(lambda: run(*args))
            assert any(second in n for n in names), names  # the path under test ran
            for i, (g, e, q) in enumerate(zip(got, expected, peers)):
                assert_close_to_reference(g, e, q, _dtype_name(g), what=f"{case} output {i} dependent={enabled}")
            for _ in range(3):  # back to back on one stream: each second kernel waits for its own first
                for a, b in zip(got, run(*args)):
                    assert torch.equal(a, b)
            results[enabled] = got
    for a, b in zip(results[True], results[False]):  # the same kernels either way
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["linear_chain_2048x1024", "lora_2048x1024x1024_r16"])
def test_gemm_switch_alone(case):
    """The GEMMs' own switch: with it off the other dependents stay, with the same results."""
    make, run = CASES[case][:2]
    args = make()
    expected = run(*args)
    with _runtime.gemm_dependent_launch(False):
        for a, b in zip(expected, run(*args)):
            assert torch.equal(a, b)


# Each step reads t in a GEMM and then writes a same-sized output, which the caching allocator puts
# in t's freed block, in the GEMM after it: a dependent that started writing before the GEMM before
# it had finished reading would change u. Outputs are not poisoned here (a NaN fill between the two
# GEMMs would order them), so the check runs in a process of its own.
_WAR_SCRIPT = """
import torch, cutlass_ext
from cutlass_ext.ops import _runtime
torch.manual_seed(0)
x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
w1, w2, w3 = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(3))
def step():
    t = cutlass_ext.linear(x, w1.t())
    block = t.data_ptr()
    u = cutlass_ext.linear(t, w2.t())
    del t
    v = cutlass_ext.linear(u, w3.t())
    return u, v, v.data_ptr() == block
with _runtime.dependent_launch(False):
    u0, v0, _ = step()
reused = 0
for _ in range(50):
    u, v, same = step()
    reused += same
    assert torch.equal(u, u0) and torch.equal(v, v0)
torch.cuda.synchronize()
print("reused", reused)
"""


def test_gemm_output_over_what_the_gemm_before_reads():
    env = dict(os.environ, CUTLASS_EXT_POISON_OUTPUTS="0")
    result = subprocess.run([sys.executable, "-c", _WAR_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    reused = int(result.stdout.split("reused")[-1])
    assert reused > 0, result.stdout  # the hazard was set up: v took t's block


@pytest.mark.parametrize(
    "case", ["bias_act_relu_4096x128", "lora_2048x1024x1024_r16", "lora_extk_2048x2048x2048_r16",
             "linear_chain_2048x1024"])
def test_two_streams_at_once(case):
    make, run = CASES[case][:2]
    inputs = [make(), make()]
    expected = [run(*args) for args in inputs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    got = [[], []]
    for _ in range(10):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                got[i].append(run(*inputs[i]))
    torch.cuda.synchronize()
    for i in range(2):
        for outs in got[i]:
            for g, e in zip(outs, expected[i]):
                assert torch.equal(g, e)


@pytest.mark.parametrize("case", ["bias_act_gelu_8192x1000", "sum_rows_65536x64", "lora_extk_2048x2048x2048_r16",
                                  "linear_chain_fp16_512x4096"])
def test_graph_replays(case):
    make, run = CASES[case][:2]
    args = make()
    graph, outs = capture_cuda_graph(lambda: run(*args))
    for _ in range(3):
        for t in args:
            t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
        graph.replay()
        expected = run(*args)
        torch.cuda.synchronize()
        for g, e in zip(outs, expected):
            assert torch.equal(g, e)
