"""The five core ops on numpy arrays (CPU): FP64 references for every dtype,
hostile shapes, in-place use, offset views, and every validation rule."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import (
    DTYPES,
    NP,
    U,
    assert_close,
    f64,
    rand,
    ref_rms_norm,
    ref_silu_and_mul,
    ref_softmax,
    sum_bound,
)

import kernscope as ks

SHAPES = [(1, 8), (3, 5, 64), (4, 4097), (7,), (2, 1), (0, 16), (2, 0, 32)]


# ---- rms_norm -----------------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_vs_fp64(rng, dt, shape):
    x = rand(rng, shape, dt)
    w = rand(rng, shape[-1:], dt)
    y = ks.rms_norm(x, w, eps=1e-5)
    assert isinstance(y, np.ndarray) and y.dtype == NP[dt] and y.shape == x.shape
    assert_close(y, ref_rms_norm(x, w, 1e-5), dt, what="rms_norm")


@pytest.mark.parametrize("dt", DTYPES)
def test_rms_norm_fp16_range_and_in_place(rng, dt):
    # fp16 values near 65504: the sum of squares is FP32 and cannot overflow.
    x = np.full((2, 256), 60000.0 if dt == "fp16" else 1e18, NP[dt])  # squares stay finite in FP32
    w = np.ones(256, NP[dt])
    ref = ref_rms_norm(x, w, 1e-6)
    y = ks.rms_norm(x, w, out=x)  # in place: out is x
    assert y is x
    assert_close(x, ref, dt, what="in place")


def test_rms_norm_default_eps_and_positional(rng):
    x = rand(rng, (3, 16), "fp32")
    w = rand(rng, (16,), "fp32")
    assert np.array_equal(ks.rms_norm(x, w), ks.rms_norm(x, w, 1e-6))
    assert_close(ks.rms_norm(x, w), ref_rms_norm(x, w, 1e-6), "fp32")


@pytest.mark.parametrize("eps", [0.0, -1.0, float("nan"), float("inf"), 1e-50, 1e39])
def test_rms_norm_bad_eps(rng, eps):
    x = rand(rng, (2, 8), "fp32")
    w = rand(rng, (8,), "fp32")
    out = np.full_like(x, 7.0)
    with pytest.raises(ValueError, match="rms_norm: eps"):
        ks.rms_norm(x, w, eps, out=out)
    assert np.all(out == 7.0)


def test_rms_norm_validation(rng):
    x = rand(rng, (4, 8), "fp32")
    w = rand(rng, (8,), "fp32")
    with pytest.raises(ValueError, match=r"rms_norm: weight must have shape \(8,\)"):
        ks.rms_norm(x, w[:7])
    with pytest.raises(TypeError, match="rms_norm: weight has dtype fp16 but x has fp32"):
        ks.rms_norm(x, w.astype(np.float16))
    with pytest.raises(TypeError, match="rms_norm: x has unsupported dtype"):
        ks.rms_norm(x.astype(np.float64), w.astype(np.float64))
    with pytest.raises(TypeError, match="rms_norm: x has dtype int32"):
        ks.rms_norm(x.astype(np.int32), w.astype(np.int32))
    with pytest.raises(ValueError, match="rms_norm: x must have a non-empty last dimension"):
        ks.rms_norm(np.zeros((4, 0), np.float32), np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="rms_norm: x must be contiguous"):
        ks.rms_norm(rand(rng, (4, 16), "fp32")[:, ::2], w)
    with pytest.raises(ValueError, match="rms_norm: x must be contiguous"):
        ks.rms_norm(np.asfortranarray(rand(rng, (8, 8), "fp32")), w)
    with pytest.raises(ValueError, match="rms_norm: out must have shape"):
        ks.rms_norm(x, w, out=np.empty((4, 9), np.float32))
    big = rand(rng, (5, 8), "fp32")
    with pytest.raises(ValueError, match="rms_norm: out partially overlaps x"):
        ks.rms_norm(big[1:], w, out=big[:4])
    with pytest.raises(ValueError, match="rms_norm: out and weight overlap"):
        ks.rms_norm(x, x[0], out=x)
    with pytest.raises(TypeError, match="rms_norm: x must be an array or tensor supporting DLPack"):
        ks.rms_norm([[1.0, 2.0]], w)


# ---- fused_add_rms_norm -----------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (3, 5, 64), (4, 4097), (0, 8)])
def test_fused_add_rms_norm_vs_fp64(rng, dt, shape):
    x = rand(rng, shape, dt)
    r = rand(rng, shape, dt)
    w = rand(rng, shape[-1:], dt)
    s = f64(x) + f64(r)
    ref_x = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + np.float64(np.float32(1e-6))) * f64(w)
    x_id, r_id = x.__array_interface__["data"][0], r.__array_interface__["data"][0]
    assert ks.fused_add_rms_norm(x, r, w) is None
    assert x.__array_interface__["data"][0] == x_id and r.__array_interface__["data"][0] == r_id
    assert_close(r, s, dt, what="residual")
    assert_close(x, ref_x, dt, what="x")


def test_fused_add_rms_norm_errors_leave_inputs(rng):
    x = rand(rng, (4, 8), "bf16")
    r = rand(rng, (4, 8), "bf16")
    w = rand(rng, (8,), "bf16")
    x0, r0 = x.copy(), r.copy()
    with pytest.raises(ValueError, match="fused_add_rms_norm: residual must have shape"):
        ks.fused_add_rms_norm(x, r[:3], w)
    with pytest.raises(ValueError, match="fused_add_rms_norm: x and residual overlap"):
        ks.fused_add_rms_norm(x, x, w)
    with pytest.raises(ValueError, match="fused_add_rms_norm: x and weight overlap"):
        ks.fused_add_rms_norm(x, r, x[0])
    with pytest.raises(TypeError, match="fused_add_rms_norm: residual has dtype fp32"):
        ks.fused_add_rms_norm(x, r.astype(np.float32), w)
    with pytest.raises(ValueError, match="eps"):
        ks.fused_add_rms_norm(x, r, w, eps=0.0)
    with pytest.raises(ValueError, match="unknown backend"):
        ks.fused_add_rms_norm(x, r, w, backend="tilelang_ascend")
    assert np.array_equal(x.view(np.uint16), x0.view(np.uint16))
    assert np.array_equal(r.view(np.uint16), r0.view(np.uint16))


def test_fused_add_rms_norm_read_only_rejected(rng):
    x = rand(rng, (2, 8), "fp32")
    r = rand(rng, (2, 8), "fp32")
    w = rand(rng, (8,), "fp32")
    x.flags.writeable = False
    r0 = r.copy()
    with pytest.raises(ValueError, match="fused_add_rms_norm: x is read-only"):
        ks.fused_add_rms_norm(x, r, w)
    assert np.array_equal(r, r0)


# ---- silu_and_mul ----------------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (3, 2 * 7), (2, 3, 2 * 64), (4, 2 * 4097), (0, 8)])
def test_silu_and_mul_vs_fp64(rng, dt, shape):
    x = rand(rng, shape, dt, scale=3.0)
    y = ks.silu_and_mul(x)
    assert y.shape == shape[:-1] + (shape[-1] // 2,) and y.dtype == NP[dt]
    assert_close(y, ref_silu_and_mul(x), dt, what="silu_and_mul")


def test_silu_and_mul_extremes():
    g = np.array([np.inf, -np.inf, 1e30, -1e30, 0.0], np.float32)
    u = np.array([2.0, 2.0, 1.0, 1.0, 5.0], np.float32)
    y = ks.silu_and_mul(np.concatenate([g, u])[None])
    assert y[0, 0] == np.inf and np.isnan(y[0, 1])  # -inf * 0 = NaN, as the formula in PyTorch
    assert y[0, 2] == np.float32(1e30) and y[0, 3] == 0.0 and y[0, 4] == 0.0


def test_silu_and_mul_validation(rng):
    with pytest.raises(ValueError, match="silu_and_mul: x's last dimension must be even"):
        ks.silu_and_mul(rand(rng, (2, 7), "fp32"))
    x = rand(rng, (2, 8), "fp32")
    with pytest.raises(ValueError, match="silu_and_mul: out must have shape"):
        ks.silu_and_mul(x, out=np.empty((2, 8), np.float32))
    with pytest.raises(ValueError, match="silu_and_mul: out and x overlap"):
        ks.silu_and_mul(x, out=x.reshape(-1)[:8].reshape(2, 4))


# ---- gemv -----------------------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n,h", [(1, 1), (33, 7), (5, 4096), (0, 16), (64, 1000)])
def test_gemv_vs_fp64(rng, dt, n, h):
    x = rand(rng, (h,), dt)
    w = rand(rng, (n, h), dt)
    y = ks.gemv(x, w)
    assert y.shape == (n,) and y.dtype == NP[dt]
    ref = f64(w) @ f64(x)
    assert_close(y, ref, dt, extra=sum_bound(np.abs(f64(w)) @ np.abs(f64(x)), h), what="gemv")


def test_gemv_shared_storage(rng):
    w = rand(rng, (4, 16), "fp32")
    y = ks.gemv(w[2], w)  # x is a row of weight: both read-only, allowed
    assert_close(y, f64(w) @ f64(w[2]), "fp32", extra=sum_bound(np.abs(f64(w)) @ np.abs(f64(w[2])), 16))


def test_gemv_validation(rng):
    x = rand(rng, (8,), "fp32")
    w = rand(rng, (3, 8), "fp32")
    with pytest.raises(ValueError, match=r"gemv: weight must have shape \(N, 8\)"):
        ks.gemv(x, w[:, :7].copy())
    with pytest.raises(ValueError, match="gemv: x must have 1 dims"):
        ks.gemv(x[None], w)
    with pytest.raises(ValueError, match="gemv: out and weight overlap"):
        ks.gemv(x, w, out=w[0, :3])


# ---- softmax -----------------------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (2, 3, 64), (4, 4097), (0, 9), (1, 65536)])
def test_softmax_vs_fp64(rng, dt, shape):
    x = rand(rng, shape, dt, scale=4.0)
    y = ks.softmax(x)
    assert y.shape == shape and y.dtype == NP[dt]
    # The denominator is an FP32 sum of H terms; outputs are < 1, so the seed's atol dominates
    # except in fp32, where the sum adds its bound relative to each output.
    ref = ref_softmax(x)
    assert_close(y, ref, dt, extra=sum_bound(ref, shape[-1]) if dt == "fp32" else 0.0, what="softmax")


def test_softmax_nonfinite_rows_and_in_place():
    x = np.array([[0.0, -np.inf, 1.0],  # -inf entry of a finite row: exactly 0
                  [np.nan, 0.0, 1.0],  # NaN row
                  [np.inf, 0.0, 1.0],  # +inf row
                  [-np.inf, -np.inf, -np.inf]], np.float32)  # all -inf
    y = ks.softmax(x)
    assert y[0, 1] == 0.0 and abs(y[0].sum() - 1.0) < 1e-6
    assert np.all(np.isnan(y[1:]))
    ks.softmax(x, out=x)  # in place
    assert np.array_equal(x, y, equal_nan=True)


# ---- layout: offset views, zero-copy -------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES)
def test_offset_views_match_copies(rng, dt):
    # arr[1:] starts one element (2 or 4 bytes) past an aligned base: any alignment is valid.
    big = rand(rng, (1 + 3 * 33,), dt)
    x = big[1:].reshape(3, 33)
    wbig = rand(rng, (34,), dt)
    w = wbig[1:]
    assert x.__array_interface__["data"][0] % 8 != 0
    got = ks.rms_norm(x, w)
    want = ks.rms_norm(x.copy(), w.copy())
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    got = ks.softmax(x)
    assert np.array_equal(got.view(np.uint8), ks.softmax(x.copy()).view(np.uint8))
    xx = rand(rng, (1 + 2 * 66,), dt)[1:].reshape(2, 66)
    assert np.array_equal(ks.silu_and_mul(xx).view(np.uint8), ks.silu_and_mul(xx.copy()).view(np.uint8))


def test_in_place_mutates_callers_view(rng):
    # fused_add_rms_norm on rows 1: of a bigger array writes exactly those rows, in the
    # caller's memory (zero-copy), and nothing around them.
    big_x = rand(rng, (5, 16), "fp32")
    big_r = rand(rng, (5, 16), "fp32")
    w = rand(rng, (16,), "fp32")
    x0, r0 = big_x.copy(), big_r.copy()
    ks.fused_add_rms_norm(big_x[1:4], big_r[1:4], w)
    assert np.array_equal(big_x[0], x0[0]) and np.array_equal(big_x[4], x0[4])
    assert np.array_equal(big_r[0], r0[0]) and np.array_equal(big_r[4], r0[4])
    assert not np.array_equal(big_x[1:4], x0[1:4])
    assert_close(big_r[1:4], f64(x0[1:4]) + f64(r0[1:4]), "fp32")


def test_out_is_returned_and_filled(rng):
    x = rand(rng, (3, 32), "fp16")
    w = rand(rng, (32,), "fp16")
    out = np.empty_like(x)
    assert ks.rms_norm(x, w, out=out) is out
    assert np.array_equal(out, ks.rms_norm(x, w))


@pytest.mark.parametrize("op", ["rms_norm", "silu_and_mul", "gemv", "softmax"])
def test_outputs_untouched_after_errors(rng, op):
    x = rand(rng, (4, 8), "fp32")
    out = np.full((4, 8), 3.0, np.float32)
    with pytest.raises((ValueError, TypeError)):
        if op == "rms_norm":
            ks.rms_norm(x, rand(rng, (8,), "fp16"), out=out)
        elif op == "silu_and_mul":
            ks.silu_and_mul(x, out=out)  # out must be (4, 4)
        elif op == "gemv":
            ks.gemv(x[0], rand(rng, (4, 7), "fp32"), out=out[0, :4])
        else:
            ks.softmax(x, out=out[:, :7])
    assert np.all(out == 3.0)
