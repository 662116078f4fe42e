"""cutlass_ext.softmax and its fused backward against float64 references, on CPU (reference
kernels) and CUDA (hand-written kernels: warp, block-per-row, long-row and split-row paths)."""

from __future__ import annotations

import pytest
import torch

import cutlass_ext

from ..conftest import HAS_CUDA, requires_cuda
from ..helpers import DTYPES, assert_close_to_reference, cuda_kernels_run

DTYPE_NAMES = ["fp16", "bf16", "fp32"]
NEG_INF = float("-inf")


def rand(*shape, device, dtype, scale=1.0):
    return torch.randn(shape, device=device, dtype=torch.float32).mul_(scale).to(dtype)


def ref_softmax(x, dim=-1, scale=1.0):
    """float64 softmax(scale * x) with this library's rule for all -inf rows (zeros, not NaN)."""
    z = x.double() * scale
    y = torch.softmax(z, dim)
    all_neg_inf = (z == NEG_INF).all(dim, keepdim=True)
    return torch.where(all_neg_inf, torch.zeros_like(y), y)


def peer_softmax(x, dim=-1, scale=1.0):
    """torch's own result in the same dtype."""
    return torch.softmax(x * scale if scale != 1.0 else x, dim)


def grads_of(fn, x, grad_out):
    x = x.detach().requires_grad_(True)
    out = fn(x)
    out.backward(grad_out)
    return out, x.grad


# name -> (builder of x given (device, dtype), cuda_only). Row lengths cross every path threshold:
# <= 1024 warp rows, <= 16384 / 32768 block rows (backward / forward; the forward's aligned rows
# only up to 8192, then shared memory), longer rows (split across blocks or a cluster when there
# are few of them); aligned rows take 16-byte accesses, the others scalar ones.
def _plain(*shape):
    return lambda d, t: rand(*shape, device=d, dtype=t)


CASES = {
    "one": (_plain(5, 1), False),
    "seven": (_plain(33, 7), False),
    "128": (_plain(300, 128), False),
    "thousand": (_plain(64, 1000), False),
    # 16-bit rows of 513-1024 columns: a block a row, one 16-byte pack a thread where the rows' warps
    # fit on the SMs at once or two packs would leave more threads idle (768 columns), else two.
    "768": (_plain(40, 768), False),
    "many_1000": (_plain(4096, 1000), False),
    "1025": (_plain(20, 1025), False),
    "4097": (_plain(9, 4097), False),
    "8192": (_plain(6, 8192), False),
    "8200": (_plain(5, 8200), False),
    "20000": (_plain(4, 20000), False),
    "20001": (_plain(3, 20001), False),
    "40000": (_plain(3, 40000), False),
    "262144": (_plain(2, 262144), True),
    "300001": (_plain(2, 300001), True),
    "many_long": (_plain(600, 33000), True),  # enough rows for one block per row
    # One block per row, the row in shared memory for 16-bit types (128 KB), not for fp32 (256 KB).
    "many_65536": (_plain(560, 65536), True),
    "rows_zero": (_plain(0, 64), False),
    "cols_zero": (_plain(4, 0), False),
    "3d": (_plain(3, 17, 96), False),
    "vector": (_plain(40), False),
    "scalar": (_plain(), False),
    # A column slice of a wider tensor: row stride 200, still 16-byte aligned.
    "noncontig": (lambda d, t: rand(48, 200, device=d, dtype=t)[:, 8:136], False),
    # A column slice starting one element in: unaligned base and odd row stride.
    "col_offset": (lambda d, t: rand(48, 201, device=d, dtype=t)[:, 1:], False),
    # Starts one element into its storage.
    "offset": (lambda d, t: rand(96 * 64 + 1, device=d, dtype=t)[1:].view(96, 64), False),
    # The last dim has stride 64: read through a copy.
    "transposed": (lambda d, t: rand(136, 64, device=d, dtype=t).t(), False),
    # Every row is the same memory (row stride 0).
    "expanded": (lambda d, t: rand(1, 300, device=d, dtype=t).expand(7, 300), False),
}


def make_case(case, device, dtype):
    build, cuda_only = CASES[case]
    if cuda_only and device != "cuda":
        pytest.skip("long rows run on CUDA only (the CPU reference has a single path)")
    return build(device, dtype)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_forward_shapes(device, dtype_name, case):
    dtype = DTYPES[dtype_name]
    x = make_case(case, device, dtype)
    out = cutlass_ext.softmax(x)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    assert_close_to_reference(out, ref_softmax(x), peer_softmax(x), dtype_name)


BACKWARD_CASES = ["seven", "thousand", "768", "many_1000", "4097", "20000", "40000", "262144", "many_long", "3d",
                  "noncontig", "col_offset", "transposed", "scalar"]


@pytest.mark.parametrize("case", BACKWARD_CASES)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_backward(device, dtype_name, case):
    dtype = DTYPES[dtype_name]
    x = make_case(case, device, dtype)
    grad_out = rand(*x.shape, device=device, dtype=dtype)
    _, ours = grads_of(cutlass_ext.softmax, x, grad_out)
    _, peer = grads_of(peer_softmax, x, grad_out)
    _, ref = grads_of(ref_softmax, x.double(), grad_out.double())
    assert ours.dtype == dtype
    assert_close_to_reference(ours, ref, peer, dtype_name, what="dx")


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_dims_of_3d_input(device, dtype_name, dim):
    dtype = DTYPES[dtype_name]
    x = rand(5, 6, 70, device=device, dtype=dtype, scale=2)
    grad_out = rand(5, 6, 70, device=device, dtype=dtype)
    out, ours = grads_of(lambda t: cutlass_ext.softmax(t, dim, scale=0.7), x, grad_out)
    peer_out, peer = grads_of(lambda t: peer_softmax(t, dim, 0.7), x, grad_out)
    ref_out, ref = grads_of(lambda t: ref_softmax(t, dim, 0.7), x.double(), grad_out.double())
    assert out.is_contiguous()
    assert_close_to_reference(out, ref_out, peer_out, dtype_name)
    assert_close_to_reference(ours, ref, peer, dtype_name, what="dx")


@pytest.mark.parametrize("cols", [7, 1000, 20000, 40000])
@pytest.mark.parametrize("scale", [0.125, -3.0, 0.0])
@pytest.mark.parametrize("dtype_name", ["fp16", "fp32"])
def test_scale(device, dtype_name, scale, cols):
    dtype = DTYPES[dtype_name]
    # 64 rows: with 3 rows of 7, the norm-wise error of either side rests on a handful of
    # roundings, and torch's own error was below half of ours in 1 of 300 seeds (fp32 dx).
    x = rand(64, cols, device=device, dtype=dtype, scale=2)
    grad_out = rand(64, cols, device=device, dtype=dtype)
    out, ours = grads_of(lambda t: cutlass_ext.softmax(t, scale=scale), x, grad_out)
    peer_out, peer = grads_of(lambda t: peer_softmax(t, -1, scale), x, grad_out)
    ref_out, ref = grads_of(lambda t: ref_softmax(t, -1, scale), x.double(), grad_out.double())
    assert_close_to_reference(out, ref_out, peer_out, dtype_name)
    if scale == 0.0:
        assert torch.allclose(out.double(), torch.full_like(ref_out, 1 / cols), rtol=1e-2)
        assert torch.count_nonzero(ours) == 0
    else:
        assert_close_to_reference(ours, ref, peer, dtype_name, what="dx")


# 600 x 33000 (CUDA): enough rows for a block each, so the 16-bit rows go through shared memory.
LONG_ROW_CASES = [7, 1000, 4097, 20000, 40000, pytest.param(33000, marks=requires_cuda)]


def rows_for(cols, few):
    return 600 if cols == 33000 else few


@pytest.mark.parametrize("cols", LONG_ROW_CASES)
@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_neg_inf_entries_and_all_neg_inf_row(device, dtype_name, cols):
    dtype = DTYPES[dtype_name]
    x = rand(rows_for(cols, 4), cols, device=device, dtype=dtype)
    x[0, torch.rand(cols, device=device) < 0.5] = NEG_INF  # an attention-style mask
    x[0, 0] = 0.5  # keep one entry
    x[1] = NEG_INF  # fully masked: zeros, not NaN
    x[3, -1] = NEG_INF
    grad_out = rand(x.shape[0], cols, device=device, dtype=dtype)
    out, ours = grads_of(cutlass_ext.softmax, x, grad_out)
    ref = ref_softmax(x)
    assert torch.isnan(torch.softmax(x.double(), -1)[1]).all(), "torch itself gives NaN for that row"
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(out[0][x[0] == NEG_INF], torch.zeros_like(out[0][x[0] == NEG_INF]))
    assert out[3, -1] == 0
    assert_close_to_reference(out, ref, peer_softmax(x).nan_to_num(0.0), dtype_name)
    assert torch.equal(ours[1], torch.zeros_like(ours[1]))
    assert torch.isfinite(ours).all()


@pytest.mark.parametrize("cols", LONG_ROW_CASES)
@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_nan_propagates(device, dtype_name, cols):
    dtype = DTYPES[dtype_name]
    x = rand(rows_for(cols, 5), cols, device=device, dtype=dtype)
    x[1, cols // 2] = float("nan")
    x[2] = NEG_INF  # NaN among -inf entries: still NaN, not the all -inf zeros
    x[2, -1] = float("nan")
    x[3, 0] = float("inf")  # inf - inf: torch gives NaN too
    out = cutlass_ext.softmax(x)
    assert torch.isnan(out[1:4]).all()
    keep = [0] + list(range(4, x.shape[0]))
    assert_close_to_reference(out[keep], ref_softmax(x[keep]), peer_softmax(x[keep]), dtype_name)


@pytest.mark.parametrize(
    "dtype_name,make",
    [
        ("fp32", lambda n, d: 1e4 + torch.randn(3, n, device=d)),  # large and close
        ("fp32", lambda n, d: 1e4 * torch.randn(3, n, device=d)),  # large and spread (near one-hot)
        ("fp32", lambda n, d: torch.full((3, n), -3e38, device=d).index_fill_(1, torch.tensor([1], device=d), 3e38)),
        # Large logits: the base-2 form's rounding offset of the row max (up to 1 near 1e7, with
        # O(1) differences; up to 32 near 3e8) and past its limit near 1e9 (the natural-base
        # form). Steps of 32 and 64 are the float32 spacing there.
        ("fp32", lambda n, d: 1e7 + torch.randint(0, 4, (3, n), device=d).float()),
        ("fp32", lambda n, d: 3e8 + 32 * torch.randint(0, 4, (3, n), device=d).float()),
        ("fp32", lambda n, d: -1e9 - 64 * torch.randint(0, 4, (3, n), device=d).float()),
        ("fp16", lambda n, d: 6e4 - 32 * torch.randint(0, 8, (3, n), device=d).float()),
        ("fp16", lambda n, d: -6e4 + torch.randn(3, n, device=d)),
        ("bf16", lambda n, d: 1e38 * torch.rand(3, n, device=d)),
    ],
)
@pytest.mark.parametrize("cols", [7, 1000, 20000, 40000])
def test_extreme_magnitudes(device, dtype_name, make, cols):
    dtype = DTYPES[dtype_name]
    x = make(cols, device).to(dtype)
    out = cutlass_ext.softmax(x)
    assert_close_to_reference(out, ref_softmax(x), peer_softmax(x).float().nan_to_num(0.0), dtype_name)
    torch.testing.assert_close(out.double().sum(-1), torch.ones(3, dtype=torch.float64, device=device),
                               rtol=0, atol=1e-2)


def test_backward_saves_output_not_input(device):
    x = rand(8, 64, device=device, dtype=torch.float32).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = cutlass_ext.softmax(x)
    assert len(saved) == 1
    assert saved[0].data_ptr() == out.data_ptr() and saved[0].data_ptr() != x.data_ptr()


@pytest.mark.parametrize("shape", [(4096, 512), (3, 300001), (600, 33000)])
def test_deterministic(device, shape):
    if device == "cpu" and shape[0] * shape[1] > 4096 * 512:
        pytest.skip("long rows run on CUDA only")
    x = rand(*shape, device=device, dtype=torch.bfloat16, scale=3)
    grad_out = rand(*shape, device=device, dtype=torch.bfloat16)
    y1, g1 = grads_of(cutlass_ext.softmax, x, grad_out)
    y2, g2 = grads_of(cutlass_ext.softmax, x, grad_out)
    assert torch.equal(y1, y2) and torch.equal(g1, g2)


@requires_cuda
@pytest.mark.parametrize("cols", [512, 4096])
def test_forward_and_backward_are_one_kernel_each(cols):
    x = rand(1024, cols, device="cuda", dtype=torch.bfloat16).requires_grad_()
    grad_out = torch.randn_like(x)
    cutlass_ext.softmax(x).backward(grad_out)  # loads the extension
    x.grad = None  # else the profiled backward accumulates into it with an extra kernel
    torch.cuda.synchronize()
    _, kernels = cuda_kernels_run(lambda: cutlass_ext.softmax(x).backward(grad_out))
    assert sum("softmax_backward" in n for n in kernels) == 1, kernels
    assert sum("softmax" in n and "backward" not in n for n in kernels) == 1, kernels
    assert len(kernels) == 2, kernels  # no copies, no separate reductions


# Rows over 8192 columns, read once through shared memory on the vector path: a row in one CTA where
# it fits (a 16-bit row up to ~113K columns on Hopper), else split over a cluster of 2-8 CTAs (64 KB
# slices where 8 suffice); few rows over as many CTAs as the split path would take. Up to 8192
# columns a block holds the row in registers.
# CUTLASS_EXT_ROW_CLUSTER=1 (or too small a cluster) leaves the rows that do not fit one CTA to two
# passes over memory, split over blocks where rows are few; the scalar path always takes those.
@requires_cuda
@pytest.mark.parametrize("dtype_name,rows,cols,clusters,path", [
    ("bf16", 600, 8192, None, "row"), ("bf16", 600, 8200, None, "shared"), ("fp32", 600, 16384, None, "shared"),
    ("bf16", 600, 33000, None, "shared"), ("fp16", 560, 65536, None, "shared"), ("fp32", 600, 40000, None, "shared"),
    ("bf16", 560, 131072, None, "cluster"), ("bf16", 560, 131072, "1", "long"),
    ("fp32", 600, 65536, None, "cluster"), ("fp32", 600, 65536, "1", "long"),
    ("bf16", 64, 65536, None, "cluster"), ("bf16", 64, 65536, "1", "split"),
    ("bf16", 2, 262144, None, "cluster"), ("bf16", 2, 262144, "2", "split"),
    ("bf16", 600, 33001, None, "long")])
def test_long_rows_take_shared_memory_where_they_fit(monkeypatch, dtype_name, rows, cols, clusters, path):
    dtype = DTYPES[dtype_name]
    x = rand(rows, cols, device="cuda", dtype=dtype)
    cutlass_ext.softmax(x)  # loads the extension
    if clusters is not None:
        monkeypatch.setenv("CUTLASS_EXT_ROW_CLUSTER", clusters)
    torch.cuda.synchronize()
    out, names = cuda_kernels_run(lambda: cutlass_ext.softmax(x, scale=0.5))
    names = [n for n in names if "softmax" in n]
    if path == "split":
        assert len(names) == 2 and "softmax_partial_stats_kernel" in names[0], names
    else:
        assert len(names) == 1 and f"softmax_{path}_kernel" in names[0], names
    assert_close_to_reference(out, ref_softmax(x, scale=0.5), peer_softmax(x, scale=0.5), dtype_name)


# The backward keeps dy and y in registers up to 16384 columns; longer rows go through shared memory
# as the forward's do (dy and y together: one block where both fit, else a cluster of blocks; few
# rows over as many blocks as the split would take), else two passes over memory.
@requires_cuda
@pytest.mark.parametrize("dtype_name,rows,cols,clusters,path", [
    ("bf16", 600, 16384, None, "row"), ("bf16", 600, 33000, None, "shared"), ("fp32", 600, 20000, None, "shared"),
    ("bf16", 600, 65536, None, "cluster"), ("bf16", 600, 65536, "1", "long"),
    ("bf16", 4, 65536, None, "cluster"), ("bf16", 4, 65536, "1", "split"),
    ("fp32", 2, 262144, None, "split"), ("bf16", 600, 33001, None, "long")])
def test_long_rows_backward_take_shared_memory_where_they_fit(monkeypatch, dtype_name, rows, cols, clusters, path):
    dtype = DTYPES[dtype_name]
    x = rand(rows, cols, device="cuda", dtype=dtype, scale=2.0)
    grad_out = rand(rows, cols, device="cuda", dtype=dtype)
    grads_of(lambda a: cutlass_ext.softmax(a, scale=0.5), x, grad_out)  # loads the extension
    if clusters is not None:
        monkeypatch.setenv("CUTLASS_EXT_ROW_CLUSTER", clusters)
    torch.cuda.synchronize()
    (_, ours), names = cuda_kernels_run(lambda: grads_of(lambda a: cutlass_ext.softmax(a, scale=0.5), x, grad_out))
    names = [n for n in names if "softmax_backward" in n]
    if path == "split":
        assert len(names) == 2 and "softmax_backward_partial_dot_kernel" in names[0], names
    else:
        assert len(names) == 1 and f"softmax_backward_{path}_kernel" in names[0], names
    xd = x.double().requires_grad_()
    ref = torch.autograd.grad(ref_softmax(xd, scale=0.5), xd, grad_out.double())[0]
    xp = x.detach().requires_grad_()
    peer = torch.autograd.grad(peer_softmax(xp, scale=0.5), xp, grad_out)[0]
    assert_close_to_reference(ours, ref, peer, dtype_name, what="dx")


# ------------------------------------------------------------------------------------------------
# torch.library.opcheck, torch.compile, CUDA graphs, streams


def test_opcheck_softmax(device):
    x = rand(2, 24, 40, device=device, dtype=torch.bfloat16).requires_grad_()
    torch.library.opcheck(torch.ops.cutlass_ext.softmax.default, (x, -1, 1.0))
    torch.library.opcheck(torch.ops.cutlass_ext.softmax.default, (x, 0, 0.5))
    xt = rand(40, 24, device=device, dtype=torch.float32).t().requires_grad_()
    torch.library.opcheck(torch.ops.cutlass_ext.softmax.default, (xt, 1, -2.0))


def test_opcheck_softmax_backward(device):
    y = torch.softmax(rand(2, 24, 40, device=device, dtype=torch.float16).float(), -1).half()
    grad = rand(2, 24, 40, device=device, dtype=torch.float16)
    torch.library.opcheck(torch.ops.cutlass_ext._softmax_backward.default, (grad, y, -1, 1.0))
    torch.library.opcheck(torch.ops.cutlass_ext._softmax_backward.default, (grad, y, 1, 0.25))


def test_compile_fullgraph(device):
    torch._dynamo.reset()
    x = rand(16, 96, device=device, dtype=torch.bfloat16).requires_grad_()
    w = rand(96, 96, device=device, dtype=torch.bfloat16)

    def step(t):
        return (cutlass_ext.softmax(t @ w, scale=0.125) * t).float().square().mean()

    compiled = torch.compile(step, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    loss = compiled(x)
    loss.backward()
    grad = x.grad.clone()
    x.grad = None
    eager_loss = step(x)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(grad, x.grad, rtol=2e-2, atol=2e-2)


@requires_cuda
@pytest.mark.parametrize("cols", [1000, 262144])
def test_cuda_graph_capture(cols):
    x = rand(4, cols, device="cuda", dtype=torch.bfloat16).requires_grad_()
    grad_out = rand(4, cols, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cutlass_ext.softmax(x).backward(grad_out)  # warm-up (builds, allocates)
    torch.cuda.current_stream().wait_stream(side)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cutlass_ext.softmax(x, scale=0.5)
        dx = torch.ops.cutlass_ext._softmax_backward(grad_out, out, -1, 0.5)
    for _ in range(2):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        expected = cutlass_ext.softmax(x.detach(), scale=0.5)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(dx, torch.ops.cutlass_ext._softmax_backward(grad_out, expected, -1, 0.5),
                                   rtol=0, atol=0)


@requires_cuda
def test_runs_on_current_stream():
    side = torch.cuda.Stream()
    x = rand(2048, 1024, device="cuda", dtype=torch.float16)
    expected = cutlass_ext.softmax(x)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x2 = x * 1  # produced on the side stream, consumed by the next launch on it
        out = cutlass_ext.softmax(x2)
    side.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Bad input: every error names the argument


@pytest.mark.parametrize(
    "call,exc,pattern",
    [
        (lambda x: cutlass_ext.softmax(x.double()), TypeError, "x has dtype torch.float64"),
        (lambda x: cutlass_ext.softmax(x.to(torch.int32)), TypeError, "x has dtype torch.int32"),
        (lambda x: cutlass_ext.softmax(x.numpy()), TypeError, "x must be a torch.Tensor"),
        (lambda x: cutlass_ext.softmax(x, 2), IndexError, "dim=2 is out of range"),
        (lambda x: cutlass_ext.softmax(x, -3), IndexError, "dim=-3 is out of range"),
        (lambda x: cutlass_ext.softmax(x, 1.0), TypeError, "dim must be an int"),
        (lambda x: cutlass_ext.softmax(x, scale=torch.tensor(2.0)), TypeError, "scale must be a Python float"),
        (lambda x: cutlass_ext.softmax(x, scale="2"), TypeError, "scale must be a Python float"),
    ],
)
def test_rejects_bad_input(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call(torch.randn(8, 16))


@requires_cuda
def test_backward_rejects_mixed_devices():
    y = cutlass_ext.softmax(torch.randn(8, 16, device="cuda"))  # also loads the extension's kernels
    with pytest.raises(RuntimeError, match="grad is on cpu"):
        torch.ops.cutlass_ext._softmax_backward(torch.randn(8, 16), y, -1, 1.0)
    with pytest.raises(RuntimeError, match="grad has shape"):
        torch.ops.cutlass_ext._softmax_backward(torch.randn(8, 15, device="cuda"), y, -1, 1.0)


def test_cpu_runs_without_extension():
    from cutlass_ext import _build

    cutlass_ext.softmax(torch.randn(4, 8))
    if not HAS_CUDA:
        assert _build._module is None
