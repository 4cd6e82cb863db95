"""Shared helpers for the kernscope Python tests.

References are FP64 numpy computations on the already-rounded inputs. Tolerances
are the seed's (fp16 rtol=atol=1e-3, bf16 1e-2, fp32 1e-6) plus, where an op sums
many products, a first-order FP32 bound of the documented computation (see
docs/contracts.md: 8 sqrt(K) u sum|a_k b_k| for sums in an unspecified order).
"""

from __future__ import annotations

import importlib.util
import math

import ml_dtypes
import numpy as np
import pytest

import kernscope as ks

U = 2.0 ** -24  # FP32 unit roundoff
DTYPES = ("fp16", "bf16", "fp32")
TOL = {"fp16": 1e-3, "bf16": 1e-2, "fp32": 1e-6}
NP = {"fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16), "fp32": np.dtype(np.float32)}

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def np_dtype(name: str) -> np.dtype:
    return NP[name]


def rand(rng: np.random.Generator, shape, name: str, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(NP[name])


def f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def assert_close(got, ref, name: str, extra=0.0, what: str = "") -> None:
    """|got - ref| <= tol * (1 + |ref|) + extra elementwise; NaN where ref is NaN; equal infinities."""
    g = f64(got)
    r = np.asarray(ref, dtype=np.float64)
    assert g.shape == r.shape, f"{what}: shape {g.shape} != {r.shape}"
    nan_r = np.isnan(r)
    assert np.array_equal(np.isnan(g), nan_r), f"{what}: NaN positions differ"
    inf_r = np.isinf(r)
    # fp16/bf16 outputs may overflow to inf where the FP64 value is just past the range.
    assert np.all(g[inf_r] == r[inf_r]), f"{what}: infinities differ"
    fin = ~nan_r & ~inf_r
    err = np.abs(g - r)
    lim = TOL[name] * (1.0 + np.abs(r)) + extra
    bad = fin & ~(err <= lim)
    if bad.any():
        i = np.flatnonzero(bad.reshape(-1))[0]
        raise AssertionError(
            f"{what} ({name}): {int(bad.sum())} elements out of tolerance; first at flat index {i}: "
            f"got {g.reshape(-1)[i]!r}, ref {r.reshape(-1)[i]!r}, limit {np.broadcast_to(lim, r.shape).reshape(-1)[i]!r}")


def sum_bound(abs_terms_sum, k: int) -> np.ndarray:
    """docs/contracts.md's allowance for an FP32 sum of k products in any order."""
    return 8.0 * math.sqrt(max(k, 1)) * U * np.asarray(abs_terms_sum, dtype=np.float64)


# ---- FP64 references (numpy) -------------------------------------------------------
def ref_rms_norm(x, w, eps):
    x = f64(x)
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float64(np.float32(eps)))
    return x * r * f64(w)


def ref_silu_and_mul(x):
    x = f64(x)
    d = x.shape[-1] // 2
    g, u = x[..., :d], x[..., d:]
    with np.errstate(over="ignore", invalid="ignore"):
        return g / (1.0 + np.exp(-g)) * u


def ref_softmax(x):
    x = f64(x)
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.max(x, axis=-1, keepdims=True)
        e = np.exp(x - m)
        return e / np.sum(e, axis=-1, keepdims=True)


# GGUF block formats: (elements, bytes) per block, by ks.QType value.
QGEOM = {1: (1, 4), 2: (1, 2), 3: (1, 2), 4: (32, 18), 5: (32, 20), 6: (32, 34)}
QNAMES = {1: "f32", 2: "f16", 3: "bf16", 4: "q4_0", 5: "q4_1", 6: "q8_0"}


def make_packed(rng: np.random.Generator, rows: int, cols: int, q: int) -> np.ndarray:
    """Random packed rows [rows, row_bytes] in format q (finite scales)."""
    bs, bb = QGEOM[q]
    nb = cols // bs
    if q == 1:
        return rng.standard_normal((rows, cols)).astype("<f4").view(np.uint8).reshape(rows, cols * 4)
    if q == 2:
        return rng.standard_normal((rows, cols)).astype("<f2").view(np.uint8).reshape(rows, cols * 2)
    if q == 3:
        return rng.standard_normal((rows, cols)).astype(ml_dtypes.bfloat16).view(np.uint8).reshape(rows, cols * 2)
    blocks = np.zeros((rows, nb, bb), np.uint8)
    d = (rng.standard_normal((rows, nb)) * 0.05).astype("<f2")
    blocks[..., 0:2] = d.view(np.uint8).reshape(rows, nb, 2)
    if q == 4:
        blocks[..., 2:] = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
    elif q == 5:
        m = (rng.standard_normal((rows, nb)) * 0.1).astype("<f2")
        blocks[..., 2:4] = m.view(np.uint8).reshape(rows, nb, 2)
        blocks[..., 4:] = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
    else:
        blocks[..., 2:] = rng.integers(-128, 128, (rows, nb, 32), dtype=np.int8).view(np.uint8)
    return blocks.reshape(rows, nb * bb)


def ref_dequantize(packed: np.ndarray, q: int) -> np.ndarray:
    """FP64 values of packed rows (the FP32 decode of each element is exact here,
    except Q4_1's d*q+m, which FP32 rounds once)."""
    bs, bb = QGEOM[q]
    rows, row_bytes = packed.shape
    if q == 1:
        return packed.view("<f4").astype(np.float64).reshape(rows, -1)
    if q == 2:
        return packed.view("<f2").astype(np.float64).reshape(rows, -1)
    if q == 3:
        return packed.copy().view(ml_dtypes.bfloat16).astype(np.float64).reshape(rows, -1)
    nb = row_bytes // bb
    blk = packed.reshape(rows, nb, bb)
    d = blk[..., 0:2].copy().view("<f2").astype(np.float64)  # [rows, nb, 1]
    if q == 6:
        codes = blk[..., 2:].view(np.int8).astype(np.float64)
        w = d * codes
    else:
        c = blk[..., 2:] if q == 4 else blk[..., 4:]
        codes = np.concatenate([c & 0xF, c >> 4], axis=-1).astype(np.float64)
        if q == 4:
            w = d * (codes - 8.0)
        else:
            m = blk[..., 2:4].copy().view("<f2").astype(np.float64)
            w = d * codes + m
    return w.reshape(rows, nb * bs)


# quant_matmul_a8: x quantized from docs/contracts.md#quant_matmul_a8 with float32 numpy operations
# (each one rounding, as the contract's): a = max|x| over the block, d = a / 127, codes
# rint(x * (127 / a)) (ties to even) in [-127, 127]; a block holding NaN or inf has d = NaN, one
# with d < FLT_MIN counts as zero. out is then the FP64 sum of w * d * q (w decoded exactly), with
# an allowance for the FP32 block values and their FP32 sum: (nb + 10) u sum |w_parts d q|.
def ref_a8_quantize(x):
    """(d [M, nb] float32, q [M, nb, 32] float64 integers) of x [M, K]."""
    xb = np.asarray(x).astype(np.float32).reshape(x.shape[0], -1, 32)
    finite = np.isfinite(xb)
    bad = ~finite.all(axis=-1)
    xf = np.where(finite, xb, np.float32(0))
    amax = np.abs(xf).max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d = amax / np.float32(127)
        inv = np.float32(127) / amax
    keep = ~bad & (d >= np.finfo(np.float32).tiny)
    inv = np.where(keep, inv, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xf * inv[..., None]), -127, 127).astype(np.float64)
    d = np.where(bad, np.float32(np.nan), np.where(keep, d, np.float32(0))).astype(np.float32)
    return d, q


def ref_a8_weight_abs(packed, q):
    """Per weight element |dw c| + |mw| (c as the block value uses it: Q4_0 c - 8), FP64 [N, K]:
    the size of the terms the FP32 block values are formed from."""
    rows = packed.shape[0]
    blk = packed.reshape(rows, -1, QGEOM[q][1])
    dw = np.abs(blk[..., 0:2].copy().view("<f2").astype(np.float64))
    mw = 0.0
    if q == 6:
        c = blk[..., 2:].view(np.int8).astype(np.float64)
    else:
        nib = blk[..., 2:] if q == 4 else blk[..., 4:]
        c = np.concatenate([nib & 0xF, nib >> 4], axis=-1).astype(np.float64)
        if q == 4:
            c = c - 8.0
        else:
            mw = np.abs(blk[..., 2:4].copy().view("<f2").astype(np.float64))
    return (dw * np.abs(c) + mw).reshape(rows, -1)


def ref_quant_matmul_a8(x, packed, q):
    """(FP64 reference, allowance) of quant_matmul_a8(x, packed, q)."""
    d, codes = ref_a8_quantize(x)
    xhat = (d.astype(np.float64)[..., None] * codes).reshape(x.shape)  # NaN over a bad block
    nb = x.shape[1] // 32
    with np.errstate(invalid="ignore"):
        ref = xhat @ ref_dequantize(packed, q).T
        extra = (nb + 10) * U * (np.abs(np.nan_to_num(xhat)) @ ref_a8_weight_abs(packed, q).T)
    return ref, extra


def ref_norm_input(x, residual, norm_weight, eps):
    """FP64 (s, h) of fused_add_rms_norm_quant_matmul: s = x + residual (residual when x is
    None) and h = rms_norm(s) * norm_weight, before h's rounding to the activation dtype."""
    s = f64(residual) if x is None else f64(x) + f64(residual)
    h = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + np.float64(np.float32(eps))) * f64(norm_weight)
    return s, h


def ref_rounded_matmul(h, wd, name: str, rel: float):
    """FP64 reference and allowance of out = round(h) @ wd.T, where the kernel computes h in FP32
    (within rel * |h| of the FP64 h given here) and rounds it to dtype `name` before the matmul,
    as the unfused ops store it. Returns (ref, extra): ref uses the FP64 h rounded to the dtype;
    extra allows, per element of h, the distance to any value the kernel's h may round to (zero
    for fp16/bf16 unless h lies within rel of a rounding boundary), the FP32 sum (sum_bound) and
    one FP32 ulp per decoded weight (Q4_1's d*q+m)."""
    h = np.asarray(h, dtype=np.float64)
    hr = h.astype(NP[name]).astype(np.float64)
    lo = (h - rel * np.abs(h)).astype(NP[name]).astype(np.float64)
    hi = (h + rel * np.abs(h)).astype(NP[name]).astype(np.float64)
    dh = np.maximum(np.abs(hi - hr), np.abs(lo - hr))
    absprod = np.abs(hr) @ np.abs(wd).T
    extra = dh @ np.abs(wd).T + sum_bound(absprod, h.shape[-1]) + 2 * U * absprod
    return hr @ wd.T, extra


def cpu_variants(op: str):
    """Names of the native CPU variants of op (for ks.force_variant)."""
    return [v.variant for v in ks.available() if v.op == op and v.backend == "cpu"]


def each_variant(op: str, fn):
    """(variant, fn() with op pinned to it) for every CPU variant of op that can run
    the call here (a variant without this dtype, format or CPU feature is left out)."""
    ran = 0
    for variant in cpu_variants(op):
        ks.force_variant(op, variant)
        try:
            result = fn()
        except ks.BackendUnavailableError:
            continue
        finally:
            ks.force_variant(op, None)
        ran += 1
        yield variant, result
    assert ran, f"no CPU variant of {op} ran"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
