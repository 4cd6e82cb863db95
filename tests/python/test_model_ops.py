"""The model-path ops on numpy arrays (CPU), every dtype and every CPU variant,
against FP64 references; index validation happens before any write."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import (
    DTYPES,
    NP,
    QGEOM,
    QNAMES,
    TOL,
    U,
    assert_close,
    f64,
    make_packed,
    rand,
    ref_a8_quantize,
    ref_dequantize,
    ref_norm_input,
    ref_quant_matmul_a8,
    ref_rounded_matmul,
    ref_silu_and_mul,
    each_variant,
    sum_bound,
)

import kernscope as ks

QTYPES = sorted(QGEOM)


# ---- argmax -------------------------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES)
def test_argmax(rng, dt):
    x = rand(rng, (5, 1000), dt)
    x[1, :] = 0
    x[1, 7] = 1
    x[1, 9] = 1  # tie: first index wins
    x[2, 5] = np.nan
    x[2, 9] = np.nan  # first NaN wins
    x[3, :] = -np.inf
    y = ks.argmax(x)
    assert y.dtype == np.int64 and y.shape == (5,)
    assert y[1] == 7 and y[2] == 5 and y[3] == 0
    assert y[0] == int(np.argmax(f64(x[0]))) and y[4] == int(np.argmax(f64(x[4])))
    assert ks.argmax(np.zeros((0, 3), NP[dt])).shape == (0,)
    # a 1-d x: one row, a 0-d index (as torch.argmax of a 1-d tensor)
    y1 = ks.argmax(x[4])
    assert y1.dtype == np.int64 and y1.shape == () and int(y1) == int(y[4])
    out0 = np.full((), -5, np.int64)
    assert ks.argmax(x[1], out=out0) is out0 and int(out0) == 7


@pytest.mark.parametrize("dt", DTYPES)
def test_argmax_leading_dims(rng, dt):
    # [..., V] -> [...], as torch.argmax(x, dim=-1): each row as a row of the 2-d reshape
    x = rand(rng, (2, 3, 5, 37), dt)
    x[1, 2, 4, :] = -np.inf
    x[0, 1, 3, [3, 30]] = 1e4  # a tie: the first index
    y = ks.argmax(x)
    assert y.shape == (2, 3, 5) and y.dtype == np.int64
    assert np.array_equal(y, np.argmax(f64(x), axis=-1))
    assert y[1, 2, 4] == 0 and y[0, 1, 3] == 3
    assert np.array_equal(ks.argmax(x.reshape(30, 37)), y.reshape(30))
    out = np.full((2, 3, 5), -5, np.int64)
    assert ks.argmax(x, out=out) is out and np.array_equal(out, y)
    assert ks.argmax(np.zeros((4, 0, 3), NP[dt])).shape == (4, 0)


@pytest.mark.parametrize("dt", DTYPES)
def test_linear_ops_take_leading_dims(rng, dt):
    # gemm, quant_matmul, quant_matmul_a8: x [..., K] -> out [..., N] (torch.nn.functional.linear),
    # each row with the bits of the 2-d reshape's; a 1-d x gives [N]
    K, N = 64, 5
    x = rand(rng, (2, 3, K), dt)
    b = rand(rng, (N, K), dt)
    packed = make_packed(rng, N, K, 5)  # Q4_1
    calls = [("gemm", lambda v, **kw: ks.gemm(v, b, **kw)),
             ("quant_matmul", lambda v, **kw: ks.quant_matmul(v, packed, "q4_1", **kw)),
             ("quant_matmul_a8", lambda v, **kw: ks.quant_matmul_a8(v, packed, "q4_1", **kw))]
    for name, f in calls:
        y = f(x)
        assert y.shape == (2, 3, N) and y.dtype == NP[dt], name
        flat = f(x.reshape(6, K))
        assert np.array_equal(y.reshape(6, N).view(np.uint8), flat.view(np.uint8)), name
        one = f(x[1, 2])
        assert one.shape == (N,) and np.array_equal(one.view(np.uint8), flat[5].view(np.uint8)), name
        out = np.full((2, 3, N), 7, NP[dt])
        assert f(x, out=out) is out and np.array_equal(out.view(np.uint8), y.view(np.uint8)), name
        with pytest.raises(ValueError, match=f"{name}: out must have shape"):
            f(x, out=np.zeros((6, N), NP[dt]))
        assert f(np.zeros((4, 0, K), NP[dt])).shape == (4, 0, N), name
        # a broadcast x whose leading dims describe 10^10 rows: the layout error naming x (a
        # MemoryError before, from sizing out first)
        huge = np.broadcast_to(x[0, 0], (10**5, 10**5, K))
        arg = "a" if name == "gemm" else "x"
        with pytest.raises(ValueError, match=f"{name}: {arg} must be contiguous .*a stride of 0 is a broadcast"):
            f(huge)
    # a flattened weight (its first dim the byte count): its dims named, not a 72 GiB out
    with pytest.raises(ValueError, match=r"quant_matmul: weight must have 2 dims; got shape \(9437184,\)"):
        ks.quant_matmul(np.zeros((2048, 4096), NP[dt]), np.zeros(9437184, np.uint8), "q4_0")
    with pytest.raises(ValueError, match=r"gemm: b must have 2 dims"):
        ks.gemm(np.zeros((2048, 4096), NP[dt]), np.zeros(40960, NP[dt]))


@pytest.mark.parametrize("dt", DTYPES)
def test_fused_quant_forms_take_leading_dims(rng, dt):
    # fused_add_rms_norm_quant_matmul (residual / x / residual_out [..., K]) and
    # silu_and_mul_quant_matmul (gate_up [..., 2K]) give out [..., N] with the bits of the 2-d
    # reshape's; a 1-d row gives [N]; out of the reshape's shape is refused; zero rows are empty
    K, N = 64, 5
    packed = make_packed(rng, N, K, 6)  # Q8_0
    nw = rand(rng, (K,), dt)
    res, x, gu = rand(rng, (2, 3, K), dt), rand(rng, (2, 3, K), dt), rand(rng, (3, 2, 2 * K), dt)
    y, ro = ks.fused_add_rms_norm_quant_matmul(x, res, nw, packed, "q8_0")
    yf, rof = ks.fused_add_rms_norm_quant_matmul(x.reshape(6, K), res.reshape(6, K), nw, packed, "q8_0")
    assert y.shape == (2, 3, N) and ro.shape == (2, 3, K)
    assert np.array_equal(y.reshape(6, N).view(np.uint8), yf.view(np.uint8))
    assert np.array_equal(ro.reshape(6, K).view(np.uint8), rof.view(np.uint8))
    y0 = ks.fused_add_rms_norm_quant_matmul(None, res, nw, packed, "q8_0")
    y0f = ks.fused_add_rms_norm_quant_matmul(None, res.reshape(6, K), nw, packed, "q8_0")
    assert y0.shape == (2, 3, N) and np.array_equal(y0.reshape(6, N).view(np.uint8), y0f.view(np.uint8))
    one = ks.fused_add_rms_norm_quant_matmul(None, res[1, 2], nw, packed, "q8_0")
    assert one.shape == (N,) and np.array_equal(one.view(np.uint8), y0f[5].view(np.uint8))
    s = ks.silu_and_mul_quant_matmul(gu, packed, "q8_0")
    sf = ks.silu_and_mul_quant_matmul(gu.reshape(6, 2 * K), packed, "q8_0")
    assert s.shape == (3, 2, N) and np.array_equal(s.reshape(6, N).view(np.uint8), sf.view(np.uint8))
    s1 = ks.silu_and_mul_quant_matmul(gu[2, 1], packed, "q8_0")
    assert s1.shape == (N,) and np.array_equal(s1.view(np.uint8), sf[5].view(np.uint8))
    with pytest.raises(ValueError, match="fused_add_rms_norm_quant_matmul: out must have shape"):
        ks.fused_add_rms_norm_quant_matmul(None, res, nw, packed, "q8_0", out=np.zeros((6, N), NP[dt]))
    with pytest.raises(ValueError, match="silu_and_mul_quant_matmul: out must have shape"):
        ks.silu_and_mul_quant_matmul(gu, packed, "q8_0", out=np.zeros((6, N), NP[dt]))
    assert ks.silu_and_mul_quant_matmul(np.zeros((4, 0, 2 * K), NP[dt]), packed, "q8_0").shape == (4, 0, N)
    z = np.zeros((0, 3, K), NP[dt])
    yz, roz = ks.fused_add_rms_norm_quant_matmul(z, z, nw, packed, "q8_0")
    assert yz.shape == (0, 3, N) and roz.shape == (0, 3, K)


def test_broadcast_inputs_get_the_layout_error_before_out_is_sized():
    """A broadcast (stride-0) input whose shape describes ~10^12 elements: every op that sizes its
    output from that input names it in the layout error, instead of failing to allocate the output
    first (numpy's MemoryError, torch's allocator error)."""
    def big(*shape, dt=np.float32):  # (rows of one row's memory; a 1-D one of one element's)
        return np.broadcast_to(np.ones(shape[-1] if len(shape) > 1 else 1, dt), shape)
    one = np.ones((1, 2, 8), np.float32)
    cases = [
        ("rms_norm", "x", lambda: ks.rms_norm(big(2**40, 4), np.ones(4, np.float32))),
        ("silu_and_mul", "x", lambda: ks.silu_and_mul(big(2**40, 4))),
        ("gemv", "x", lambda: ks.gemv(np.broadcast_to(np.ones(1, np.float32), (4,)), np.ones((3, 4), np.float32))),
        ("softmax", "x", lambda: ks.softmax(big(2**40, 4))),
        ("argmax", "x", lambda: ks.argmax(big(2**40, 4))),
        ("sample", "logits", lambda: ks.sample(big(2**40, 4), np.zeros(2, np.uint64))),
        ("embedding", "ids", lambda: ks.embedding(big(2**40, dt=np.int32), np.ones((3, 4), np.float32))),
        ("dequantize", "packed", lambda: ks.dequantize(big(2**40, 20, dt=np.uint8), "q4_1")),
        ("varlen_attention", "q", lambda: ks.varlen_attention(big(2**40, 2, 8), one, one, np.array([0, 1], np.int32),
                                                             np.array([0, 1], np.int32))),
        ("paged_attention", "q", lambda: ks.paged_attention(big(2**40, 2, 8), np.ones((1, 4, 2, 8), np.float32),
                                                           np.ones((1, 4, 2, 8), np.float32), np.zeros((1, 1), np.int32),
                                                           np.zeros(1, np.int32))),
    ]
    for name, arg, call in cases:
        with pytest.raises(ValueError, match=f"{name}: {arg} must be contiguous .*a stride of 0 is a broadcast"):
            call()


def test_argmax_validation(rng):
    with pytest.raises(ValueError, match="argmax: x must have at least 1 dims"):
        ks.argmax(np.array(1.0, np.float32))
    with pytest.raises(ValueError, match="argmax: out must have shape"):
        ks.argmax(rand(rng, (2, 3, 4), "fp32"), out=np.zeros(6, np.int64))  # the reshape is not the shape
    with pytest.raises(ValueError, match="argmax: out must have shape"):
        ks.argmax(rand(rng, (9,), "fp32"), out=np.zeros(1, np.int64))
    with pytest.raises(TypeError, match="argmax: out has dtype int32"):
        ks.argmax(rand(rng, (2, 3), "fp32"), out=np.zeros(2, np.int32))


# ---- dequantize / embedding ------------------------------------------------------------
@pytest.mark.parametrize("q", QTYPES)
@pytest.mark.parametrize("dt", DTYPES)
def test_dequantize(rng, q, dt):
    packed = make_packed(rng, 5, 64, q)
    y = ks.dequantize(packed, QNAMES[q], dtype=dt)
    assert y.shape == (5, 64) and y.dtype == NP[dt]
    # Q4_1's d*q+m is one FP32 expression (rounded once, or fused): 1 FP32 ulp more.
    ref = ref_dequantize(packed, q)
    assert_close(y, ref, dt, extra=2 * U * np.abs(ref), what=f"dequantize {QNAMES[q]}")
    # QType enum and ints are accepted too; same bits.
    assert np.array_equal(ks.dequantize(packed, ks.QType(q), dtype=dt).view(np.uint8), y.view(np.uint8))


def test_dequantize_validation(rng):
    packed = make_packed(rng, 2, 64, 4)
    with pytest.raises(ValueError, match="dequantize: unknown qtype 'q5_k'"):
        ks.dequantize(packed, "q5_k")
    with pytest.raises(ValueError, match="dequantize: unknown qtype 'none'"):
        ks.dequantize(packed, "none")
    with pytest.raises(ValueError, match="dequantize: packed has 35 bytes per row; Q4_0 rows are whole 18-byte blocks"):
        ks.dequantize(packed[:, :35].copy(), "q4_0")  # not whole blocks
    with pytest.raises(TypeError, match="dequantize: packed has (unsupported )?dtype"):
        ks.dequantize(packed.view(np.int8), "q4_0")
    with pytest.raises(TypeError, match="dtype"):
        ks.dequantize(packed, "q4_0", dtype="int8")
    # a bad packed is named as itself, not as the output sized from it
    with pytest.raises(ValueError, match=r"dequantize: packed must be 2-D; got shape \(1, 2, 36\)"):
        ks.dequantize(packed.reshape(1, 2, 36), "q4_0")
    with pytest.raises(ValueError, match="dequantize: packed has 0 bytes per row"):
        ks.dequantize(np.zeros((4, 0), np.uint8), "q8_0")
    for kw in ({}, {"out": np.zeros((2, 32), np.float32)}):  # not uint8: the native message, out or not
        with pytest.raises(ks.UnsupportedDtypeError, match="dequantize: packed has dtype fp32; expected one of: uint8"):
            ks.dequantize(np.zeros((2, 8), np.float32), "q8_0", **kw)


def test_embedding_names_a_bad_table(rng):
    ids = np.array([0, 1], np.int64)
    with pytest.raises(ValueError, match="embedding: table has 33 bytes per row; Q8_0 rows are whole 34-byte"):
        ks.embedding(ids, np.zeros((4, 33), np.uint8), table_format="q8_0")
    with pytest.raises(ValueError, match="embedding: table must have a non-empty last dimension"):
        ks.embedding(ids, np.zeros((4, 0), np.float32))
    with pytest.raises(ValueError, match=r"embedding: table must be 2-D; got shape \(4,\)"):
        ks.embedding(ids, np.zeros(4, np.float32))
    # a packed table that is not uint8: the same error with out given (native) and without
    # (Python sizes out first), naming table's dtype, not its elements as bytes
    for kw in ({}, {"out": np.zeros((2, 32), np.float32)}):
        with pytest.raises(ks.UnsupportedDtypeError, match="embedding: table has dtype fp32; expected one of: uint8"):
            ks.embedding(ids, np.zeros((4, 8), np.float32), table_format="q8_0", **kw)
    # 16-dimensional ids: named themselves, not the 17-dimensional out sized from them
    with pytest.raises(ValueError, match="embedding: ids must have at most 15 dimensions .out adds one.; got 16"):
        ks.embedding(np.zeros((1,) * 16, np.int64), np.zeros((3, 4), np.float32))
    y = ks.embedding(np.zeros((1,) * 15, np.int64), np.ones((3, 4), np.float32))
    assert y.shape == (1,) * 15 + (4,) and np.all(y == 1.0)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_embedding_dense(rng, dt, id_dtype):
    table = rand(rng, (50, 24), dt)
    ids = rng.integers(0, 50, (2, 3)).astype(id_dtype)
    y = ks.embedding(ids, table)
    assert y.shape == (2, 3, 24) and y.dtype == NP[dt]
    assert np.array_equal(y.view(np.uint8), table[ids].view(np.uint8))  # bit-exact copies


@pytest.mark.parametrize("q", QTYPES)
@pytest.mark.parametrize("dt", DTYPES)
def test_embedding_packed(rng, q, dt):
    table = make_packed(rng, 40, 64, q)
    ids = np.array([3, 0, 39, 3], np.int64)
    y = ks.embedding(ids, table, table_format=QNAMES[q], dtype=dt)
    assert y.shape == (4, 64) and y.dtype == NP[dt]
    ref = ref_dequantize(table, q)[ids]
    assert_close(y, ref, dt, extra=2 * U * np.abs(ref), what=f"embedding {QNAMES[q]}")


def test_embedding_bad_ids_write_nothing(rng):
    table = rand(rng, (10, 8), "fp32")
    out = np.full((3, 8), 5.0, np.float32)
    for bad in (10, -1):
        ids = np.array([1, bad, 2], np.int32)
        with pytest.raises(ValueError, match=rf"embedding: ids\[1\] = {bad} is outside \[0, 10\)"):
            ks.embedding(ids, table, out=out)
        assert np.all(out == 5.0)
    with pytest.raises(TypeError, match="embedding: ids has dtype"):
        ks.embedding(np.array([1.0], np.float32), table)
    with pytest.raises(TypeError, match="embedding: table has dtype fp16 but out has fp32"):
        ks.embedding(np.array([1]), table.astype(np.float16), out=np.empty((1, 8), np.float32))


# ---- gemm / quant_matmul ------------------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (3, 5, 7), (16, 33, 64), (0, 4, 8), (4, 0, 8)])
def test_gemm(rng, dt, m, n, k):
    a = rand(rng, (m, k), dt)
    b = rand(rng, (n, k), dt)
    y = ks.gemm(a, b)
    assert y.shape == (m, n) and y.dtype == NP[dt]
    assert_close(y, f64(a) @ f64(b).T, dt, extra=sum_bound(np.abs(f64(a)) @ np.abs(f64(b)).T, k), what="gemm")


def test_gemm_validation(rng):
    a = rand(rng, (2, 8), "fp32")
    with pytest.raises(ValueError, match=r"gemm: b must have shape \(N, 8\)"):
        ks.gemm(a, rand(rng, (3, 7), "fp32"))
    with pytest.raises(ValueError, match="gemm: out and a overlap"):
        ks.gemm(a, rand(rng, (4, 8), "fp32"), out=a.reshape(-1)[:8].reshape(2, 4))


@pytest.mark.parametrize("q", QTYPES)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m", [1, 5])
def test_quant_matmul_every_variant(rng, q, dt, m):
    k, n = 128, 9
    x = rand(rng, (m, k), dt)
    w = make_packed(rng, n, k, q)
    wd = ref_dequantize(w, q)
    ref = f64(x) @ wd.T
    extra = sum_bound(np.abs(f64(x)) @ np.abs(wd).T, k) + 2 * U * (np.abs(f64(x)) @ np.abs(wd).T)
    for variant, y in each_variant("quant_matmul", lambda: ks.quant_matmul(x, w, QNAMES[q])):
        assert y.shape == (m, n) and y.dtype == NP[dt]
        assert_close(y, ref, dt, extra=extra, what=f"quant_matmul {variant} {QNAMES[q]}")


def test_quant_matmul_validation(rng):
    x = rand(rng, (2, 48), "fp32")
    with pytest.raises(ValueError, match=r"quant_matmul: x's K \(columns\) = 48 is not a multiple"):
        ks.quant_matmul(x, make_packed(rng, 3, 64, 4)[:, :54], "q4_0")
    with pytest.raises(ValueError, match="quant_matmul: unknown qtype"):
        ks.quant_matmul(x, make_packed(rng, 3, 64, 4), 42)


# ---- quant_matmul_a8 (W4A8 / W8A8) ----------------------------------------------------------
# References: conftest.ref_quant_matmul_a8 (x quantized from the contract's text in float32 numpy,
# then the FP64 sum of w * d * q).
A8_QTYPES = (4, 5, 6)


@pytest.mark.parametrize("q", A8_QTYPES)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m", [1, 5])
def test_quant_matmul_a8_every_variant(rng, q, dt, m):
    k, n = 128, 9
    x = rand(rng, (m, k), dt)
    x[:, 32:64] *= 100  # blocks of different scales
    w = make_packed(rng, n, k, q)
    ref, extra = ref_quant_matmul_a8(x, w, q)
    for variant, y in each_variant("quant_matmul_a8", lambda: ks.quant_matmul_a8(x, w, QNAMES[q])):
        assert y.shape == (m, n) and y.dtype == NP[dt]
        assert_close(y, ref, dt, extra=extra, what=f"quant_matmul_a8 {variant} {QNAMES[q]}")
    y = ks.quant_matmul_a8(x, w, ks.QType(q))
    # a fixed order: each row is its one-row call bit for bit
    for i in range(m):
        assert np.array_equal(ks.quant_matmul_a8(x[i:i + 1], w, QNAMES[q]).view(np.uint8), y[i:i + 1].view(np.uint8))
    # against quant_matmul: x moves by at most half a code step (d / 2) per element
    d, _ = ref_a8_quantize(x)
    wd = ref_dequantize(w, q)
    step = np.repeat(d.astype(np.float64) / 2, 32, axis=1) * (1 + 2.0 ** -20)
    absprod = np.abs(f64(x)) @ np.abs(wd).T
    allow = step @ np.abs(wd).T + extra + sum_bound(absprod, k) + 2 * U * absprod
    assert_close(y, ks.quant_matmul(x, w, QNAMES[q]), dt, extra=allow, what="quant_matmul_a8 vs quant_matmul")


@pytest.mark.parametrize("q", A8_QTYPES)
@pytest.mark.parametrize("dt", DTYPES)
def test_quant_matmul_a8_special_blocks(rng, q, dt):
    k, n = 96, 7
    x = rand(rng, (6, k), dt)
    x[1, 40] = np.nan  # a NaN in block 1: every output of row 1 is NaN
    x[2, 70] = -np.inf  # an infinity in block 2: row 2 NaN
    x[3, :32] = 0  # an all-zero block and a tiny one (max < 1.5e-36) count as zero
    x[3, 32:64] = (rng.standard_normal(32) * 1e-37).astype(NP[dt])
    x[4, :32] = [127, 0.5, 1.5, 2.5, -2.5, 3.5, -0.5, 4.5] + [1.0] * 24  # d = 1: ties go to even codes
    x[5, :] = 0  # every block zero: exact zeros
    w = make_packed(rng, n, k, q)
    ref, extra = ref_quant_matmul_a8(x, w, q)
    y = ks.quant_matmul_a8(x, w, QNAMES[q])
    assert np.isnan(f64(y[1:3])).all() and np.isfinite(f64(y[[0, 3, 4, 5]])).all()
    assert np.all(f64(y[5]) == 0)
    assert_close(y, ref, dt, extra=extra, what=f"quant_matmul_a8 {QNAMES[q]} special blocks")
    # row 3 is its last block's alone
    last = ks.quant_matmul_a8(np.ascontiguousarray(x[3:4, 64:]), np.ascontiguousarray(
        w.reshape(n, 3, -1)[:, 2:].reshape(n, -1)), QNAMES[q])
    assert np.array_equal(f64(y[3:4]), f64(last))
    # ties away from zero would give codes 1, 2, 3, -3, 4, -1: another result
    away = x[4:5].astype(np.float64)
    away[0, :8] = [127, 1, 2, 3, -3, 4, -1, 5]
    assert np.abs(f64(y[4]) - f64(away) @ ref_dequantize(w, q).T).max() > 10 * (TOL[dt] + extra[4].max())


def test_quant_matmul_a8_validation(rng):
    op = "quant_matmul_a8"
    x = rand(rng, (2, 64), "fp32")
    out = np.full((2, 3), 7.0, np.float32)
    # a dense weight format: InvalidArgumentError naming qtype, nothing written
    for name, q in (("f16", 2), ("f32", 1), ("bf16", 3)):
        with pytest.raises(ks.InvalidArgumentError,
                           match=rf"{op}: qtype must be an integer block format \(Q4_0, Q4_1 or Q8_0\); got "
                                 rf"{name.upper()} \(a dense format: quant_matmul takes it\)"):
            ks.quant_matmul_a8(x, make_packed(rng, 3, 64, q), name, out=out)
        assert np.all(out == 7.0)
    with pytest.raises(ValueError, match=rf"{op}: qtype"):
        ks.quant_matmul_a8(x, make_packed(rng, 3, 64, 2), ks.QType.F16)
    # an unknown name lists the block formats only (the dense ones are refused above)
    with pytest.raises(ValueError, match=rf"{op}: unknown qtype 42; expected one of 'q4_0', 'q4_1', 'q8_0'$"):
        ks.quant_matmul_a8(x, make_packed(rng, 3, 64, 4), 42)
    with pytest.raises(ValueError, match=r"quant_matmul: unknown qtype 42; expected one of 'f32', 'f16', 'bf16', 'q4_0'"):
        ks.quant_matmul(x, make_packed(rng, 3, 64, 4), 42)
    with pytest.raises(ValueError, match=rf"{op}: x's K \(columns\) = 48 is not a multiple"):
        ks.quant_matmul_a8(x[:, :48].copy(), make_packed(rng, 3, 64, 4)[:, :54], "q4_0")
    # (where K came from is named: a wrong x reads as a wrong weight otherwise)
    with pytest.raises(ValueError, match=rf"{op}: weight must have 36 bytes per row for 64 Q4_0 columns, from x's K \(columns\); got shape \(3, 72\)"):
        ks.quant_matmul_a8(x, make_packed(rng, 3, 128, 4), "q4_0")
    with pytest.raises(TypeError, match=rf"{op}: weight has (unsupported )?dtype int8"):
        ks.quant_matmul_a8(x, make_packed(rng, 3, 64, 6).view(np.int8), "q8_0")
    with pytest.raises(ValueError, match=rf"{op}: out and x overlap"):
        ks.quant_matmul_a8(x, make_packed(rng, 3, 64, 6), "q8_0", out=x.reshape(-1)[:6].reshape(2, 3))
    assert np.all(out == 7.0)
    # M = 0 or N = 0: no-ops that still validate
    assert ks.quant_matmul_a8(np.zeros((0, 64), np.float32), make_packed(rng, 3, 64, 5), "q4_1").shape == (0, 3)
    assert ks.quant_matmul_a8(x, make_packed(rng, 0, 64, 5), "q4_1").shape == (2, 0)


# ---- fused_add_rms_norm_quant_matmul / silu_and_mul_quant_matmul -----------------------------
# References: FP64 numpy on the rounded inputs, with the weight decoded from its blocks in numpy
# (ref_dequantize) and the normalised / gated activations h rounded to the activation dtype, as
# the contract (kernscope.h: "equals fused_add_rms_norm / rms_norm / silu_and_mul followed by
# quant_matmul") stores them between the unfused ops.
def _norm_rel(k: int) -> float:
    # FP32 h of the norm: the sum of squares (any order), rsqrt, two products (and, for fp32
    # inputs, the rounding of s); relative to |h|.
    return (8 * math.sqrt(k) + 16) * U


SILU_REL = 16 * U  # FP32 g * sigmoid(g) * u: exp, the division, two products


@pytest.mark.parametrize("q", QTYPES)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("with_x", [True, False])
def test_fused_add_rms_norm_quant_matmul_every_variant(rng, q, dt, m, with_x):
    k, n, eps = 128, 9, 1e-5
    x = rand(rng, (m, k), dt) if with_x else None
    r = rand(rng, (m, k), dt)
    nw = rand(rng, (k,), dt)
    w = make_packed(rng, n, k, q)
    x0, r0 = (None if x is None else x.copy()), r.copy()
    s, h = ref_norm_input(x, r, nw, eps)
    ref, extra = ref_rounded_matmul(h, ref_dequantize(w, q), dt, _norm_rel(k))

    def call():
        out = np.full((m, n), np.nan, NP[dt])  # poisoned: every element must be written
        res = np.full((m, k), np.nan, NP[dt]) if with_x else None
        got = ks.fused_add_rms_norm_quant_matmul(x, r, nw, w, QNAMES[q], eps, out=out, residual_out=res)
        if with_x:
            assert isinstance(got, tuple) and got[0] is out and got[1] is res
        else:
            assert got is out
        return out, res

    for variant, (out, res) in each_variant("fused_add_rms_norm_quant_matmul", call):
        assert_close(out, ref, dt, extra=extra, what=f"fused_add_rms_norm_quant_matmul {variant} {QNAMES[q]}")
        if with_x:
            assert_close(res, s, dt, what=f"residual_out {variant}")
    # the inputs are read only
    assert np.array_equal(r.view(np.uint8), r0.view(np.uint8))
    if with_x:
        assert np.array_equal(x.view(np.uint8), x0.view(np.uint8))
    # allocated outputs: residual's framework, dtype and the (M, N) / (M, K) shapes
    got = ks.fused_add_rms_norm_quant_matmul(x, r, nw, w, ks.QType(q), eps=eps)
    out = got[0] if with_x else got
    assert isinstance(out, np.ndarray) and out.shape == (m, n) and out.dtype == NP[dt]
    assert_close(out, ref, dt, extra=extra, what="allocated out")
    if with_x:
        assert got[1].shape == (m, k) and got[1].dtype == NP[dt]
        assert_close(got[1], s, dt, what="allocated residual_out")


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("with_x", [True, False])
def test_fused_add_rms_norm_quant_matmul_equals_the_unfused_ops(rng, dt, with_x):
    # residual_out holds exactly fused_add_rms_norm's residual; out is quant_matmul of the
    # normalised rows, within the FP32 sum order of the two matmuls and the norm's sum of squares
    k, n, m, q = 256, 17, 3, 5  # Q4_1
    x = rand(rng, (m, k), dt) if with_x else None
    r, nw, w = rand(rng, (m, k), dt), rand(rng, (k,), dt), make_packed(rng, n, k, q)
    got = ks.fused_add_rms_norm_quant_matmul(x, r, nw, w, "q4_1")
    if with_x:
        out, res = got
        hx, hr = x.copy(), r.copy()
        ks.fused_add_rms_norm(hx, hr, nw)
        assert np.array_equal(res.view(np.uint8), hr.view(np.uint8))
    else:
        out, hx = got, ks.rms_norm(r, nw)
    _, h = ref_norm_input(x, r, nw, 1e-6)
    _, extra = ref_rounded_matmul(h, ref_dequantize(w, q), dt, _norm_rel(k))
    assert_close(out, ks.quant_matmul(hx, w, "q4_1"), dt, extra=2 * extra, what="fused vs unfused")


@pytest.mark.parametrize("q", QTYPES)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m", [1, 5])
def test_silu_and_mul_quant_matmul_every_variant(rng, q, dt, m):
    k, n = 128, 9
    gu = rand(rng, (m, 2 * k), dt)
    gu0 = gu.copy()
    w = make_packed(rng, n, k, q)
    ref, extra = ref_rounded_matmul(ref_silu_and_mul(gu), ref_dequantize(w, q), dt, SILU_REL)

    def call():
        out = np.full((m, n), np.nan, NP[dt])  # poisoned
        assert ks.silu_and_mul_quant_matmul(gu, w, QNAMES[q], out=out) is out
        return out

    for variant, out in each_variant("silu_and_mul_quant_matmul", call):
        assert_close(out, ref, dt, extra=extra, what=f"silu_and_mul_quant_matmul {variant} {QNAMES[q]}")
    assert np.array_equal(gu.view(np.uint8), gu0.view(np.uint8))
    y = ks.silu_and_mul_quant_matmul(gu, w, ks.QType(q))
    assert isinstance(y, np.ndarray) and y.shape == (m, n) and y.dtype == NP[dt]
    assert_close(y, ref, dt, extra=extra, what="allocated out")
    # the unfused pair: silu_and_mul's rounded values, then quant_matmul
    assert_close(y, ks.quant_matmul(ks.silu_and_mul(gu), w, QNAMES[q]), dt, extra=2 * extra, what="fused vs unfused")


def test_quant_matmul_fusions_zero_rows_and_columns(rng):
    # M = 0 or N = 0: a no-op that still validates its arguments
    nw, w = rand(rng, (64,), "fp32"), make_packed(rng, 3, 64, 6)
    out, res = ks.fused_add_rms_norm_quant_matmul(np.zeros((0, 64), np.float32), np.zeros((0, 64), np.float32), nw,
                                                  w, "q8_0")
    assert out.shape == (0, 3) and res.shape == (0, 64)
    assert ks.fused_add_rms_norm_quant_matmul(None, rand(rng, (2, 64), "fp32"), nw, w[:0], "q8_0").shape == (2, 0)
    # N = 0 with x: out is empty, but residual_out = x + residual is still written
    x, r = rand(rng, (2, 64), "fp32"), rand(rng, (2, 64), "fp32")
    out, res = ks.fused_add_rms_norm_quant_matmul(x, r, nw, w[:0], "q8_0",
                                                  residual_out=np.full((2, 64), np.nan, np.float32))
    assert out.shape == (2, 0)
    assert_close(res, f64(x) + f64(r), "fp32", what="residual_out with N = 0")
    assert ks.silu_and_mul_quant_matmul(np.zeros((0, 128), np.float32), w, "q8_0").shape == (0, 3)
    with pytest.raises(ValueError, match="fused_add_rms_norm_quant_matmul: .*norm_weight"):
        ks.fused_add_rms_norm_quant_matmul(None, np.zeros((0, 64), np.float32), nw[:63], w, "q8_0")


def test_fused_add_rms_norm_quant_matmul_validation_writes_nothing(rng):
    op = "fused_add_rms_norm_quant_matmul"
    m, k, n = 2, 64, 3
    x, r, nw = rand(rng, (m, k), "fp32"), rand(rng, (m, k), "fp32"), rand(rng, (k,), "fp32")
    w = make_packed(rng, n, k, 6)
    x0, r0 = x.copy(), r.copy()
    out = np.full((m, n), 7.0, np.float32)
    res = np.full((m, k), 7.0, np.float32)

    def bad(exc, pattern, **kw):
        args = dict(x=x, residual=r, norm_weight=nw, weight=w, qtype="q8_0", eps=1e-6, out=out, residual_out=res)
        args.update(kw)
        with pytest.raises(exc, match=pattern):
            ks.fused_add_rms_norm_quant_matmul(**args)
        assert np.all(out == 7.0) and np.all(res == 7.0), "an output was written after an error"
        assert np.array_equal(x, x0) and np.array_equal(r, r0)

    bad(ValueError, rf"{op}: residual_out is given but x is missing", x=None)
    bad(ValueError, rf"{op}: x must have shape", x=rand(rng, (m + 1, k), "fp32"))
    bad(ValueError, rf"{op}: norm_weight must have shape \({k},\)", norm_weight=nw[:k - 1])
    bad(ValueError, rf"{op}: weight must have {k // 32 * 34} bytes per row", weight=make_packed(rng, n, 2 * k, 6))
    bad(ValueError, rf"{op}: residual's K \(columns\) = 48 is not a multiple of the Q8_0 block size 32",
        x=x[:, :48].copy(), residual=r[:, :48].copy(), norm_weight=nw[:48].copy(), residual_out=None)
    bad(ValueError, rf"{op}: out must have shape \({m}, {n}\)", out=np.full((m, n - 1), 7.0, np.float32))
    bad(ValueError, rf"{op}: residual_out must have shape \({m}, {k}\)", residual_out=res[:1])
    bad(ValueError, rf"{op}: eps", eps=0.0)
    bad(ValueError, rf"{op}: unknown qtype 'q5_k'", qtype="q5_k")
    bad(ValueError, rf"{op}: unknown backend", backend="triton")
    bad(TypeError, rf"{op}: x has dtype fp16", x=x.astype(np.float16))
    bad(TypeError, rf"{op}: norm_weight has dtype fp16", norm_weight=nw.astype(np.float16))
    bad(TypeError, rf"{op}: weight has (unsupported )?dtype int8", weight=w.view(np.int8))
    bad(ValueError, rf"{op}: residual_out and residual overlap", residual_out=r)  # not in place
    bad(ValueError, rf"{op}: .*out and residual_out overlap|residual_out and out overlap",
        out=res.reshape(-1)[:m * n].reshape(m, n))
    bad(ValueError, rf"{op}: residual must be contiguous", residual=rand(rng, (m, 2 * k), "fp32")[:, ::2])
    with pytest.raises(TypeError, match=rf"{op}: residual must be an array or tensor supporting DLPack"):
        ks.fused_add_rms_norm_quant_matmul(None, [[1.0] * k], nw, w, "q8_0")


def test_silu_and_mul_quant_matmul_validation_writes_nothing(rng):
    op = "silu_and_mul_quant_matmul"
    gu, w = rand(rng, (2, 128), "fp32"), make_packed(rng, 3, 64, 4)
    out = np.full((2, 3), 7.0, np.float32)

    def bad(exc, pattern, **kw):
        args = dict(gate_up=gu, weight=w, qtype="q4_0", out=out)
        args.update(kw)
        with pytest.raises(exc, match=pattern):
            ks.silu_and_mul_quant_matmul(**args)
        assert np.all(out == 7.0), "out was written after an error"

    bad(ValueError, rf"{op}: gate_up's last dimension must be even", gate_up=gu[:, :127].copy())
    bad(ValueError, rf"{op}: gate_up's K \(half its columns\) = 48 is not a multiple of the Q4_0 block size 32",
        gate_up=gu[:, :96].copy())
    bad(ValueError, rf"{op}: weight must have 36 bytes per row", weight=make_packed(rng, 3, 32, 4))
    bad(ValueError, rf"{op}: out must have shape \(2, 3\)", out=np.full((2, 2), 7.0, np.float32))
    bad(ValueError, rf"{op}: out and gate_up overlap", out=gu.reshape(-1)[:6].reshape(2, 3))
    bad(ValueError, rf"{op}: gate_up must have at least 1 dims", gate_up=np.array(1.0, np.float32))
    # (leading dims are taken: [2, 1, 128] needs out [2, 1, 3], and out [2, 3] is refused)
    bad(ValueError, rf"{op}: out must have shape \(2, 1, 3\)", gate_up=gu.reshape(2, 1, 128))
    bad(ValueError, rf"{op}: unknown qtype 42", qtype=42)
    bad(TypeError, rf"{op}: out has dtype fp16", out=np.zeros((2, 3), np.float16))
    bad(TypeError, rf"{op}: gate_up has (unsupported )?dtype", gate_up=gu.astype(np.float64))
    assert np.all(out == 7.0)


# ---- rotary_embedding ----------------------------------------------------------------------
def ref_rotary(t, pos, rd, theta, neox):
    out = f64(t).copy()
    half = rd // 2
    i = np.arange(half, dtype=np.float64)
    inv = (theta ** (-2.0 * i / rd)).astype(np.float32)
    ang = (pos.astype(np.float32)[:, None] * inv[None, :]).astype(np.float64)  # FP32 product
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if neox:
        a, b = out[..., :half].copy(), out[..., half:rd].copy()
        out[..., :half], out[..., half:rd] = a * c - b * s, b * c + a * s
    else:
        a, b = out[..., 0:rd:2].copy(), out[..., 1:rd:2].copy()
        out[..., 0:rd:2], out[..., 1:rd:2] = a * c - b * s, b * c + a * s
    return out, 4 * U * (np.abs(f64(t)).max() + 1.0)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rd", [64, 32])
def test_rotary_embedding(rng, dt, neox, rd):
    q = rand(rng, (5, 4, 64), dt)
    k = rand(rng, (5, 2, 64), dt)
    pos = np.array([0, 1, 7, 4095, 100000], np.int64)
    rq, eq = ref_rotary(q, pos, rd, 10000.0, neox)
    rk, ek = ref_rotary(k, pos, rd, 10000.0, neox)
    q0, k0 = q.copy(), k.copy()
    assert ks.rotary_embedding(q, k, pos, rd, 10000.0, neox) is None
    assert_close(q, rq, dt, extra=eq, what="q")
    assert_close(k, rk, dt, extra=ek, what="k")
    # features past rotary_dim pass through bit for bit
    assert np.array_equal(q[..., rd:].view(np.uint8), q0[..., rd:].view(np.uint8))
    assert np.array_equal(k[..., rd:].view(np.uint8), k0[..., rd:].view(np.uint8))


def test_rotary_q_only_and_defaults(rng):
    q = rand(rng, (3, 2, 16), "fp32")
    pos = np.array([1, 2, 3], np.int32)
    ref, e = ref_rotary(q, pos, 16, 10000.0, True)
    ks.rotary_embedding(q, None, pos)  # rotary_dim = head_dim, theta 1e4, NeoX
    assert_close(q, ref, "fp32", extra=e)


@pytest.mark.parametrize("dt", ["fp32", "fp16"])
def test_rotary_on_fused_qkv_views(rng, dt):
    # q and k as views of one [T, (H + 2 KVH) * D] buffer: rotated in place, v untouched
    T, H, KVH, D = 4, 3, 1, 16
    qkv = rand(rng, (T, (H + 2 * KVH) * D), dt)
    before = qkv.copy()
    q = qkv[:, :H * D].reshape(T, H, D)  # token stride (H + 2 KVH) D: not contiguous
    k = qkv[:, H * D:(H + KVH) * D].reshape(T, KVH, D)
    assert not q.flags.c_contiguous
    pos = np.array([3, 0, 9, 1000], np.int64)
    rq, eq = ref_rotary(before[:, :H * D].reshape(T, H, D), pos, D, 10000.0, True)
    rk, ek = ref_rotary(before[:, H * D:(H + KVH) * D].reshape(T, KVH, D), pos, D, 10000.0, True)
    ks.rotary_embedding(q, k, pos, D, 10000.0, True)
    assert_close(qkv[:, :H * D].reshape(T, H, D), rq, dt, extra=eq, what="q")
    assert_close(qkv[:, H * D:(H + KVH) * D].reshape(T, KVH, D), rk, dt, extra=ek, what="k")
    assert np.array_equal(qkv[:, (H + KVH) * D:].view(np.uint8), before[:, (H + KVH) * D:].view(np.uint8))
    # k overlapping q is rejected, nothing written
    k_bad = qkv[:, (H - 1) * D:H * D].reshape(T, 1, D)
    snap = qkv.copy()
    with pytest.raises(ValueError, match="rotary_embedding: q and k overlap"):
        ks.rotary_embedding(q, k_bad, pos, D)
    assert np.array_equal(qkv.view(np.uint8), snap.view(np.uint8))


def test_rotary_validation(rng):
    q = rand(rng, (3, 2, 16), "fp32")
    q0 = q.copy()
    pos = np.arange(3)
    for rd in (0, 3, 18):
        with pytest.raises(ValueError, match="rotary_embedding: rotary_dim must be even"):
            ks.rotary_embedding(q, None, pos, rd)
    with pytest.raises(ValueError, match="rotary_embedding: theta must be finite and > 1"):
        ks.rotary_embedding(q, None, pos, 16, 1.0)
    with pytest.raises(ValueError, match="rotary_embedding: positions must have shape"):
        ks.rotary_embedding(q, None, np.arange(4), 16)
    with pytest.raises(ValueError, match="rotary_embedding: k must have shape"):
        ks.rotary_embedding(q, rand(rng, (3, 2, 8), "fp32"), pos, 16)
    assert np.array_equal(q, q0)


# ---- kv_cache_append ---------------------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES)
def test_kv_cache_append(rng, dt):
    kc = np.zeros((4, 3, 2, 8), NP[dt])
    vc = np.zeros((4, 3, 2, 8), NP[dt])
    k = rand(rng, (5, 2, 8), dt)  # one padding row past the 4 tokens
    v = rand(rng, (5, 2, 8), dt)
    slots = np.array([0, 11, -1, 4], np.int64)
    ks.kv_cache_append(kc, vc, k, v, slots)
    flat_k, flat_v = kc.reshape(12, 2, 8), vc.reshape(12, 2, 8)
    for t, s in enumerate(slots):
        if s >= 0:
            assert np.array_equal(flat_k[s].view(np.uint8), k[t].view(np.uint8))
            assert np.array_equal(flat_v[s].view(np.uint8), v[t].view(np.uint8))
    untouched = [i for i in range(12) if i not in (0, 11, 4)]
    assert np.all(f64(flat_k[untouched]) == 0) and np.all(f64(flat_v[untouched]) == 0)


def test_kv_cache_append_bad_slot_writes_nothing(rng):
    kc = np.zeros((2, 2, 1, 4), np.float32)
    vc = np.zeros((2, 2, 1, 4), np.float32)
    k = rand(rng, (2, 1, 4), "fp32")
    for bad in (4, -2):
        with pytest.raises(ValueError, match=rf"kv_cache_append: slot_mapping\[1\] = {bad} is outside \[-1, 4\)"):
            ks.kv_cache_append(kc, vc, k, k.copy(), np.array([0, bad], np.int32))
        assert not kc.any() and not vc.any()
    with pytest.raises(ValueError, match="kv_cache_append: k_cache must have shape"):
        ks.kv_cache_append(np.zeros((2, 2, 2, 4), np.float32), np.zeros((2, 2, 2, 4), np.float32), k, k.copy(),
                           np.array([0, 1]))


# ---- rotary_embedding_kv_append -----------------------------------------------------------
def _two_calls(q, k, v, pos, kc, vc, slots, rd, theta, neox):
    """rotary_embedding then kv_cache_append on copies: the fused op's expected (q, k, k_cache, v_cache)."""
    q2, k2, kc2, vc2 = q.copy(), k.copy(), kc.copy(), vc.copy()
    ks.rotary_embedding(q2, k2, pos, rd, theta, neox)
    ks.kv_cache_append(kc2, vc2, k2, v, slots)
    return q2, k2, kc2, vc2


def _assert_bits(got, want, names=("q", "k", "k_cache", "v_cache")):
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                                                     np.ascontiguousarray(b).view(np.uint8)), name


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("pos_dt,slot_dt", [(np.int32, np.int64), (np.int64, np.int32)])
def test_rotary_embedding_kv_append_equals_the_two_calls(rng, dt, neox, pos_dt, slot_dt):
    # bit for bit: random inputs (caches too, so untouched rows are checked), GQA, rotary_dim <
    # head_dim, slots -1 skipped, and a padding row of k past slot_mapping's tokens (rotated,
    # not appended)
    T, H, KVH, D, rd, blocks, bs = 7, 4, 2, 32, 16, 3, 4
    q, k, v = rand(rng, (T, H, D), dt), rand(rng, (T, KVH, D), dt), rand(rng, (T, KVH, D), dt)
    kc, vc = rand(rng, (blocks, bs, KVH, D), dt), rand(rng, (blocks, bs, KVH, D), dt)
    pos = rng.integers(0, 1 << 20, T).astype(pos_dt)
    slots = np.array([5, -1, 0, 11, -1, 6], slot_dt)  # T - 1 tokens
    q0, k0, v0, kc0, vc0 = q.copy(), k.copy(), v.copy(), kc.copy(), vc.copy()
    want = _two_calls(q, k, v, pos, kc, vc, slots, rd, 5e5, neox)
    assert ks.rotary_embedding_kv_append(q, k, v, pos, kc, vc, slots, rd, 5e5, neox) is None
    _assert_bits((q, k, kc, vc), want)
    assert np.array_equal(v.view(np.uint8), v0.view(np.uint8))  # v is read only
    # the call did something: q and k rotated (features past rotary_dim passed through), the
    # slots' rows written with the rotated k and with v, the other rows untouched
    assert not np.array_equal(q[..., :rd], q0[..., :rd]) and not np.array_equal(k[..., :rd], k0[..., :rd])
    assert np.array_equal(q[..., rd:].view(np.uint8), q0[..., rd:].view(np.uint8))
    fk, fv, fk0, fv0 = (c.reshape(blocks * bs, KVH, D) for c in (kc, vc, kc0, vc0))
    for t, slot in enumerate(slots):
        if slot >= 0:
            assert np.array_equal(fk[slot].view(np.uint8), k[t].view(np.uint8))
            assert np.array_equal(fv[slot].view(np.uint8), v[t].view(np.uint8))
    rest = [i for i in range(blocks * bs) if i not in set(int(x) for x in slots)]
    assert np.array_equal(fk[rest].view(np.uint8), fk0[rest].view(np.uint8))
    assert np.array_equal(fv[rest].view(np.uint8), fv0[rest].view(np.uint8))
    # the rotation itself against FP64 (as test_rotary_embedding)
    rk, ek = ref_rotary(k0, pos, rd, 5e5, neox)
    assert_close(k, rk, dt, extra=ek, what="k")


@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_rotary_embedding_kv_append_strided_q_and_empty_calls(rng, dt):
    # q a strided view of a fused qkv buffer (k and v must be contiguous, as kv_cache_append's)
    T, H, KVH, D = 4, 3, 1, 16
    qkv = rand(rng, (T, (H + 2 * KVH) * D), dt)
    q = qkv[:, :H * D].reshape(T, H, D)
    assert not q.flags.c_contiguous
    k = qkv[:, H * D:(H + KVH) * D].reshape(T, KVH, D).copy()
    v = qkv[:, (H + KVH) * D:].reshape(T, KVH, D).copy()
    kc, vc = np.zeros((2, 4, KVH, D), NP[dt]), np.zeros((2, 4, KVH, D), NP[dt])
    pos, slots = np.array([9, 0, 77, 3]), np.array([7, 2, -1, 0])
    rest = qkv[:, H * D:].copy()
    want = _two_calls(q, k, v, pos, kc, vc, slots, D, 1e4, True)
    ks.rotary_embedding_kv_append(q, k, v, pos, kc, vc, slots)  # rotary_dim = head_dim, theta 1e4, NeoX
    _assert_bits((q, k, kc, vc), want)
    assert np.array_equal(qkv[:, H * D:].view(np.uint8), rest.view(np.uint8))
    # no slot: only the rotation; no token: nothing at all
    q2, k2, kc2 = q.copy(), k.copy(), kc.copy()
    want = _two_calls(q2, k2, v, pos, kc2, vc, slots[:0], 8, 1e4, False)
    ks.rotary_embedding_kv_append(q2, k2, v, pos, kc2, vc, slots[:0], 8, 1e4, False)
    _assert_bits((q2, k2, kc2), want[:3])
    assert np.array_equal(kc2.view(np.uint8), kc.view(np.uint8))
    e = np.zeros((0, H, D), NP[dt]), np.zeros((0, KVH, D), NP[dt])
    ks.rotary_embedding_kv_append(e[0], e[1], e[1].copy(), np.zeros(0, np.int64), kc2, vc, np.zeros(0, np.int32))
    assert np.array_equal(kc2.view(np.uint8), kc.view(np.uint8))


def test_rotary_embedding_kv_append_validation_writes_nothing(rng):
    op = "rotary_embedding_kv_append"
    T, H, KVH, D = 3, 2, 1, 16
    kbuf = rand(rng, ((T + 1) * KVH * D,), "fp32")  # k, and one row more for a v overlapping it
    q, k, v = rand(rng, (T, H, D), "fp32"), kbuf[:T * KVH * D].reshape(T, KVH, D), rand(rng, (T, KVH, D), "fp32")
    kc, vc = rand(rng, (2, 2, KVH, D), "fp32"), rand(rng, (2, 2, KVH, D), "fp32")
    pos, slots = np.arange(T), np.array([0, 3, -1], np.int32)
    written = (q, k, kc, vc)
    before = [a.copy() for a in written]

    def bad(exc, pattern, **kw):
        args = dict(q=q, k=k, v=v, positions=pos, k_cache=kc, v_cache=vc, slot_mapping=slots, rotary_dim=8)
        args.update(kw)
        with pytest.raises(exc, match=pattern):
            ks.rotary_embedding_kv_append(**args)
        for name, a, b in zip(("q", "k", "k_cache", "v_cache"), written, before):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{name} was written after an error"

    bad(ValueError, rf"{op}: k is missing", k=None)
    bad(ValueError, rf"{op}: v and k overlap in memory", v=k)
    bad(ValueError, rf"{op}: v and k overlap in memory", v=kbuf[KVH * D:].reshape(T, KVH, D))
    for rd in (0, 3, 18, -2):
        bad(ValueError, rf"{op}: rotary_dim must be even and in \(0, head_dim=16\]; got {rd}", rotary_dim=rd)
    bad(ValueError, rf"{op}: theta must be finite and > 1", theta=float("nan"))
    bad(ValueError, rf"{op}: positions must have shape \(3,\)", positions=np.arange(T + 1))
    bad(ValueError, rf"{op}: k must have shape \(num_tokens, num_kv_heads, head_dim\)",
        k=rand(rng, (T, KVH, 8), "fp32"))
    bad(ValueError, rf"{op}: v must have shape", v=rand(rng, (T, KVH + 1, D), "fp32"))
    bad(ValueError, rf"{op}: slot_mapping\[1\] = 4 is outside \[-1, 4\)", slot_mapping=np.array([0, 4, -1]))
    bad(ValueError, rf"{op}: slot_mapping\[2\] = -2 is outside", slot_mapping=np.array([0, 1, -2]))
    bad(ValueError, rf"{op}: k has 3 tokens but slot_mapping has 4", slot_mapping=np.array([0, 1, 2, 3]))
    bad(ValueError, rf"{op}: k_cache must have shape \(num_blocks, block_size, 1, 16\)",
        k_cache=np.zeros((2, 2, 2, D), np.float32))
    bad(ValueError, rf"{op}: v_cache must have shape", v_cache=np.zeros((2, 3, KVH, D), np.float32))
    bad(ValueError, rf"{op}: k_cache and v_cache overlap", v_cache=kc)
    bad(ValueError, rf"{op}: k_cache and k overlap", k_cache=kbuf.reshape(2, 2, KVH, D))
    # the fused op's own rules: the caches must not overlap q or positions, v must not overlap q
    bad(ValueError, rf"{op}: k_cache and q overlap", k_cache=q.reshape(-1)[:64].reshape(2, 2, KVH, D))
    bad(ValueError, rf"{op}: v_cache and q overlap", v_cache=q.reshape(-1)[32:].reshape(2, 2, KVH, D))
    bad(ValueError, rf"{op}: k_cache and positions overlap", positions=kc.reshape(-1).view(np.int32)[:T])
    bad(ValueError, rf"{op}: v and q overlap", v=q.reshape(-1)[:T * KVH * D].reshape(T, KVH, D))
    bad(ValueError, rf"{op}: k must be contiguous", k=rand(rng, (T, KVH, 2 * D), "fp32")[..., ::2])
    bad(TypeError, rf"{op}: k has dtype fp16 but q has fp32", k=k.astype(np.float16))
    bad(TypeError, rf"{op}: v has dtype fp16 but k has fp32", v=v.astype(np.float16))
    bad(TypeError, rf"{op}: positions has dtype fp32", positions=pos.astype(np.float32))
    bad(TypeError, rf"{op}: slot_mapping has dtype", slot_mapping=slots.astype(np.float32))
    bad(ValueError, rf"{op}: unknown backend 'triton'", backend="triton")
    ro = v.copy()
    ro.flags.writeable = False  # v is only read: a read-only array is fine ...
    ks.rotary_embedding_kv_append(q.copy(), k.copy(), ro, pos, kc.copy(), vc.copy(), slots, 8)
    bad(ValueError, rf"{op}: k_cache is read-only",  # ... a read-only k_cache is not
        k_cache=np.frombuffer(kc.tobytes(), np.float32).reshape(kc.shape))


# ---- fused_add_rms_norm_quant_matmul_rope_kv_append -----------------------------------------
def _norm_rope_two_calls(x, r, nw, w, qtype, h, kvh, pos, kc, vc, slots, rd, theta, neox, eps):
    """fused_add_rms_norm_quant_matmul, then rotary_embedding_kv_append on out's q / k / v column
    slices (numpy views of out), on copies of the caches: the fused op's expected
    (out, residual_out or None, k_cache, v_cache), and out before the rotation."""
    kc2, vc2 = kc.copy(), vc.copy()
    got = ks.fused_add_rms_norm_quant_matmul(x, r, nw, w, qtype, eps)
    out, res = got if x is not None else (got, None)
    plain = out.copy()
    d = out.shape[1] // (h + 2 * kvh)
    q = out[:, :h * d].reshape(1, h, d)
    k = out[:, h * d:(h + kvh) * d].reshape(1, kvh, d)
    v = out[:, (h + kvh) * d:].reshape(1, kvh, d)
    assert all(np.shares_memory(t, out) for t in (q, k, v))  # views: rotated in place inside out
    ks.rotary_embedding_kv_append(q, k, v, pos, kc2, vc2, slots, rd, theta, neox)
    return (out, res, kc2, vc2), plain


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("with_x", [True, False])
@pytest.mark.parametrize("q,slot", [(5, [13]), (6, [-1]), (4, [])])
def test_fused_add_rms_norm_quant_matmul_rope_kv_append_equals_the_two_calls(rng, dt, neox, with_x, q, slot):
    # bit for bit, under every CPU variant of quant_matmul (the matmul step): one token, GQA,
    # rotary_dim < head_dim, random caches (untouched rows are checked too), a slot, a skipped
    # slot (-1) and no slot (slot_mapping of 0 entries)
    H, KVH, D, rd, K, blocks, bs, eps, theta = 4, 2, 32, 16, 128, 3, 8, 1e-5, 5e5
    N = (H + 2 * KVH) * D
    x = rand(rng, (1, K), dt) if with_x else None
    r, nw, w = rand(rng, (1, K), dt), rand(rng, (K,), dt), make_packed(rng, N, K, q)
    kc0, vc0 = rand(rng, (blocks, bs, KVH, D), dt), rand(rng, (blocks, bs, KVH, D), dt)
    pos, slots = np.array([77777], np.int64), np.array(slot, np.int32)
    x0, r0 = (None if x is None else x.copy()), r.copy()

    def both():
        kc, vc = kc0.copy(), vc0.copy()
        out = np.full((1, N), np.nan, NP[dt])  # poisoned: every element must be written
        res = np.full((1, K), np.nan, NP[dt]) if with_x else None
        got = ks.fused_add_rms_norm_quant_matmul_rope_kv_append(x, r, nw, w, QNAMES[q], H, KVH, pos, kc, vc, slots,
                                                                eps, rd, theta, neox, out=out, residual_out=res)
        if with_x:
            assert isinstance(got, tuple) and got[0] is out and got[1] is res
        else:
            assert got is out
        return (out, res, kc, vc), _norm_rope_two_calls(x, r, nw, w, QNAMES[q], H, KVH, pos, kc0, vc0, slots, rd,
                                                        theta, neox, eps)

    ran = []
    for variant, (got, (want, plain)) in each_variant("quant_matmul", both):
        ran.append(variant)
        keep = (0, 1, 2, 3) if with_x else (0, 2, 3)  # residual_out: None without x
        _assert_bits([got[i] for i in keep], [want[i] for i in keep],
                     [("out", "residual_out", "k_cache", "v_cache")[i] + f" ({variant})" for i in keep])
        out, kc = got[0], got[2]
        # the call did something: q and k rotated (features past rotary_dim passed through), v
        # as the matmul wrote it; the slot's rows hold the rotated k and v, the others untouched
        qkv, plain3 = out.reshape(H + 2 * KVH, D), plain.reshape(H + 2 * KVH, D)
        assert not np.array_equal(qkv[:H + KVH, :rd], plain3[:H + KVH, :rd]), variant
        assert np.array_equal(qkv[:, rd:].view(np.uint8), plain3[:, rd:].view(np.uint8)), variant
        assert np.array_equal(qkv[H + KVH:].view(np.uint8), plain3[H + KVH:].view(np.uint8)), variant
        fk, fk0 = kc.reshape(blocks * bs, KVH, D), kc0.reshape(blocks * bs, KVH, D)
        kept = [i for i in range(blocks * bs) if i not in slot]
        assert np.array_equal(fk[kept].view(np.uint8), fk0[kept].view(np.uint8)), variant
        if slot and slot[0] >= 0:
            assert np.array_equal(fk[slot[0]].view(np.uint8), qkv[H:H + KVH].view(np.uint8)), variant
    assert len(ran) == len(set(ran)) >= 1
    # the inputs are read only
    assert np.array_equal(r.view(np.uint8), r0.view(np.uint8))
    if with_x:
        assert np.array_equal(x.view(np.uint8), x0.view(np.uint8))
    # allocated outputs (residual's framework, dtype, the (1, N) / (1, K) shapes) and the defaults
    # (eps 1e-6, rotary_dim = head_dim, theta 1e4, NeoX pairs)
    kc, vc = kc0.copy(), vc0.copy()
    got = ks.fused_add_rms_norm_quant_matmul_rope_kv_append(x, r, nw, w, ks.QType(q), H, KVH, pos, kc, vc, slots)
    (want, _) = _norm_rope_two_calls(x, r, nw, w, QNAMES[q], H, KVH, pos, kc0, vc0, slots, D, 1e4, True, 1e-6)
    got = got if with_x else (got, None)
    assert isinstance(got[0], np.ndarray) and got[0].shape == (1, N) and got[0].dtype == NP[dt]
    _assert_bits((got[0], kc, vc), (want[0], want[2], want[3]), ("allocated out", "k_cache", "v_cache"))
    if with_x:
        assert got[1].shape == (1, K) and got[1].dtype == NP[dt]
        _assert_bits(got[1:2], want[1:2], ("allocated residual_out",))


def test_fused_add_rms_norm_quant_matmul_rope_kv_append_zero_rows(rng):
    # residual [0, K]: validated, nothing written
    H, KVH, D, K = 2, 1, 16, 64
    kc, vc = rand(rng, (2, 4, KVH, D), "fp32"), rand(rng, (2, 4, KVH, D), "fp32")
    kc0, vc0 = kc.copy(), vc.copy()
    out = ks.fused_add_rms_norm_quant_matmul_rope_kv_append(
        None, np.zeros((0, K), np.float32), rand(rng, (K,), "fp32"), make_packed(rng, (H + 2 * KVH) * D, K, 6),
        "q8_0", H, KVH, np.zeros(0, np.int64), kc, vc, np.zeros(0, np.int64))
    assert out.shape == (0, (H + 2 * KVH) * D)
    assert np.array_equal(kc, kc0) and np.array_equal(vc, vc0)


def test_fused_add_rms_norm_quant_matmul_rope_kv_append_validation_writes_nothing(rng):
    op = "fused_add_rms_norm_quant_matmul_rope_kv_append"
    H, KVH, D, K = 4, 2, 16, 64
    N = (H + 2 * KVH) * D
    x, r, nw = rand(rng, (1, K), "fp32"), rand(rng, (1, K), "fp32"), rand(rng, (K,), "fp32")
    w = make_packed(rng, N, K, 6)
    kc, vc = rand(rng, (2, 4, KVH, D), "fp32"), rand(rng, (2, 4, KVH, D), "fp32")
    pos, slots = np.array([3], np.int64), np.array([5], np.int64)
    out, res = np.full((1, N), 7.0, np.float32), np.full((1, K), 7.0, np.float32)
    written = (out, res, kc, vc)
    before = [a.copy() for a in written]

    def bad(exc, pattern, **kw):
        args = dict(x=x, residual=r, norm_weight=nw, weight=w, qtype="q8_0", num_heads=H, num_kv_heads=KVH,
                    positions=pos, k_cache=kc, v_cache=vc, slot_mapping=slots, rotary_dim=D, out=out,
                    residual_out=res)
        args.update(kw)
        with pytest.raises(exc, match=pattern):
            ks.fused_add_rms_norm_quant_matmul_rope_kv_append(**args)
        for name, a, b in zip(("out", "residual_out", "k_cache", "v_cache"), written, before):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{name} was written after an error"

    bad(ValueError, rf"{op}: num_heads and num_kv_heads must be > 0; got 0 and {KVH}", num_heads=0)
    bad(ValueError, rf"{op}: num_heads and num_kv_heads must be > 0; got {H} and -1", num_kv_heads=-1)
    bad(ValueError, rf"{op}: weight's {N} rows \(out's columns\) must be \(num_heads \+ 2 num_kv_heads\) x head_dim",
        num_heads=H + 1)
    bad(ValueError, rf"{op}: residual has 2 rows; this fusion is a one-token decode step",
        x=rand(rng, (2, K), "fp32"), residual=rand(rng, (2, K), "fp32"), out=np.full((2, N), 7.0, np.float32),
        residual_out=np.full((2, K), 7.0, np.float32))
    bad(ValueError, rf"{op}: residual_out is given but x is missing", x=None)
    bad(ValueError, rf"{op}: rotary_dim must be even and in \(0, head_dim={D}\]; got {D + 2}", rotary_dim=D + 2)
    bad(ValueError, rf"{op}: theta must be finite and > 1", theta=1.0)
    bad(ValueError, rf"{op}: positions must have shape \(1,\)", positions=np.array([3, 4]))
    bad(ValueError, rf"{op}: k_cache must have shape \(num_blocks, block_size, {KVH}, {D}\)",
        k_cache=np.zeros((2, 4, KVH, D + 2), np.float32))
    bad(ValueError, rf"{op}: slot_mapping\[0\] = 8 is outside \[-1, 8\)", slot_mapping=np.array([8]))
    bad(ValueError, rf"{op}: eps", eps=0.0)
    bad(ValueError, rf"{op}: unknown qtype 'q5_k'", qtype="q5_k")
    bad(ValueError, rf"{op}: unknown backend 'triton'", backend="triton")
    bad(TypeError, rf"{op}: k_cache has dtype fp16 but k has fp32", k_cache=kc.astype(np.float16))
    bad(TypeError, rf"{op}: positions has dtype fp32", positions=pos.astype(np.float32))
    # the fused op's own rules: the caches, positions and slot_mapping apart from the matmul's tensors
    big = rand(rng, (2, 4, KVH, D), "fp32")
    bad(ValueError, rf"{op}: k_cache and residual overlap", k_cache=big, residual=big.reshape(-1)[:K].reshape(1, K))
    bad(ValueError, rf"{op}: q and positions overlap", positions=out.reshape(-1).view(np.int64)[:1])
    bad(ValueError, rf"{op}: out and positions overlap",  # in v: read by no rotation, still inside out
        positions=out.reshape(-1)[(H + KVH) * D:].view(np.int64)[:1])
    # the extension's own checks: the caches are written, so they must be writable
    ro_kc = np.frombuffer(kc.tobytes(), np.float32).reshape(kc.shape)
    bad(ValueError, rf"{op}: k_cache is read-only", k_cache=ro_kc)
    bad(ValueError, rf"{op}: v_cache is read-only", v_cache=np.frombuffer(vc.tobytes(), np.float32).reshape(vc.shape))
    with pytest.raises(TypeError, match=rf"{op}: slot_mapping must be a tensor, not None"):
        ks.fused_add_rms_norm_quant_matmul_rope_kv_append(x, r, nw, w, "q8_0", H, KVH, pos, kc, vc, None)


# ---- paged_attention -----------------------------------------------------------------------
def ref_paged_attention(q, kc, vc, bt, seq_ids, ctx, scale):
    qf, kf, vf = f64(q), f64(kc), f64(vc)
    n_tok, h, d = q.shape
    _, bs, kvh, _ = kc.shape
    group = h // kvh
    out = np.zeros((n_tok, h, d))
    extra = np.zeros((n_tok, h, 1))
    for t in range(n_tok):
        s_id = t if seq_ids is None else int(seq_ids[t])
        length = int(ctx[t])
        if length == 0:
            continue
        slots = [int(bt[s_id, j // bs]) * bs + j % bs for j in range(length)]
        keys = kf.reshape(-1, kvh, d)[slots]  # [L, kvh, d]
        vals = vf.reshape(-1, kvh, d)[slots]
        for hh in range(h):
            g = hh // group
            prod = qf[t, hh][None, :] * keys[:, g, :]
            s = scale * prod.sum(-1)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, hh] = p @ vals[:, g, :]
            # first-order FP32 bound: score error through exp and the normalisation
            es = abs(scale) * 8 * math.sqrt(d) * U * np.abs(prod).sum(-1).max() + U * np.abs(s).max()
            extra[t, hh] = (2 * es + (length + 4) * U + 8 * math.sqrt(length) * U) * (p @ np.abs(vals[:, g, :])).max()
    return out, extra


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 1), (3, 3)])
@pytest.mark.parametrize("bs", [1, 7, 16])
def test_paged_attention_decode_every_variant(rng, dt, heads, kv_heads, bs):
    d, n_blocks, n_seq = 32, 12, 3
    q = rand(rng, (n_seq, heads, d), dt)
    kc = rand(rng, (n_blocks, bs, kv_heads, d), dt)
    vc = rand(rng, (n_blocks, bs, kv_heads, d), dt)
    max_blocks = 4
    bt = rng.permutation(n_blocks)[: n_seq * max_blocks].reshape(n_seq, max_blocks).astype(np.int32)
    ctx = np.array([0, 1, max_blocks * bs], np.int32)  # empty, one key, the whole capacity
    scale = 1.0 / math.sqrt(d)
    ref, extra = ref_paged_attention(q, kc, vc, bt, None, ctx, scale)
    for variant, y in each_variant("paged_attention", lambda: ks.paged_attention(q, kc, vc, bt, ctx)):
        assert y.shape == q.shape and y.dtype == NP[dt]
        assert np.all(f64(y[0]) == 0)  # context 0: a zero row
        assert_close(y, ref, dt, extra=extra, what=f"paged_attention {variant}")


@pytest.mark.parametrize("dt", DTYPES)
def test_paged_attention_causal_prefill(rng, dt):
    d, bs, heads, kvh, n_tok = 16, 4, 4, 2, 6
    q = rand(rng, (n_tok, heads, d), dt)
    kc = rand(rng, (3, bs, kvh, d), dt)
    vc = rand(rng, (3, bs, kvh, d), dt)
    bt = np.array([[2, 0]], np.int32)  # one sequence, blocks 2 then 0
    seq_ids = np.zeros(n_tok, np.int32)
    ctx = np.arange(1, n_tok + 1, dtype=np.int32)  # token t sees keys 0..t
    ref, extra = ref_paged_attention(q, kc, vc, bt, seq_ids, ctx, 0.3)
    y = ks.paged_attention(q, kc, vc, bt, ctx, 0.3, seq_ids=seq_ids)
    assert_close(y, ref, dt, extra=extra, what="prefill")


def test_paged_attention_validation(rng):
    q = rand(rng, (2, 4, 8), "fp32")
    kc = rand(rng, (3, 2, 2, 8), "fp32")
    bt = np.array([[0, 1], [2, 5]], np.int32)
    ctx = np.array([4, 4], np.int32)
    out = np.full_like(q, 9.0)
    with pytest.raises(ValueError, match=r"paged_attention: block_tables\[1, 1\] = 5 is outside \[0, 3\)"):
        ks.paged_attention(q, kc, kc.copy(), bt, ctx, out=out)
    assert np.all(out == 9.0)
    with pytest.raises(ValueError, match=r"paged_attention: context_lens\[0\] = 5 is outside"):
        ks.paged_attention(q, kc, kc.copy(), np.array([[0, 1], [2, 0]], np.int32), np.array([5, 1], np.int32))
    with pytest.raises(ValueError, match="paged_attention: num_heads .3. must be a multiple of num_kv_heads .2."):
        ks.paged_attention(rand(rng, (2, 3, 8), "fp32"), kc, kc.copy(), bt, ctx)
    with pytest.raises(ValueError, match=r"paged_attention: seq_ids\[0\] = 7 is outside"):
        ks.paged_attention(q, kc, kc.copy(), bt, ctx, seq_ids=np.array([7, 0], np.int32))
    with pytest.raises(TypeError, match="paged_attention: block_tables has dtype int64"):
        ks.paged_attention(q, kc, kc.copy(), bt.astype(np.int64), ctx)


# ---- rotary_embedding_kv_append_paged_attention -----------------------------------------------
def _rope_attn_two_calls(q, k, v, pos, kc, vc, slots, bt, ctx, rd, theta, neox, scale, seq_ids):
    """rotary_embedding_kv_append, then paged_attention, on copies: the fused op's expected
    (out, q, k, k_cache, v_cache)."""
    q2, k2, kc2, vc2 = q.copy(), k.copy(), kc.copy(), vc.copy()
    ks.rotary_embedding_kv_append(q2, k2, v, pos, kc2, vc2, slots, rd, theta, neox)
    return ks.paged_attention(q2, kc2, vc2, bt, ctx, scale, seq_ids=seq_ids), q2, k2, kc2, vc2


def _rope_attn_inputs(rng, dt, with_seq_ids):
    """GQA (6 query heads, 2 kv heads), head_dim 32, caches of 8 blocks of 4 (random: untouched rows
    are checked too). seq_ids None: a decode step, token t the newest position (context_lens[t] - 1)
    of sequence t. seq_ids given: three tokens of sequence 1 (each later one reads the slots the
    earlier ones append), one of sequence 0, and a padding token (slot -1, context 0: a zero row)."""
    H, KVH, D, blocks, bs = 6, 2, 32, 8, 4
    kc, vc = rand(rng, (blocks, bs, KVH, D), dt), rand(rng, (blocks, bs, KVH, D), dt)
    if with_seq_ids:
        bt = np.array([[6, 1, 4], [0, 7, 3]], np.int32)
        seq_ids = np.array([1, 0, 1, 1, 0], np.int32)
        ctx = np.array([6, 3, 7, 8, 0], np.int32)
        pos = np.array([5, 2, 6, 7, 0], np.int64)
    else:
        bt = rng.permutation(blocks).reshape(4, 2).astype(np.int32)
        seq_ids = None
        ctx = np.array([1, 5, 8, 3], np.int32)
        pos = (ctx - 1).astype(np.int32)
    seq = np.arange(len(ctx)) if seq_ids is None else seq_ids
    slots = np.array([bt[s, p // bs] * bs + p % bs if c > 0 else -1 for s, p, c in zip(seq, pos, ctx)],
                     np.int32 if with_seq_ids else np.int64)
    T = len(ctx)
    q, k, v = rand(rng, (T, H, D), dt), rand(rng, (T, KVH, D), dt), rand(rng, (T, KVH, D), dt)
    return q, k, v, pos, kc, vc, slots, bt, seq_ids, ctx


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("with_seq_ids", [False, True])
def test_rotary_embedding_kv_append_paged_attention_equals_the_two_calls(rng, dt, neox, with_seq_ids):
    # bit for bit under every CPU variant of paged_attention (the second step): out, q, k and both
    # caches, rotary_dim < head_dim
    q0, k0, v, pos, kc0, vc0, slots, bt, seq_ids, ctx = _rope_attn_inputs(rng, dt, with_seq_ids)
    rd, theta, scale = 16, 5e5, 0.3
    v0 = v.copy()

    def both():
        q, k, kc, vc = q0.copy(), k0.copy(), kc0.copy(), vc0.copy()
        out = np.full(q.shape, np.nan, NP[dt])  # poisoned: every element must be written
        got = ks.rotary_embedding_kv_append_paged_attention(q, k, v, pos, kc, vc, slots, bt, ctx, rd, theta, neox,
                                                            scale, seq_ids=seq_ids, out=out)
        assert got is out
        return (out, q, k, kc, vc), _rope_attn_two_calls(q0, k0, v, pos, kc0, vc0, slots, bt, ctx, rd, theta, neox,
                                                         scale, seq_ids)

    ran = []
    for variant, (got, want) in each_variant("paged_attention", both):
        ran.append(variant)
        _assert_bits(got, want, [f"{n} ({variant})" for n in ("out", "q", "k", "k_cache", "v_cache")])
    assert len(ran) == len(set(ran)) >= 1
    assert np.array_equal(v.view(np.uint8), v0.view(np.uint8))  # v is read only
    out, q, k, kc, vc = got
    # the call did something: q and k rotated (features past rotary_dim passed through), the
    # slots' rows written with the rotated k and with v, the other rows untouched, and out the
    # attention of the rotated q over the appended caches (against FP64)
    assert not np.array_equal(q[..., :rd], q0[..., :rd]) and not np.array_equal(k[..., :rd], k0[..., :rd])
    assert np.array_equal(q[..., rd:].view(np.uint8), q0[..., rd:].view(np.uint8))
    n_slots, row = kc.shape[0] * kc.shape[1], kc.shape[2:]
    fk, fv, fk0 = kc.reshape(n_slots, *row), vc.reshape(n_slots, *row), kc0.reshape(n_slots, *row)
    for t, slot in enumerate(slots):
        if slot >= 0:
            assert np.array_equal(fk[slot].view(np.uint8), k[t].view(np.uint8))
            assert np.array_equal(fv[slot].view(np.uint8), v[t].view(np.uint8))
    rest = [i for i in range(n_slots) if i not in set(int(x) for x in slots)]
    assert np.array_equal(fk[rest].view(np.uint8), fk0[rest].view(np.uint8))
    ref, extra = ref_paged_attention(q, kc, vc, bt, seq_ids, ctx, scale)
    assert_close(out, ref, dt, extra=extra, what="out")
    if with_seq_ids:
        assert np.all(f64(out[-1]) == 0)  # context 0: a zero row


@pytest.mark.parametrize("dt", ["fp32", "bf16"])
def test_rotary_embedding_kv_append_paged_attention_defaults_and_empty_calls(rng, dt):
    # out allocated (q's framework, shape and dtype); the defaults: rotary_dim = head_dim, theta 1e4,
    # NeoX pairs, scale 1 / sqrt(head_dim), seq_ids None
    q, k, v, pos, kc, vc, slots, bt, seq_ids, ctx = _rope_attn_inputs(rng, dt, False)
    want = _rope_attn_two_calls(q, k, v, pos, kc, vc, slots, bt, ctx, 32, 1e4, True, 1 / math.sqrt(32), None)
    out = ks.rotary_embedding_kv_append_paged_attention(q, k, v, pos, kc, vc, slots, bt, ctx)
    assert isinstance(out, np.ndarray) and out.shape == q.shape and out.dtype == NP[dt]
    _assert_bits((out, q, k, kc, vc), want, ("out", "q", "k", "k_cache", "v_cache"))
    # no token: nothing written, an empty out
    kc0 = kc.copy()
    e = np.zeros((0, 6, 32), NP[dt]), np.zeros((0, 2, 32), NP[dt])
    z = np.zeros(0, np.int32)
    out = ks.rotary_embedding_kv_append_paged_attention(e[0], e[1], e[1].copy(), z, kc, vc, z, bt[:0], z)
    assert out.shape == (0, 6, 32)
    assert np.array_equal(kc.view(np.uint8), kc0.view(np.uint8))


def test_rotary_embedding_kv_append_paged_attention_validation_writes_nothing(rng):
    op = "rotary_embedding_kv_append_paged_attention"
    q, k, v, pos, kc, vc, slots, bt, _, ctx = _rope_attn_inputs(rng, "fp32", False)
    out = np.full(q.shape, 7.0, np.float32)
    written = (out, q, k, kc, vc)
    before = [a.copy() for a in written]

    def bad(exc, pattern, **kw):
        args = dict(q=q, k=k, v=v, positions=pos, k_cache=kc, v_cache=vc, slot_mapping=slots, block_tables=bt,
                    context_lens=ctx, rotary_dim=16, out=out)
        args.update(kw)
        with pytest.raises(exc, match=pattern):
            ks.rotary_embedding_kv_append_paged_attention(**args)
        for name, a, b in zip(("out", "q", "k", "k_cache", "v_cache"), written, before):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{name} was written after an error"

    # rotary_embedding_kv_append's rules, under this op's name
    bad(ValueError, rf"{op}: k is missing", k=None)
    bad(ValueError, rf"{op}: rotary_dim must be even and in \(0, head_dim=32\]; got 7", rotary_dim=7)
    bad(ValueError, rf"{op}: theta must be finite and > 1", theta=0.5)
    bad(ValueError, rf"{op}: v and k overlap in memory", v=k)
    bad(ValueError, rf"{op}: slot_mapping\[1\] = 32 is outside \[-1, 32\)", slot_mapping=np.array([0, 32, 1, 2]))
    bad(TypeError, rf"{op}: k has dtype fp16 but q has fp32", k=k.astype(np.float16))
    # paged_attention's rules, under this op's name
    bad(ValueError, rf"{op}: context_lens\[2\] = 9 is outside \[0, max_blocks_per_seq \* block_size = 8\]",
        context_lens=np.array([1, 5, 9, 3], np.int32))
    bad(ValueError, rf"{op}: block_tables\[1, 1\] = 8 is outside \[0, 8\)",
        block_tables=np.where(np.arange(8).reshape(4, 2) == 3, 8, bt).astype(np.int32))
    bad(ValueError, rf"{op}: seq_ids\[0\] = 4 is outside \[0, 4\)", seq_ids=np.array([4, 0, 1, 2], np.int32))
    bad(ValueError, rf"{op}: without seq_ids, block_tables needs one row per query token \(4\)",
        block_tables=bt[:3].copy())
    bad(ValueError, rf"{op}: scale must be finite", scale=float("inf"))
    bad(ValueError, rf"{op}: num_heads \(6\) must be a multiple of num_kv_heads \(4\)",
        k=rand(rng, (4, 4, 32), "fp32"), v=rand(rng, (4, 4, 32), "fp32"), k_cache=np.zeros((8, 4, 4, 32), np.float32),
        v_cache=np.zeros((8, 4, 4, 32), np.float32))
    bad(TypeError, rf"{op}: block_tables has dtype int64", block_tables=bt.astype(np.int64))
    bad(ValueError, rf"{op}: out must have shape \(4, 6, 32\)", out=np.full((4, 6, 16), 7.0, np.float32))
    bad(TypeError, rf"{op}: out has dtype fp16 but q has fp32", out=np.full(q.shape, 7.0, np.float16))
    # the fused op's own rule: out apart from what the first step reads and writes
    bad(ValueError, rf"{op}: out and k overlap in memory", out=out, k=out.reshape(-1)[:k.size].reshape(k.shape))
    bad(ValueError, rf"{op}: out and v overlap in memory", v=out.reshape(-1)[-v.size:].reshape(v.shape))
    bad(ValueError, rf"{op}: out and positions overlap in memory",
        positions=out.reshape(-1)[:4].view(np.int32))
    bad(ValueError, rf"{op}: unknown backend 'triton'", backend="triton")
    bad(ValueError, rf"{op}: k_cache is read-only", k_cache=np.frombuffer(kc.tobytes(), np.float32).reshape(kc.shape))
    with pytest.raises(TypeError, match=rf"{op}: context_lens must be a tensor, not None"):
        ks.rotary_embedding_kv_append_paged_attention(q, k, v, pos, kc, vc, slots, bt, None)


# ---- sample ------------------------------------------------------------------------------
def test_scalar_arguments_are_typed(rng):
    # numbers only: float("0.5") and int(5.7) took strings and truncated before (an adversarial
    # review's find); numpy scalars are numbers
    x = rand(rng, (2, 64), "fp32")
    so = np.array([1, 2], np.int64)
    want = ks.sample(x, so, 0.5, 3, 0.5)
    assert np.array_equal(ks.sample(x, so, np.float32(0.5), np.int64(3), np.float64(0.5)), want)
    for kw, bad, what in (("temperature", "0.5", "a number"), ("top_p", "0.5", "a number"),
                          ("top_k", "3", "an integer"), ("top_k", 5.7, "an integer"), ("top_k", True, "an integer")):
        args = dict(temperature=0.5, top_k=3, top_p=0.5)
        args[kw] = bad
        with pytest.raises(TypeError, match=f"sample: {kw} must be {what}"):
            ks.sample(x, so, **args)
    # past the C ABI's int64 / a double's range (a second adversarial review): top_k past int64 is
    # "off" as any top_k >= vocab; an integer temperature past a double's range is named by the
    # op's own check (it raised a raw OverflowError); top_p's message shows the double as given
    assert np.array_equal(ks.sample(x, so, 0.5, 2 ** 63, 0.5), ks.sample(x, so, 0.5, 0, 0.5))
    assert np.array_equal(ks.sample(x, so, 0.5, np.uint64(2 ** 64 - 1), 0.5), ks.sample(x, so, 0.5, 0, 0.5))
    with pytest.raises(ValueError, match="sample: temperature"):
        ks.sample(x, so, 10 ** 400, 3, 0.5)
    with pytest.raises(ValueError, match=r"sample: top_p .*got 1\.0000000000000002"):
        ks.sample(x, so, 0.5, 3, float(np.nextafter(1.0, 2.0)))
    q = rand(rng, (3, 2, 16), "fp32")
    pos = np.array([1, 2, 3], np.int32)
    # integer arguments past int64 (other than top_k's clamp): named, not nanobind's signature error
    with pytest.raises(ValueError, match="rotary_embedding: rotary_dim = 18446744073709551616 is outside int64"):
        ks.rotary_embedding(q, None, pos, 2 ** 64)
    kc = np.ones((1, 4, 2, 16), np.float32)
    with pytest.raises(ValueError, match="paged_attention: fresh_keys = 9223372036854775808 is outside int64"):
        ks.paged_attention(q, kc, kc, np.zeros((3, 1), np.int32), np.zeros(3, np.int32), fresh_keys=2 ** 63)
    with pytest.raises(TypeError, match="rotary_embedding: theta must be a number"):
        ks.rotary_embedding(q, None, pos, 16, "100")
    with pytest.raises(TypeError, match="rotary_embedding: rotary_dim must be an integer"):
        ks.rotary_embedding(q, None, pos, 16.0)
    w = rand(rng, (16,), "fp32")
    with pytest.raises(TypeError, match="rms_norm: eps must be a number"):
        ks.rms_norm(q, w, "1e-6")
    with pytest.raises(TypeError, match="fused_add_rms_norm: eps must be a number"):
        ks.fused_add_rms_norm(q.copy(), q.copy(), w, None)


@pytest.mark.parametrize("dt", DTYPES)
def test_sample_reproducible_valid_and_cutoffs(rng, dt):
    x = rand(rng, (5, 300), dt)
    so = np.array([2024, 7], np.int64)
    a = ks.sample(x, so, 0.9, 20, 0.8)
    b = ks.sample(x, so, 0.9, 20, 0.8)
    assert a.dtype == np.int64 and a.shape == (5,)
    assert np.array_equal(a, b)
    # every id is among the row's 20 largest logits (top_k)
    xf = f64(x)
    for r in range(5):
        assert xf[r, a[r]] >= np.sort(xf[r])[-20]
    # top_k = 1 is the argmax
    assert np.array_equal(ks.sample(x, so, 1.0, 1), ks.argmax(x))
    # invalid rows: placeholder 0 and valid = 0; the others valid = 1
    y = x.copy()
    y[1, 3] = np.nan
    y[3, :] = -np.inf
    valid = np.full(5, 7, np.uint8)
    ids = ks.sample(y, so, valid=valid)
    assert list(valid) == [1, 0, 1, 0, 1] and ids[1] == 0 and ids[3] == 0
    # offsets change the draws
    draws = {tuple(ks.sample(x, np.array([2024, o], np.int64), 1.0)) for o in range(10)}
    assert len(draws) > 5


def test_sample_leading_dims(rng):
    # [..., vocab] -> [...]: row r of the leading dims' row-major order draws counter (offset, r),
    # so a [2, 3, vocab] call equals its [6, vocab] reshape id for id, valid flags included
    x = rand(rng, (2, 3, 300), "bf16")
    x[1, 0, 7] = np.nan
    so = np.array([11, 5], np.int64)
    valid = np.full((2, 3), 9, np.uint8)
    ids = ks.sample(x, so, 0.8, 40, 0.9, valid=valid)
    assert ids.shape == (2, 3) and valid.shape == (2, 3)
    flat_valid = np.full(6, 9, np.uint8)
    flat = ks.sample(x.reshape(6, 300), so, 0.8, 40, 0.9, valid=flat_valid)
    assert np.array_equal(ids.reshape(6), flat) and np.array_equal(valid.reshape(6), flat_valid)
    assert list(flat_valid) == [1, 1, 1, 0, 1, 1]
    # one row of [vocab]: a 0-d id, row 0's draw
    one = ks.sample(x[0, 2], so, 0.8, 40, 0.9)
    assert one.shape == () and int(one) == int(ks.sample(x[0, 2][None], so, 0.8, 40, 0.9)[0])
    with pytest.raises(ValueError, match="sample: valid must have shape"):
        ks.sample(x, so, valid=np.zeros(6, np.uint8))


def test_sample_validation(rng):
    x = rand(rng, (2, 16), "fp32")
    so = np.array([1, 2], np.int64)
    out = np.full(2, -5, np.int64)
    for kw, msg in [({"temperature": -1.0}, "sample: temperature"), ({"top_k": -2}, "sample: top_k"),
                    ({"top_p": 0.0}, "sample: top_p"), ({"top_p": 1.5}, "sample: top_p")]:
        with pytest.raises(ValueError, match=msg):
            ks.sample(x, so, out=out, **kw)
    # past int64: the value passed in the message, not the clamped one
    with pytest.raises(ValueError, match=r"sample: top_k must be >= 0 \(0: off\); got -1180591620717411303424$"):
        ks.sample(x, so, out=out, top_k=-2 ** 70)
    ks.sample(x, so, out=np.empty(2, np.int64), top_k=2 ** 70)  # past int64 upward: off, as top_k >= vocab
    with pytest.raises(ValueError, match="sample: seed_offset must have shape"):
        ks.sample(x, np.array([1, 2, 3], np.int64), out=out)
    with pytest.raises(TypeError, match="sample: seed_offset"):
        ks.sample(x, np.array([1, 2], np.int32), out=out)
    assert list(out) == [-5, -5]
