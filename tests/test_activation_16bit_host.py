"""The GELU that the elementwise kernels and GEMM epilogues use for 16-bit results, and the SiLU and
sigmoid they use for all results (csrc/common/activation_16bit.h: a 16-bit form and a refined one
for fp32), built with the host C++ compiler, against float64 math without a GPU: GELU's error
bound over the range where the result is not negligible, its tail past the fitted range, the
others' error bounds, and infinities and NaN."""

from __future__ import annotations

import math
import subprocess

import numpy as np
import pytest

from .helpers import ROOT, compile_host_program


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    return compile_host_program(tmp_path_factory.mktemp("activation_16bit"), "activation_16bit_driver",
                                [ROOT / "tests" / "cpp" / "activation_16bit_driver.cpp"], [])


def run(driver, xs):
    text = "".join(f"{x!r}\n" for x in xs)
    out = subprocess.run([str(driver)], input=text, capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines()]
    assert len(rows) == len(xs)
    return np.array([[float(v) for v in row] for row in rows])


def cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def as_f32(values):
    return [float(np.float32(v)) for v in values]


def test_gelu_error_bound_where_it_matters(driver):
    # Every x in [-6, 6] on a fine grid plus random ones. Phi's absolute error stays below 1.5e-7
    # (the header's fit: 1.3e-7; what a bias gradient, a sum of many derivatives of both signs,
    # accumulates), the derivative's below 2.5e-7 (that plus fp32 roundings of values up to 1.13);
    # GELU's relative error stays below 1e-4 (9e-5 in the tail, where Phi is small), far below a
    # 16-bit unit.
    rng = np.random.default_rng(7)
    xs = as_f32(list(np.linspace(-6.0, 6.0, 24001)) + list(rng.uniform(-6.0, 6.0, 20000)) + [0.0, -0.0])
    got = run(driver, xs)
    ref_g = np.array([x * cdf(x) for x in xs])
    ref_d = np.array([cdf(x) + x * pdf(x) for x in xs])
    ref_t = np.array([cdf(-abs(x)) for x in xs])
    t_err = np.abs(got[:, 2] - ref_t)
    assert t_err.max() < 1.5e-7, f"normal tail error {t_err.max():.3e} at |x| = {abs(xs[int(t_err.argmax())])}"
    d_err = np.abs(got[:, 1] - ref_d)
    assert d_err.max() < 2.5e-7, f"gelu' error {d_err.max():.3e} at x = {xs[int(d_err.argmax())]}"
    g_err = np.abs(got[:, 0] - ref_g) / np.maximum(np.abs(ref_g), 1e-30)
    g_err[ref_g == 0] = np.abs(got[ref_g == 0, 0])
    assert g_err.max() < 1e-4, f"gelu relative error {g_err.max():.3e} at x = {xs[int(g_err.argmax())]}"


def test_gelu_tail_past_the_fit_decreases_to_zero(driver):
    # Past the fitted range the tail must keep falling (a polynomial may turn back up) and reach 0,
    # so that a very negative x gives a result near -0, never x times something sizeable.
    ts = as_f32(np.concatenate([np.linspace(0.0, 40.0, 8001), np.geomspace(40.0, 1e30, 400)]))
    tail = run(driver, ts)[:, 2]
    assert np.all(np.diff(tail) <= 0.0), "normal_tail is not non-increasing"
    assert tail[-1] == 0.0
    xs = as_f32(-np.geomspace(5.5, 1e30, 300))
    got = run(driver, xs)
    ref = np.array([x * cdf(x) for x in xs])
    assert np.all(np.abs(got[:, 0] - ref) <= 1e-6), "gelu far from float64 below x = -5.5"
    assert np.all(np.abs(got[:, 1]) <= 1e-5), "gelu' far from 0 below x = -5.5"


def test_gelu_large_positive_is_identity(driver):
    xs = as_f32(np.geomspace(5.5, 1e30, 300))
    got = run(driver, xs)
    assert np.all(np.abs(got[:, 0] - np.array(xs)) <= 1e-7 * np.array(xs))
    assert np.all(np.abs(got[:, 1] - 1.0) <= 1e-6)  # 1 + x phi(x): 1 + 6e-7 at x = 5.5


# The 16-bit form rounds x log2 e to fp32 (relative error 1.8e-6 at |x| = 30, 2.6e-6 at x = -87,
# far below a 16-bit unit): bound 2e-6 on [-30, 30], 4e-6 below. The fp32 form adds that rounding
# back, leaving a few fp32 roundings (up to 3.1e-7 here, where exp2 and the reciprocal are exact;
# on the GPU their approximations add ~2.5e-7, which tests/ops/test_pointwise.py bounds): 4e-7.
@pytest.mark.parametrize("form,first,bound,tail_bound", [("16-bit", 3, 2e-6, 4e-6), ("fp32", 7, 4e-7, 4e-7)])
def test_silu_and_sigmoid_error_bound(driver, form, first, bound, tail_bound):
    rng = np.random.default_rng(11)
    xs = as_f32(list(np.linspace(-30.0, 30.0, 20001)) + list(rng.uniform(-30.0, 30.0, 20000))
                + list(rng.uniform(-87.0, -30.0, 5000)))
    got = run(driver, xs)[:, first:first + 4]
    x = np.array(xs)
    sig = 1.0 / (1.0 + np.exp(-x))
    one_minus = 1.0 / (1.0 + np.exp(x))  # 1 - sig without float64's own cancellation
    checks = {
        "silu": (got[:, 0], x * sig, np.abs(x * sig)),
        "silu'": (got[:, 1], sig * (1.0 + x * one_minus), 1.0),
        "sigmoid": (got[:, 2], sig, sig),
        "sigmoid'": (got[:, 3], sig * one_minus, sig * one_minus),
    }
    bounds = np.where(np.abs(x) <= 30.0, bound, tail_bound)
    for name, (ours, ref, scale) in checks.items():
        err = np.abs(ours - ref) / np.maximum(scale, 1e-30)
        err[ref == 0] = np.abs(ours[ref == 0])
        worst = int(np.argmax(err / bounds))
        assert err[worst] < bounds[worst], f"{form} {name}: relative error {err[worst]:.3e} at x = {xs[worst]}"


def test_infinities_and_nan(driver):
    # As the fp32 formulas give them: gelu(+inf) = silu(+inf) = +inf, gelu(-inf) = silu(-inf) =
    # -inf * 0 = NaN, sigmoid(+-inf) = 1 and 0; GELU's and SiLU's derivatives at +-inf are NaN
    # (inf * 0), sigmoid's 0; NaN stays NaN. SiLU and sigmoid in both forms (columns 3-6, 7-10).
    got = run(driver, [math.inf, -math.inf, math.nan])
    assert got[0, 0] == math.inf and math.isnan(got[1, 0]) and np.isnan(got[:, 1]).all()
    for silu in (3, 7):
        assert got[0, silu] == math.inf and math.isnan(got[1, silu])
        assert np.isnan(got[:, silu + 1]).all()
        assert got[0, silu + 2] == 1.0 and got[1, silu + 2] == 0.0
        assert got[0, silu + 3] == 0.0 and got[1, silu + 3] == 0.0
    assert np.isnan(got[2]).all()
