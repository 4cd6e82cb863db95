"""torch integration on the CPU: torch tensors in and out, backend="torch" (the
contracts in PyTorch, with autograd), torch.library custom ops and
torch.compile(fullgraph=True). Skipped when torch is not installed."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from conftest import (DTYPES, QNAMES, TOL, U, assert_close, f64, make_packed, ref_dequantize, ref_norm_input,
                      ref_quant_matmul_a8, ref_rms_norm, ref_rounded_matmul, ref_silu_and_mul)

torch = pytest.importorskip("torch")
import kernscope as ks  # noqa: E402
import torch.nn.functional as F  # noqa: E402

TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def trand(shape, dt, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(TORCH[dt])


def to_np(t):
    return t.detach().float().numpy().astype(np.float64)


def close(a, b, dt, what=""):
    assert_close(to_np(a), to_np(b), dt, extra=TOL[dt] * 2 * np.abs(to_np(b)), what=what)


# ---- torch in, torch out; native == reference -----------------------------------------------
@pytest.mark.parametrize("dt", DTYPES)
def test_core_ops_torch_tensors(dt):
    x = trand((3, 64), dt, seed=1)
    w = trand((64,), dt, seed=2)
    for fn in (lambda b: ks.rms_norm(x, w, 1e-5, backend=b), lambda b: ks.silu_and_mul(x, backend=b),
               lambda b: ks.gemv(x[0], w.expand(5, 64).contiguous(), backend=b), lambda b: ks.softmax(x, backend=b)):
        y = fn("auto")
        assert isinstance(y, torch.Tensor) and y.dtype == TORCH[dt] and y.device.type == "cpu"
        assert torch.equal(y, fn("cpu"))
        close(y, fn("torch"), dt)
    # the same native code as for numpy arrays: identical bits
    if dt != "bf16":  # (torch cannot hand bf16 to numpy)
        assert np.array_equal(ks.rms_norm(x, w, 1e-5).numpy(), ks.rms_norm(x.numpy(), w.numpy(), 1e-5))
    assert_close(to_np(ks.rms_norm(x, w, 1e-5)), ref_rms_norm(to_np(x), to_np(w), 1e-5), dt)


@pytest.mark.parametrize("dt", DTYPES)
def test_fused_add_rms_norm_torch_in_place(dt):
    x, r, w = trand((4, 32), dt, seed=3), trand((4, 32), dt, seed=4), trand((32,), dt, seed=5)
    x2, r2 = x.clone(), r.clone()
    ptr = x.data_ptr()
    assert ks.fused_add_rms_norm(x, r, w) is None
    assert x.data_ptr() == ptr
    ks.fused_add_rms_norm(x2, r2, w, backend="torch")
    close(x, x2, dt, "x")
    close(r, r2, dt, "residual")


@pytest.mark.parametrize("dt", DTYPES)
def test_model_ops_native_vs_torch_reference(dt):
    g = torch.Generator().manual_seed(7)
    rng = np.random.default_rng(7)
    # argmax, embedding, gemm
    x = trand((4, 100), dt, seed=8)
    assert torch.equal(ks.argmax(x), ks.argmax(x, backend="torch"))
    assert torch.equal(ks.argmax(x[2]), torch.argmax(x[2].double())) and ks.argmax(x[2]).shape == ()
    assert torch.equal(ks.argmax(x[2], backend="torch"), ks.argmax(x[2]))
    table = trand((20, 16), dt, seed=9)
    ids = torch.randint(0, 20, (2, 3), generator=g)
    assert torch.equal(ks.embedding(ids, table), ks.embedding(ids, table, backend="torch"))
    a, b = trand((5, 24), dt, seed=10), trand((7, 24), dt, seed=11)
    close(ks.gemm(a, b), ks.gemm(a, b, backend="torch"), dt, "gemm")
    # packed formats
    for q, name in QNAMES.items():
        packed = torch.from_numpy(make_packed(rng, 6, 64, q))
        close(ks.dequantize(packed, name, dtype=dt), ks.dequantize(packed, name, dtype=dt, backend="torch"), dt, name)
        xx = trand((3, 64), dt, seed=q)
        close(ks.quant_matmul(xx, packed, name), ks.quant_matmul(xx, packed, name, backend="torch"), dt, name)
        e1 = ks.embedding(torch.tensor([5, 0, 2]), packed, table_format=name, dtype=TORCH[dt])
        e2 = ks.embedding(torch.tensor([5, 0, 2]), packed, table_format=name, dtype=dt, backend="torch")
        assert e1.dtype == TORCH[dt]
        close(e1, e2, dt, "embedding " + name)
    # rotary (in place), both pairings, q and k
    for neox in (True, False):
        q, k = trand((3, 4, 32), dt, seed=12), trand((3, 2, 32), dt, seed=13)
        q2, k2 = q.clone(), k.clone()
        pos = torch.tensor([0, 5, 1000])
        ks.rotary_embedding(q, k, pos, 16, 10000.0, neox)
        ks.rotary_embedding(q2, k2, pos, 16, 10000.0, neox, backend="torch")
        close(q, q2, dt, "rotary q")
        close(k, k2, dt, "rotary k")
    # kv cache + paged attention (GQA, prefill through seq_ids)
    kc, vc = torch.zeros(4, 4, 2, 16, dtype=TORCH[dt]), torch.zeros(4, 4, 2, 16, dtype=TORCH[dt])
    kc2, vc2 = kc.clone(), vc.clone()
    k, v = trand((6, 2, 16), dt, seed=14), trand((6, 2, 16), dt, seed=15)
    slots = torch.tensor([8, 9, 10, 11, 0, 1])  # blocks 2 then 0
    ks.kv_cache_append(kc, vc, k, v, slots)
    ks.kv_cache_append(kc2, vc2, k, v, slots, backend="torch")
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    q = trand((6, 4, 16), dt, seed=16)
    bt = torch.tensor([[2, 0]], dtype=torch.int32)
    seq = torch.zeros(6, dtype=torch.int32)
    ctx = torch.arange(1, 7, dtype=torch.int32)
    o1 = ks.paged_attention(q, kc, vc, bt, ctx, seq_ids=seq)
    o2 = ks.paged_attention(q, kc, vc, bt, ctx, seq_ids=seq, backend="torch")
    close(o1, o2, dt, "paged_attention")
    # varlen attention: packed sequences (an empty one, chunked lq < lk, lq > lk), causal and not
    cq = torch.tensor([0, 3, 3, 5, 9], dtype=torch.int32)
    ck = torch.tensor([0, 3, 3, 10, 11], dtype=torch.int32)
    q, k, v = trand((9, 4, 16), dt, seed=17), trand((11, 2, 16), dt, seed=18), trand((11, 2, 16), dt, seed=19)
    for causal in (True, False):
        o1 = ks.varlen_attention(q, k, v, cq, ck, causal=causal)
        o2 = ks.varlen_attention(q, k, v, cq, ck, causal=causal, backend="torch")
        close(o1, o2, dt, f"varlen_attention causal={causal}")
    # a NaN in the last V row of a sequence reaches only the queries that see that key
    cq = torch.tensor([0, 4], dtype=torch.int32)
    q, k, v = trand((4, 2, 8), dt, seed=23), trand((4, 1, 8), dt, seed=24), trand((4, 1, 8), dt, seed=25)
    v[3, 0, 5] = float("nan")
    for backend in ("auto", "torch"):
        o = ks.varlen_attention(q, k, v, cq, cq, backend=backend)
        assert torch.isfinite(o[:3]).all(), backend
        assert torch.isnan(o[3, :, 5]).all() and torch.isfinite(o[3, :, :5]).all(), backend
    # the same causal prefill through SDPA (lq == lk: its is_causal mask is the lower triangle)
    cq = torch.tensor([0, 4, 11], dtype=torch.int32)
    q, k, v = trand((11, 4, 16), dt, seed=20), trand((11, 2, 16), dt, seed=21), trand((11, 2, 16), dt, seed=22)
    o = ks.varlen_attention(q, k, v, cq, cq).float()
    for a, b in ((0, 4), (4, 11)):
        want = F.scaled_dot_product_attention(q[a:b].float().transpose(0, 1), k[a:b].float().repeat_interleave(2, 1)
                                              .transpose(0, 1), v[a:b].float().repeat_interleave(2, 1).transpose(0, 1),
                                              is_causal=True).transpose(0, 1)
        close(o[a:b].to(TORCH[dt]), want.to(TORCH[dt]), dt, "varlen_attention vs SDPA")


@pytest.mark.parametrize("dt", DTYPES)
def test_quant_matmul_fusions_native_and_torch_reference_vs_fp64(dt):
    # both implementations of each contract against the FP64 numpy reference (weight decoded
    # in numpy; h rounded to dt between the norm / activation and the matmul)
    rng = np.random.default_rng(3)
    k, n = 64, 7
    for q, name in QNAMES.items():
        packed = make_packed(rng, n, k, q)
        wd = ref_dequantize(packed, q)
        w = torch.from_numpy(packed)
        x, r, nw = trand((3, k), dt, seed=30 + q), trand((3, k), dt, seed=40 + q), trand((k,), dt, seed=50 + q)
        s, h = ref_norm_input(to_np(x), to_np(r), to_np(nw), 1e-6)
        ref, extra = ref_rounded_matmul(h, wd, dt, (8 * math.sqrt(k) + 16) * U)
        _, h0 = ref_norm_input(None, to_np(r), to_np(nw), 1e-6)
        ref0, extra0 = ref_rounded_matmul(h0, wd, dt, (8 * math.sqrt(k) + 16) * U)
        res = {}
        for backend in ("auto", "torch"):
            out, res[backend] = ks.fused_add_rms_norm_quant_matmul(x, r, nw, w, name, backend=backend)
            assert isinstance(out, torch.Tensor) and out.dtype == TORCH[dt] and out.shape == (3, n)
            assert_close(to_np(out), ref, dt, extra=extra, what=f"fused norm {name} {backend}")
            assert_close(to_np(res[backend]), s, dt, what=f"residual_out {name} {backend}")
            out0 = ks.fused_add_rms_norm_quant_matmul(None, r, nw, w, name, backend=backend)
            assert_close(to_np(out0), ref0, dt, extra=extra0, what=f"fused norm, no x, {name} {backend}")
        assert torch.equal(res["auto"], res["torch"])  # one rounding of the same FP32 sum
        gu = trand((3, 2 * k), dt, seed=60 + q)
        sref, sextra = ref_rounded_matmul(ref_silu_and_mul(to_np(gu)), wd, dt, 16 * U)
        for backend in ("auto", "torch"):
            y = ks.silu_and_mul_quant_matmul(gu, w, name, backend=backend)
            assert y.dtype == TORCH[dt] and y.shape == (3, n)
            assert_close(to_np(y), sref, dt, extra=sextra, what=f"silu {name} {backend}")


def _a8_input(dt, k, seed):
    """x [5, k] (k >= 96) with the contract's special blocks: a NaN in row 1, -inf in row 2, an
    all-zero and a tiny (max < 1.5e-36) block in row 3, ties to even at d = 1 in row 4."""
    x = trand((5, k), dt, seed=seed)
    x[:, 32:64] *= 100
    x[1, 40] = float("nan")
    x[2, 70] = -float("inf")
    x[3, :32] = 0
    x[3, 32:64] = trand((32,), dt, scale=1e-37, seed=seed + 1)
    x[4, :8] = torch.tensor([127, 0.5, 1.5, 2.5, -2.5, 3.5, -0.5, 4.5])
    return x


def _same_bits(a, b):
    """Equal bits, a NaN matching any NaN (its payload is not part of the contract)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan]) and \
        torch.equal(torch.signbit(a[~nan]), torch.signbit(b[~nan]))


@pytest.mark.parametrize("dt", DTYPES)
def test_quant_matmul_a8_native_and_torch_reference(dt):
    # the native CPU backend and the PyTorch reference (written from the contract independently)
    # against the FP64 numpy reference, and against each other bit for bit: the contract fixes
    # every rounding and the summation order
    rng = np.random.default_rng(11)
    k, n = 128, 9
    for q in (4, 5, 6):
        name = QNAMES[q]
        packed = make_packed(rng, n, k, q)
        w = torch.from_numpy(packed)
        x = _a8_input(dt, k, seed=70 + q)
        ref, extra = ref_quant_matmul_a8(to_np(x), packed, q)
        got = {}
        for backend in ("auto", "torch"):
            y = ks.quant_matmul_a8(x, w, name, backend=backend)
            assert isinstance(y, torch.Tensor) and y.dtype == TORCH[dt] and y.shape == (5, n)
            assert_close(to_np(y), ref, dt, extra=extra, what=f"quant_matmul_a8 {name} {backend}")
            got[backend] = y
        assert torch.isnan(got["auto"][1:3]).all() and torch.isfinite(got["auto"][[0, 3, 4]]).all()
        assert _same_bits(got["auto"], got["torch"]), name
        # out= is written through either backend
        for backend in ("auto", "torch"):
            out = torch.full((5, n), 7.0, dtype=TORCH[dt])
            assert ks.quant_matmul_a8(x, w, name, backend=backend, out=out) is out
            assert _same_bits(out, got["auto"]), f"{name} out= {backend}"


def test_quant_matmul_a8_torch_reference_validation_matches_native():
    x = trand((2, 64), "fp32")
    f = ks.quant_matmul_a8
    cases = [
        (ks.InvalidArgumentError, r"quant_matmul_a8: qtype must be an integer block format \(Q4_0, Q4_1 or Q8_0\); got F16 \(a dense",
         lambda b: f(x, torch.zeros(3, 128, dtype=torch.uint8), "f16", backend=b)),
        (ks.InvalidArgumentError, r"quant_matmul_a8: qtype must be an integer block format .*; got F32 \(a dense",
         lambda b: f(x, torch.zeros(3, 256, dtype=torch.uint8), ks.QType.F32, backend=b)),
        (ks.InvalidArgumentError, r"quant_matmul_a8: x's K \(columns\) = 48 is not a multiple",
         lambda b: f(x[:, :48].contiguous(), torch.zeros(3, 54, dtype=torch.uint8), "q4_0", backend=b)),
        (ks.InvalidArgumentError, "quant_matmul_a8: weight must have 68 bytes per row",
         lambda b: f(x, torch.zeros(3, 34, dtype=torch.uint8), "q8_0", backend=b)),
        (ks.InvalidArgumentError, "quant_matmul_a8: x must have at least 1 dims",
         lambda b: f(x[0, 0], torch.zeros(3, 36, dtype=torch.uint8), "q4_0", backend=b)),
        (ks.InvalidArgumentError, r"quant_matmul_a8: out must have shape \(2, 2, 3\)",  # x [..., K]: out [..., N]
         lambda b: f(x.view(2, 2, 32), torch.zeros(3, 18, dtype=torch.uint8), "q4_0", backend=b,
                     out=torch.zeros(4, 3))),
        (ks.UnsupportedDtypeError, "quant_matmul_a8: weight has dtype",
         lambda b: f(x, torch.zeros(3, 68, dtype=torch.int32), "q8_0", backend=b)),
    ]
    _assert_errors_match_native(cases)


def test_fused_quant_forms_torch_path_leading_dims():
    # the torch path of the two fused quant forms takes [..., K] / [..., 2K] as the native backend
    # does: the same shapes, values within the dtype's tolerance of it, zero rows empty, and out of
    # the reshape's shape refused in the same words
    rng = np.random.default_rng(6)
    K, N = 64, 5
    w = torch.from_numpy(make_packed(rng, N, K, 4))
    nw = trand((K,), "fp32")
    res, x, gu = trand((2, 3, K), "fp32"), trand((2, 3, K), "fp32"), trand((3, 2, 2 * K), "fp32")
    for backend in ("cpu", "torch"):
        y, ro = ks.fused_add_rms_norm_quant_matmul(x, res, nw, w, "q4_0", backend=backend)
        assert tuple(y.shape) == (2, 3, N) and tuple(ro.shape) == (2, 3, K), backend
        s = ks.silu_and_mul_quant_matmul(gu, w, "q4_0", backend=backend)
        assert tuple(s.shape) == (3, 2, N), backend
        z = torch.zeros(0, 3, K)
        assert tuple(ks.fused_add_rms_norm_quant_matmul(None, z, nw, w, "q4_0", backend=backend).shape) == (0, 3, N)
        assert tuple(ks.silu_and_mul_quant_matmul(torch.zeros(2, 0, 2 * K), w, "q4_0", backend=backend).shape) == (2, 0, N)
    yc, _ = ks.fused_add_rms_norm_quant_matmul(x, res, nw, w, "q4_0", backend="cpu")
    yt, _ = ks.fused_add_rms_norm_quant_matmul(x, res, nw, w, "q4_0", backend="torch")
    assert torch.allclose(yc, yt, rtol=1e-4, atol=1e-4)
    sc = ks.silu_and_mul_quant_matmul(gu, w, "q4_0", backend="cpu")
    st = ks.silu_and_mul_quant_matmul(gu, w, "q4_0", backend="torch")
    assert torch.allclose(sc, st, rtol=1e-4, atol=1e-4)
    cases = [
        (ks.InvalidArgumentError, r"fused_add_rms_norm_quant_matmul: out must have shape \(2, 3, 5\)",
         lambda be: ks.fused_add_rms_norm_quant_matmul(None, res, nw, w, "q4_0", backend=be, out=torch.zeros(6, N))),
        (ks.InvalidArgumentError, r"silu_and_mul_quant_matmul: out must have shape \(3, 2, 5\)",
         lambda be: ks.silu_and_mul_quant_matmul(gu, w, "q4_0", backend=be, out=torch.zeros(6, N))),
    ]
    _assert_errors_match_native(cases)


def test_linear_ops_torch_path_zero_rows_and_out_checks():
    # the torch path of the linear ops: zero leading dims give an empty [..., N] as the native
    # backend does (quant_matmul_a8's reference once reshaped to (*lead, -1), which an empty lead
    # cannot take), and out= is checked as natively (copy_ alone broadcast a smaller result into a
    # larger out and cast into another dtype), in the same words
    rng = np.random.default_rng(5)
    K, N = 64, 5
    w = torch.from_numpy(make_packed(rng, N, K, 4))
    b = trand((N, K), "fp32")
    calls = [("gemm", lambda v, **kw: ks.gemm(v, b, **kw)),
             ("quant_matmul", lambda v, **kw: ks.quant_matmul(v, w, "q4_0", **kw)),
             ("quant_matmul_a8", lambda v, **kw: ks.quant_matmul_a8(v, w, "q4_0", **kw))]
    for name, f in calls:
        for shape in ((0, 3, K), (2, 0, K), (0, K)):
            for backend in ("cpu", "torch"):
                y = f(torch.zeros(shape), backend=backend)
                assert tuple(y.shape) == shape[:-1] + (N,), (name, shape, backend)
        x = trand((2, 2, K), "fp32")
        cases = [
            (ks.InvalidArgumentError, rf"{name}: out must have shape \(2, 2, 5\)",
             lambda be: f(x, backend=be, out=torch.zeros(3, 2, 2, N))),  # (y broadcasts into it)
            (ks.InvalidArgumentError, rf"{name}: out must have shape \(5,\)",
             lambda be: f(x[0, 0], backend=be, out=torch.zeros(3, N))),
            (ks.UnsupportedDtypeError, rf"{name}: out has unsupported dtype float64",
             lambda be: f(x, backend=be, out=torch.zeros(2, 2, N, dtype=torch.float64))),
            (ks.UnsupportedDtypeError, rf"{name}: out has dtype fp16 but (x|a) has fp32",
             lambda be: f(x, backend=be, out=torch.zeros(2, 2, N, dtype=torch.float16))),
            (ks.InvalidArgumentError, rf"{name}: out must be contiguous",
             lambda be: f(x, backend=be, out=torch.zeros(2, N, 2).transpose(1, 2))),
        ]
        _assert_errors_match_native(cases)


def test_torch_path_out_dtype_decides_for_packed_outputs():
    # dequantize and embedding of packed blocks write in out's dtype when out is given (the
    # native rule): the torch path computes in it, so _finish's out check accepts it
    packed = torch.from_numpy(make_packed(np.random.default_rng(8), 6, 64, 6))
    ids = torch.tensor([[1, 5], [0, 2]])
    for dt in DTYPES:
        for backend in ("cpu", "torch"):
            o = torch.full((6, 64), 7.0, dtype=TORCH[dt])
            assert ks.dequantize(packed, "q8_0", out=o, backend=backend) is o
            assert _same_bits(o, ks.dequantize(packed, "q8_0", dtype=dt, backend="cpu")), (dt, backend)
            e = torch.full((2, 2, 64), 7.0, dtype=TORCH[dt])
            assert ks.embedding(ids, packed, table_format="q8_0", out=e, backend=backend) is e
            assert _same_bits(e, ks.embedding(ids, packed, table_format="q8_0", dtype=dt, backend="cpu")), (dt, backend)


def test_quant_matmul_a8_autograd_routes_to_reference():
    x = trand((2, 64), "fp32").requires_grad_()
    w = torch.from_numpy(make_packed(np.random.default_rng(0), 3, 64, 4))
    y = ks.quant_matmul_a8(x, w, "q4_0")  # auto: the PyTorch reference
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    with torch.no_grad():
        assert torch.equal(y, ks.quant_matmul_a8(x, w, "q4_0", backend="cpu"))
    with pytest.raises(RuntimeError, match="quant_matmul_a8: x requires grad"):
        ks.quant_matmul_a8(x, w, "q4_0", backend="cpu")


def _assert_errors_match_native(cases):
    """Each case (exception class, message pattern, call(backend)): the native CPU backend and the
    PyTorch reference both raise it, with the same message."""
    for exc, pattern, call in cases:
        msgs = []
        for backend in ("cpu", "torch"):
            with pytest.raises(exc, match=pattern) as e:
                call(backend)
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1], msgs


def _call_writing_nothing_on_error(f, args, outputs, backend):
    """f(**args, backend=backend), then: every tensor named in outputs is as it was (whether f
    raised or not: the callers expect it to raise)."""
    before = {n: args[n].clone() for n in outputs if args[n] is not None}
    try:
        f(**args, backend=backend)
    finally:
        for n, t in before.items():
            assert torch.equal(args[n], t), f"{n} was written after an error ({backend})"


def test_quant_matmul_fusions_torch_reference_validation_matches_native():
    # the same exception class and the same message from the native backend and the reference
    x, r, nw = trand((2, 32), "fp32"), trand((2, 32), "fp32", seed=1), trand((32,), "fp32", seed=2)
    w = torch.zeros(3, 34, dtype=torch.uint8)
    f, s = ks.fused_add_rms_norm_quant_matmul, ks.silu_and_mul_quant_matmul
    cases = [
        (ks.InvalidArgumentError, "fused_add_rms_norm_quant_matmul: residual_out is given but x is missing",
         lambda b: f(None, r, nw, w, "q8_0", residual_out=torch.empty(2, 32), backend=b)),
        (ks.InvalidArgumentError, r"fused_add_rms_norm_quant_matmul: norm_weight must have shape \(32,\)",
         lambda b: f(x, r, nw[:31], w, "q8_0", backend=b)),
        (ks.InvalidArgumentError, r"fused_add_rms_norm_quant_matmul: x must have shape \(2, 32\)",
         lambda b: f(trand((3, 32), "fp32"), r, nw, w, "q8_0", backend=b)),
        (ks.UnsupportedDtypeError, "fused_add_rms_norm_quant_matmul: x has dtype fp16",
         lambda b: f(x.half(), r, nw, w, "q8_0", backend=b)),
        (ks.InvalidArgumentError, "fused_add_rms_norm_quant_matmul: weight must have 34 bytes per row",
         lambda b: f(x, r, nw, torch.zeros(3, 35, dtype=torch.uint8), "q8_0", backend=b)),
        (ks.InvalidArgumentError, "fused_add_rms_norm_quant_matmul: eps",
         lambda b: f(None, r, nw, w, "q8_0", -1.5, backend=b)),
        (ks.InvalidArgumentError, "fused_add_rms_norm_quant_matmul: residual_out and residual overlap",
         lambda b: f(x, r, nw, w, "q8_0", residual_out=r, backend=b)),
        (ks.InvalidArgumentError, "silu_and_mul_quant_matmul: gate_up's last dimension must be even",
         lambda b: s(trand((2, 63), "fp32"), w, "q8_0", backend=b)),
        (ks.InvalidArgumentError, r"silu_and_mul_quant_matmul: gate_up's K \(half its columns\) = 16 is not a multiple",
         lambda b: s(x, w, "q8_0", backend=b)),
        (ks.InvalidArgumentError, "silu_and_mul_quant_matmul: weight must have 34 bytes per row",
         lambda b: s(trand((2, 64), "fp32"), torch.zeros(3, 68, dtype=torch.uint8), "q8_0", backend=b)),
    ]
    _assert_errors_match_native(cases)


def test_quant_matmul_fusions_autograd_routes_to_reference():
    gu = trand((2, 64), "fp32").requires_grad_()
    w = torch.from_numpy(make_packed(np.random.default_rng(0), 3, 32, 6))
    ks.silu_and_mul_quant_matmul(gu, w, "q8_0").sum().backward()  # auto: the PyTorch reference
    assert gu.grad is not None and gu.grad.shape == gu.shape
    with pytest.raises(RuntimeError, match="silu_and_mul_quant_matmul: gate_up requires grad"):
        ks.silu_and_mul_quant_matmul(gu, w, "q8_0", backend="cpu")
    r = trand((2, 32), "fp32").requires_grad_()
    out, res = ks.fused_add_rms_norm_quant_matmul(trand((2, 32), "fp32", seed=1), r, trand((32,), "fp32", seed=2), w,
                                                  "q8_0")
    (out.sum() + res.sum()).backward()
    assert r.grad is not None


def _rope_kv_inputs(dt, seed=0):
    # q, k, v, positions (int32), k_cache, v_cache (random: untouched rows are compared too), slot_mapping
    return (trand((5, 4, 32), dt, seed=seed), trand((5, 2, 32), dt, seed=seed + 1), trand((5, 2, 32), dt, seed=seed + 2),
            torch.tensor([0, 7, 4095, 100000, 3], dtype=torch.int32), trand((3, 4, 2, 32), dt, seed=seed + 3),
            trand((3, 4, 2, 32), dt, seed=seed + 4), torch.tensor([9, -1, 0, 11, 2]))


@pytest.mark.parametrize("dt", DTYPES)
def test_rotary_embedding_kv_append_native_and_torch_reference(dt):
    # each implementation bit for bit its own rotary_embedding then kv_cache_append; the two
    # implementations within the rotation's tolerance of each other
    for neox in (True, False):
        got = {}
        for backend in ("auto", "torch"):
            q, k, v, pos, kc, vc, slots = _rope_kv_inputs(dt)
            q2, k2, kc2, vc2 = q.clone(), k.clone(), kc.clone(), vc.clone()
            assert ks.rotary_embedding_kv_append(q, k, v, pos, kc, vc, slots, 16, 5e5, neox, backend=backend) is None
            ks.rotary_embedding(q2, k2, pos, 16, 5e5, neox, backend=backend)
            ks.kv_cache_append(kc2, vc2, k2, v, slots, backend=backend)
            for name, a, b in (("q", q, q2), ("k", k, k2), ("k_cache", kc, kc2), ("v_cache", vc, vc2)):
                assert torch.equal(a, b), f"{backend} {name}"
            got[backend] = (q, k, kc, vc)
        for name, a, b in zip(("q", "k", "k_cache", "v_cache"), got["auto"], got["torch"]):
            close(a, b, dt, f"native vs torch {name} neox={neox}")


def _slots_inside(t):
    s = t.view(-1)[:10].view(torch.int64)  # 5 int64 slots over k's first 10 floats
    s.copy_(torch.tensor([1, 3, 0, 7, 2]))  # no -1: its bits would be NaN floats in k
    return s


def test_fused_norm_quant_matmul_torch_reference_checks_out_before_writing():
    # found in review: the reference wrote residual_out, then failed on out's shape
    rng = np.random.default_rng(5)
    M, N, K = 2, 5, 64
    w = torch.from_numpy(make_packed(rng, N, K, 3))  # Q4_1
    x, r, nw = trand((M, K), "fp32", seed=1), trand((M, K), "fp32", seed=2), trand((K,), "fp32", seed=3)
    for backend in ("cpu", "torch"):
        ro = torch.full((M, K), float("nan"))
        with pytest.raises(ks.InvalidArgumentError, match=r"out must have shape \(2, 5\)"):
            ks.fused_add_rms_norm_quant_matmul(x, r, nw, w, 3, 1e-6, backend=backend, out=torch.empty(3, N),
                                               residual_out=ro)
        assert torch.isnan(ro).all(), f"residual_out written after an error ({backend})"
        buf = torch.empty(M, K)
        with pytest.raises(ks.InvalidArgumentError, match="out and residual_out overlap"):
            ks.fused_add_rms_norm_quant_matmul(x, r, nw, w, 3, 1e-6, backend=backend,
                                               out=buf.view(-1)[:M * N].view(M, N), residual_out=buf)


def test_rotary_embedding_kv_append_torch_reference_validation_matches_native():
    op = "rotary_embedding_kv_append"
    f = ks.rotary_embedding_kv_append

    def call(backend, **kw):
        q, k, v, pos, kc, vc, slots = _rope_kv_inputs("fp32", seed=40)
        args = dict(q=q, k=k, v=v, positions=pos, k_cache=kc, v_cache=vc, slot_mapping=slots, rotary_dim=16)
        args.update({name: fn(args) for name, fn in kw.items()})
        _call_writing_nothing_on_error(f, args, ("q", "k", "k_cache", "v_cache"), backend)

    cases = [
        (ks.InvalidArgumentError, rf"{op}: k is missing", dict(k=lambda a: None)),
        (ks.InvalidArgumentError, rf"{op}: v and k overlap in memory", dict(v=lambda a: a["k"])),
        (ks.InvalidArgumentError, rf"{op}: rotary_dim must be even and in \(0, head_dim=32\]; got 3",
         dict(rotary_dim=lambda a: 3)),
        (ks.InvalidArgumentError, rf"{op}: slot_mapping\[3\] = 12 is outside \[-1, 12\)",
         dict(slot_mapping=lambda a: torch.tensor([9, -1, 0, 12, 2]))),
        (ks.InvalidArgumentError, rf"{op}: k_cache and q overlap in memory",
         dict(k_cache=lambda a: a["q"].view(-1)[:512].view(2, 4, 2, 32), v_cache=lambda a: torch.zeros(2, 4, 2, 32),
              slot_mapping=lambda a: torch.tensor([1, -1, 0, 7, 2]))),
        (ks.InvalidArgumentError, rf"{op}: v and q overlap in memory", dict(v=lambda a: a["q"].view(-1)[:320].view(5, 2, 32))),
        (ks.InvalidArgumentError, rf"{op}: positions must have shape \(5,\)", dict(positions=lambda a: torch.arange(6))),
        (ks.UnsupportedDtypeError, rf"{op}: v has dtype fp16 but k has fp32", dict(v=lambda a: a["v"].half())),
        # slot_mapping inside k, holding valid slots: the rotation would rewrite them (found in review)
        (ks.InvalidArgumentError, rf"{op}: slot_mapping and k overlap in memory",
         dict(slot_mapping=lambda a: _slots_inside(a["k"]))),
    ]
    _assert_errors_match_native([(exc, pattern, lambda b, kw=kw: call(b, **kw)) for exc, pattern, kw in cases])


def _norm_rope_inputs(dt, with_x=True, seed=0):
    # one token: x (or None), residual, norm_weight, a Q8_0 weight for H 4 + 2 KVH 2 heads of D 32 (K 64),
    # positions (int32), k_cache, v_cache (random: untouched rows are compared too), slot_mapping
    w = torch.from_numpy(make_packed(np.random.default_rng(seed), 8 * 32, 64, 6))
    return (trand((1, 64), dt, seed=seed) if with_x else None, trand((1, 64), dt, seed=seed + 1),
            trand((64,), dt, seed=seed + 2), w, torch.tensor([4095], dtype=torch.int32),
            trand((3, 4, 2, 32), dt, seed=seed + 3), trand((3, 4, 2, 32), dt, seed=seed + 4), torch.tensor([9]))


@pytest.mark.parametrize("dt", DTYPES)
def test_fused_add_rms_norm_quant_matmul_rope_kv_append_native_and_torch_reference(dt):
    # each implementation bit for bit its own fused_add_rms_norm_quant_matmul then
    # rotary_embedding_kv_append on out's q / k / v slices; the two within tolerance of each other
    H, KVH, D = 4, 2, 32
    for with_x in (True, False):
        for neox in (True, False):
            got = {}
            for backend in ("auto", "torch"):
                x, r, nw, w, pos, kc, vc, slots = _norm_rope_inputs(dt, with_x)
                kc2, vc2 = kc.clone(), vc.clone()
                y = ks.fused_add_rms_norm_quant_matmul_rope_kv_append(x, r, nw, w, "q8_0", H, KVH, pos, kc, vc, slots,
                                                                      1e-5, 16, 5e5, neox, backend=backend)
                y2 = ks.fused_add_rms_norm_quant_matmul(x, r, nw, w, "q8_0", 1e-5, backend=backend)
                (out, res), (out2, res2) = (y, y2) if with_x else ((y, None), (y2, None))
                assert isinstance(out, torch.Tensor) and out.dtype == TORCH[dt] and out.shape == (1, 8 * D)
                ks.rotary_embedding_kv_append(out2[:, :H * D].view(1, H, D), out2[:, H * D:(H + KVH) * D].view(1, KVH, D),
                                              out2[:, (H + KVH) * D:].view(1, KVH, D), pos, kc2, vc2, slots, 16, 5e5,
                                              neox, backend=backend)
                for name, a, b in (("out", out, out2), ("residual_out", res, res2), ("k_cache", kc, kc2),
                                   ("v_cache", vc, vc2)):
                    assert (a is None and b is None) or torch.equal(a, b), f"{backend} {name}"
                got[backend] = (out, kc, vc)
            # the two matmuls may differ by an ulp of dt (FP32 sum order), which the rotation
            # mixes within a pair: allow dt's tolerance of the largest value, per tensor
            for name, a, b in zip(("out", "k_cache", "v_cache"), got["auto"], got["torch"]):
                assert_close(to_np(a), to_np(b), dt, extra=4 * TOL[dt] * np.abs(to_np(b)).max(),
                             what=f"native vs torch {name} x={with_x} neox={neox}")


def test_fused_add_rms_norm_quant_matmul_rope_kv_append_torch_reference_validation_matches_native():
    op = "fused_add_rms_norm_quant_matmul_rope_kv_append"
    f = ks.fused_add_rms_norm_quant_matmul_rope_kv_append

    def call(backend, **kw):
        x, r, nw, w, pos, kc, vc, slots = _norm_rope_inputs("fp32", seed=40)
        args = dict(x=x, residual=r, norm_weight=nw, weight=w, qtype="q8_0", num_heads=4, num_kv_heads=2,
                    positions=pos, k_cache=kc, v_cache=vc, slot_mapping=slots, rotary_dim=16,
                    out=torch.full((1, 256), 7.0), residual_out=torch.full((1, 64), 7.0))
        args.update({name: fn(args) for name, fn in kw.items()})
        _call_writing_nothing_on_error(f, args, ("out", "residual_out", "k_cache", "v_cache"), backend)

    cases = [
        (ks.InvalidArgumentError, rf"{op}: num_heads and num_kv_heads must be > 0; got 0 and 2",
         dict(num_heads=lambda a: 0)),
        (ks.InvalidArgumentError, rf"{op}: weight's 256 rows \(out's columns\) must be", dict(num_heads=lambda a: 3)),
        (ks.InvalidArgumentError, rf"{op}: residual has 2 rows; this fusion is a one-token decode step",
         dict(x=lambda a: trand((2, 64), "fp32"), residual=lambda a: trand((2, 64), "fp32", seed=1),
              out=lambda a: torch.full((2, 256), 7.0), residual_out=lambda a: torch.full((2, 64), 7.0))),
        (ks.InvalidArgumentError, rf"{op}: residual_out is given but x is missing", dict(x=lambda a: None)),
        (ks.InvalidArgumentError, rf"{op}: out must have shape \(1, 256\)", dict(out=lambda a: torch.full((1, 255), 7.0))),
        (ks.InvalidArgumentError, rf"{op}: rotary_dim must be even and in \(0, head_dim=32\]; got 34",
         dict(rotary_dim=lambda a: 34)),
        (ks.InvalidArgumentError, rf"{op}: positions must have shape \(1,\)", dict(positions=lambda a: torch.arange(2))),
        (ks.InvalidArgumentError, rf"{op}: slot_mapping\[0\] = 12 is outside \[-1, 12\)",
         dict(slot_mapping=lambda a: torch.tensor([12]))),
        (ks.InvalidArgumentError, rf"{op}: k_cache must have shape \(num_blocks, block_size, 2, 32\)",
         dict(k_cache=lambda a: torch.zeros(3, 4, 1, 32))),
        (ks.UnsupportedDtypeError, rf"{op}: v_cache has dtype fp16 but k has fp32", dict(v_cache=lambda a: a["v_cache"].half())),
        (ks.InvalidArgumentError, rf"{op}: k_cache and residual overlap in memory",
         dict(residual=lambda a: a["k_cache"].view(-1)[:64].view(1, 64))),
        (ks.InvalidArgumentError, rf"{op}: q and positions overlap in memory",
         dict(positions=lambda a: a["out"].view(-1)[:2].view(torch.int64)[:1])),
        (ks.InvalidArgumentError, rf"{op}: out and positions overlap in memory",
         dict(positions=lambda a: a["out"].view(-1)[200:202].view(torch.int64))),
    ]
    _assert_errors_match_native([(exc, pattern, lambda b, kw=kw: call(b, **kw)) for exc, pattern, kw in cases])


def _rope_attn_inputs(dt, seed=0, with_seq_ids=False):
    # q [4, 6, 16], k and v [4, 2, 16] (GQA), positions, k_cache and v_cache [6, 4, 2, 16] (random: untouched
    # rows are compared too), slot_mapping, block_tables, seq_ids, context_lens. seq_ids None: a decode step
    # (token t is the newest position of sequence t); given: three tokens of sequence 0 and one of sequence 1
    if with_seq_ids:
        bt, seq, ctx = torch.tensor([[5, 0], [3, 1]], dtype=torch.int32), torch.tensor([0, 0, 1, 0], dtype=torch.int32), \
            torch.tensor([5, 6, 2, 7], dtype=torch.int32)
        slots = torch.tensor([0, 1, 13, 2])
    else:
        bt, seq, ctx = torch.tensor([[5, 0], [3, 1], [2, 4], [1, 3]], dtype=torch.int32), None, \
            torch.tensor([5, 1, 8, 3], dtype=torch.int32)
        slots = torch.tensor([0, 12, 19, 6])
    return dict(q=trand((4, 6, 16), dt, seed=seed), k=trand((4, 2, 16), dt, seed=seed + 1),
                v=trand((4, 2, 16), dt, seed=seed + 2), positions=(ctx - 1).to(torch.int64),
                k_cache=trand((6, 4, 2, 16), dt, seed=seed + 3), v_cache=trand((6, 4, 2, 16), dt, seed=seed + 4),
                slot_mapping=slots, block_tables=bt, seq_ids=seq, context_lens=ctx)


@pytest.mark.parametrize("dt", DTYPES)
def test_rotary_embedding_kv_append_paged_attention_native_and_torch_reference(dt):
    # each implementation bit for bit its own rotary_embedding_kv_append then paged_attention (out, q,
    # k and both caches); the two implementations within tolerance of each other
    for with_seq_ids in (False, True):
        for neox in (True, False):
            got = {}
            for backend in ("auto", "torch"):
                a = _rope_attn_inputs(dt, with_seq_ids=with_seq_ids)
                b = {n: (t.clone() if t is not None else None) for n, t in a.items()}
                out = ks.rotary_embedding_kv_append_paged_attention(
                    a["q"], a["k"], a["v"], a["positions"], a["k_cache"], a["v_cache"], a["slot_mapping"],
                    a["block_tables"], a["context_lens"], 8, 5e5, neox, 0.3, seq_ids=a["seq_ids"], backend=backend)
                assert isinstance(out, torch.Tensor) and out.dtype == TORCH[dt] and out.shape == (4, 6, 16)
                ks.rotary_embedding_kv_append(b["q"], b["k"], b["v"], b["positions"], b["k_cache"], b["v_cache"],
                                              b["slot_mapping"], 8, 5e5, neox, backend=backend)
                out2 = ks.paged_attention(b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["context_lens"],
                                          0.3, seq_ids=b["seq_ids"], backend=backend)
                for name, x, y in (("out", out, out2), ("q", a["q"], b["q"]), ("k", a["k"], b["k"]),
                                   ("k_cache", a["k_cache"], b["k_cache"]), ("v_cache", a["v_cache"], b["v_cache"])):
                    assert torch.equal(x, y), f"{backend} {name} seq_ids={with_seq_ids} neox={neox}"
                got[backend] = (out, a["q"], a["k"], a["k_cache"], a["v_cache"])
            for name, x, y in zip(("out", "q", "k", "k_cache", "v_cache"), got["auto"], got["torch"]):
                close(x, y, dt, f"native vs torch {name} seq_ids={with_seq_ids} neox={neox}")


def test_rotary_embedding_kv_append_paged_attention_torch_reference_validation_matches_native():
    op = "rotary_embedding_kv_append_paged_attention"
    f = ks.rotary_embedding_kv_append_paged_attention

    def call(backend, **kw):
        args = _rope_attn_inputs("fp32", seed=40)
        args.update(rotary_dim=8, out=torch.full((4, 6, 16), 7.0))
        args.update({name: fn(args) for name, fn in kw.items()})
        _call_writing_nothing_on_error(f, args, ("out", "q", "k", "k_cache", "v_cache"), backend)

    cases = [
        (ks.InvalidArgumentError, rf"{op}: k is missing", dict(k=lambda a: None)),
        (ks.InvalidArgumentError, rf"{op}: v and k overlap in memory", dict(v=lambda a: a["k"])),
        (ks.InvalidArgumentError, rf"{op}: rotary_dim must be even and in \(0, head_dim=16\]; got 18",
         dict(rotary_dim=lambda a: 18)),
        (ks.InvalidArgumentError, rf"{op}: slot_mapping\[3\] = 24 is outside \[-1, 24\)",
         dict(slot_mapping=lambda a: torch.tensor([0, 12, 19, 24]))),
        (ks.InvalidArgumentError, rf"{op}: context_lens\[2\] = 9 is outside \[0, max_blocks_per_seq \* block_size = 8\]",
         dict(context_lens=lambda a: torch.tensor([5, 1, 9, 3], dtype=torch.int32))),
        (ks.InvalidArgumentError, rf"{op}: block_tables\[2, 1\] = 6 is outside \[0, 6\)",
         dict(block_tables=lambda a: torch.tensor([[5, 0], [3, 1], [2, 6], [1, 3]], dtype=torch.int32))),
        (ks.InvalidArgumentError, rf"{op}: seq_ids\[1\] = 4 is outside \[0, 4\)",
         dict(seq_ids=lambda a: torch.tensor([0, 4, 2, 3], dtype=torch.int32))),
        (ks.InvalidArgumentError, rf"{op}: num_heads \(6\) must be a multiple of num_kv_heads \(4\)",
         dict(k=lambda a: trand((4, 4, 16), "fp32"), v=lambda a: trand((4, 4, 16), "fp32", seed=1),
              k_cache=lambda a: torch.zeros(6, 4, 4, 16), v_cache=lambda a: torch.zeros(6, 4, 4, 16))),
        (ks.UnsupportedDtypeError, rf"{op}: block_tables has dtype int64",
         dict(block_tables=lambda a: a["block_tables"].long())),
        (ks.InvalidArgumentError, rf"{op}: out must have shape \(4, 6, 16\)",
         dict(out=lambda a: torch.full((4, 6, 8), 7.0))),
        (ks.InvalidArgumentError, rf"{op}: out and v overlap in memory",
         dict(v=lambda a: a["out"].view(-1)[:128].view(4, 2, 16))),
        (ks.InvalidArgumentError, rf"{op}: out and positions overlap in memory",
         dict(positions=lambda a: a["out"].view(-1)[:8].view(torch.int64)[:4])),
    ]
    _assert_errors_match_native([(exc, pattern, lambda b, kw=kw: call(b, **kw)) for exc, pattern, kw in cases])


def test_offset_views_and_strides():
    base = trand((5, 33), "fp32", seed=20)
    w = trand((33,), "fp32", seed=21)
    assert torch.equal(ks.rms_norm(base[1:], w), ks.rms_norm(base[1:].clone(), w))
    with pytest.raises(ValueError, match="rms_norm: x must be contiguous"):
        ks.rms_norm(base.t(), trand((5,), "fp32"))
    with pytest.raises(ValueError, match="rms_norm: x must be contiguous"):
        ks.rms_norm(base.t(), trand((5,), "fp32"), backend="torch")


def test_torch_reference_paged_attention_ignores_hidden_slots():
    """Positions past a token's context must not reach its sum: the torch reference gathers slot 0
    for them, so a NaN / inf there (an unused slot's garbage) would leak in through 0 * NaN; a
    context of 0 gives a zero row. Both backends, every token."""
    g = torch.Generator().manual_seed(7)
    kc, vc = torch.randn(3, 4, 2, 8, generator=g), torch.randn(3, 4, 2, 8, generator=g)
    vc[0, 0] = float("nan")
    kc[0, 1] = float("inf")
    q = torch.randn(3, 4, 8, generator=g)
    bt = torch.tensor([[1, 2], [2, 1], [1, 1]], dtype=torch.int32)
    ctx = torch.tensor([8, 3, 0], dtype=torch.int32)
    native = ks.paged_attention(q, kc, vc, bt, ctx)
    ref = ks.paged_attention(q, kc, vc, bt, ctx, backend="torch")
    assert torch.isfinite(ref).all(), ref
    assert torch.equal(ref[2], torch.zeros_like(ref[2]))
    assert (native - ref).abs().max() < 1e-5


def test_torch_reference_kv_cache_append_duplicate_slots_later_token_lands():
    """A slot listed by several tokens: the torch reference lands the later token's rows, as the CPU
    backend does (index_put alone promises no order), the skipped slot -1 aside."""
    kc, vc = torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8)
    k = torch.arange(6 * 2 * 8, dtype=torch.float32).view(6, 2, 8)
    v = -k
    slots = torch.tensor([3, -1, 3, 5, 3, 5])
    a, b, c, d = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    ks.kv_cache_append(a, b, k, v, slots)
    ks.kv_cache_append(c, d, k, v, slots, backend="torch")
    assert torch.equal(a, c) and torch.equal(b, d)
    assert torch.equal(c.view(8, 2, 8)[3], k[4]) and torch.equal(d.view(8, 2, 8)[5], v[5])


def test_torch_reference_dense_decode_of_offset_byte_views():
    """Dense weight formats as uint8 views at any byte offset (the contract allows them): the torch
    reference decodes them as the native backend does (a byte view at an odd storage offset cannot
    be reinterpreted as wider elements in place)."""
    buf = torch.randint(0, 256, (40,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    for off in (1, 2, 3):
        packed = buf[off:off + 32].view(2, 16)
        for qname in ("f32", "f16", "bf16"):
            a = ks.dequantize(packed, qname)
            b = ks.dequantize(packed, qname, backend="torch")
            torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True, msg=f"{qname} at byte offset {off}")
    x = torch.randn(3, 4)
    w = buf[1:33].view(2, 16)
    torch.testing.assert_close(ks.quant_matmul(x, w, "f32", backend="torch"), ks.quant_matmul(x, w, "f32"),
                               equal_nan=True)


def test_torch_backend_errors_match_native():
    x, w = trand((2, 8), "fp32"), trand((8,), "fp32")
    for backend in ("cpu", "torch"):
        with pytest.raises(ks.InvalidArgumentError, match=r"rms_norm: weight must have shape \(8,\)"):
            ks.rms_norm(x, w[:7], backend=backend)
        with pytest.raises(ks.UnsupportedDtypeError, match="rms_norm: weight has dtype fp16 but x has fp32"):
            ks.rms_norm(x, w.half(), backend=backend)
        with pytest.raises(ks.InvalidArgumentError, match="eps"):
            ks.rms_norm(x, w, 1e-50, backend=backend)
        with pytest.raises(ks.InvalidArgumentError, match="silu_and_mul: x's last dimension must be even"):
            ks.silu_and_mul(x[:, :7].contiguous(), backend=backend)
        with pytest.raises(ks.InvalidArgumentError, match="fused_add_rms_norm: x and residual overlap"):
            ks.fused_add_rms_norm(x, x, w, backend=backend)
        with pytest.raises(ks.InvalidArgumentError, match=r"embedding: ids\[1\] = 9 is outside"):
            ks.embedding(torch.tensor([0, 9]), trand((9, 4), "fp32"), backend=backend)


def test_cuda_backend_on_cpu_tensors():
    x, w = trand((2, 8), "fp32"), trand((8,), "fp32")
    with pytest.raises(RuntimeError):
        ks.rms_norm(x, w, backend="cuda")


# ---- autograd ------------------------------------------------------------------------------
def _grad_inputs(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_gradcheck(backend):
    x, w = _grad_inputs((3, 7), (7,), seed=1)
    assert torch.autograd.gradcheck(lambda a, b: ks.rms_norm(a, b, 1e-6, backend=backend), (x, w))
    (x2,) = _grad_inputs((3, 10), seed=2)
    assert torch.autograd.gradcheck(lambda a: ks.silu_and_mul(a, backend=backend), (x2,))
    v, m = _grad_inputs((6,), (4, 6), seed=3)
    assert torch.autograd.gradcheck(lambda a, b: ks.gemv(a, b, backend=backend), (v, m))
    (s,) = _grad_inputs((2, 5), seed=4)
    assert torch.autograd.gradcheck(lambda a: ks.softmax(a, backend=backend), (s,))


def test_gradients_flow_in_low_precision():
    x = trand((4, 16), "bf16").requires_grad_()
    w = trand((16,), "bf16").requires_grad_()
    ks.rms_norm(x, w).float().sum().backward()  # auto routes to the PyTorch reference
    assert x.grad is not None and w.grad is not None and x.grad.dtype == torch.bfloat16


def test_an_unexportable_tensor_gives_one_message():
    # torch's DLPack export refuses a meta tensor with its C++ stack after the message; the
    # error keeps the message alone (a new user's trial, 2026-12-05: ~20 lines of frames)
    x = torch.empty(2, 4, device="meta")
    with pytest.raises(TypeError, match="rms_norm: x cannot be exported through DLPack") as e:
        ks.rms_norm(x, torch.empty(4, device="meta"))
    assert "Exception raised from" not in str(e.value) and "frame #" not in str(e.value), str(e.value)


def test_native_backends_reject_requires_grad():
    x = trand((2, 8), "fp32").requires_grad_()
    w = torch.nn.Parameter(trand((8,), "fp32"))
    for backend in ("cpu", "cuda"):
        # (a KernscopeError like every other refusal, and a RuntimeError as documented)
        with pytest.raises(ks.BackendUnavailableError, match=f"rms_norm: x requires grad, and backend '{backend}' is inference-only"):
            ks.rms_norm(x, w, backend=backend)
    with pytest.raises(RuntimeError, match="gemv: weight requires grad"):
        ks.gemv(trand((8,), "fp32"), torch.nn.Parameter(trand((3, 8), "fp32")), backend="cpu")
    with torch.no_grad():  # inference with Parameters: the native backend
        y = ks.rms_norm(x, w, backend="cpu")
    assert not y.requires_grad
    assert torch.equal(y, ks.rms_norm(x.detach(), w.detach(), backend="cpu"))


def test_numpy_bf16_beside_a_torch_tensor():
    # every framework among a call's tensors prepares its own: numpy bf16 (ml_dtypes) as the
    # second argument or as out beside a torch bf16 x (only the first argument's was, before)
    ml = pytest.importorskip("ml_dtypes")
    x = trand((3, 8), "bf16", seed=3)
    w = trand((8,), "bf16", seed=4)
    want = ks.rms_norm(x, w, backend="cpu")
    w_np = w.view(torch.int16).numpy().view(ml.bfloat16)
    assert torch.equal(ks.rms_norm(x, w_np, backend="cpu"), want)
    out = np.full((3, 8), np.nan, ml.bfloat16)
    ks.rms_norm(x, w, out=out, backend="cpu")
    assert torch.equal(torch.from_numpy(out.view(np.int16)).view(torch.bfloat16), want)


def test_native_writes_bump_torch_version_counters():
    # as torch's own in-place ops: a backward through a value saved before a native in-place
    # write refuses instead of using the overwritten values
    a = trand((3, 8), "fp32", seed=5).requires_grad_()
    b = trand((3, 8), "fp32", seed=6)
    r = trand((3, 8), "fp32", seed=7)
    w = trand((8,), "fp32", seed=8)
    y = (a * b).sum()  # saves b for a's gradient
    v = b._version
    ks.fused_add_rms_norm(b, r, w, backend="cpu")
    assert b._version > v
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()
    # an input is not bumped
    x = trand((3, 8), "fp32", seed=9)
    vx = x._version
    ks.rms_norm(x, w, backend="cpu")
    assert x._version == vx


def test_autocast_keeps_fp32_contract():
    x, w = trand((16,), "fp32", seed=1), trand((8, 16), "fp32", seed=2)
    ref = ks.gemv(x, w, backend="torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ks.gemv(x, w, backend="torch")
        assert torch.is_autocast_enabled("cpu")
    assert y.dtype == torch.float32 and torch.equal(y, ref)


# ---- torch.library custom ops and torch.compile ---------------------------------------------------
def test_custom_ops_registered():
    for op in ks.OPS:
        assert hasattr(torch.ops.kernscope, op), op


@pytest.mark.parametrize("case", ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "gemv", "softmax", "argmax", "argmax_1d", "sample",
                                  "dequantize", "quant_matmul", "quant_matmul_a8", "fused_add_rms_norm_quant_matmul",
                                  "fused_add_rms_norm_quant_matmul_no_x", "silu_and_mul_quant_matmul",
                                  "rotary_embedding", "kv_cache_append", "rotary_embedding_kv_append",
                                  "fused_add_rms_norm_quant_matmul_rope_kv_append",
                                  "fused_add_rms_norm_quant_matmul_rope_kv_append_no_x", "paged_attention",
                                  "rotary_embedding_kv_append_paged_attention",
                                  "rotary_embedding_kv_append_paged_attention_seq_ids", "varlen_attention"])
def test_opcheck(case):
    x, w = trand((3, 16), "fp32"), trand((16,), "fp32")
    rng = np.random.default_rng(0)
    ops = torch.ops.kernscope
    q8 = torch.from_numpy(make_packed(rng, 5, 32, 6))
    args = {
        "rms_norm": (ops.rms_norm, (x, w, 1e-6, "auto")),
        "fused_add_rms_norm": (ops.fused_add_rms_norm, (x.clone(), x.clone() + 1, w, 1e-6, "cpu")),
        "silu_and_mul": (ops.silu_and_mul, (x, "auto")),
        "gemv": (ops.gemv, (w, x, "auto")),
        "softmax": (ops.softmax, (x, "auto")),
        "argmax": (ops.argmax, (x, "auto")),
        "argmax_1d": (ops.argmax, (w, "auto")),
        "sample": (ops.sample, (x, torch.tensor([3, 4]), 0.8, 5, 0.9, "auto")),
        "dequantize": (ops.dequantize, (torch.from_numpy(make_packed(rng, 3, 64, 4)), 4, torch.bfloat16, "auto")),
        "quant_matmul": (ops.quant_matmul, (trand((3, 32), "fp32"), q8, 6, "auto")),
        "quant_matmul_a8": (ops.quant_matmul_a8, (trand((3, 32), "fp32"), q8, 6, "auto")),
        "fused_add_rms_norm_quant_matmul": (ops.fused_add_rms_norm_quant_matmul,
                                            (trand((3, 32), "fp32", seed=1), trand((3, 32), "fp32", seed=2),
                                             trand((32,), "fp32", seed=3), q8, 6, 1e-6, "cpu")),
        "fused_add_rms_norm_quant_matmul_no_x": (ops.fused_add_rms_norm_quant_matmul,
                                                 (None, trand((3, 32), "fp32", seed=2), trand((32,), "fp32", seed=3),
                                                  q8, 6, 1e-6, "auto")),
        "silu_and_mul_quant_matmul": (ops.silu_and_mul_quant_matmul, (trand((3, 64), "fp32"), q8, 6, "auto")),
        "rotary_embedding": (ops.rotary_embedding,
                             (trand((2, 2, 8), "fp32"), None, torch.tensor([1, 2]), 8, 10000.0, True, "auto")),
        "kv_cache_append": (ops.kv_cache_append, (torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4),
                                                  trand((2, 1, 4), "fp32"), trand((2, 1, 4), "fp32"),
                                                  torch.tensor([3, 0]), "auto")),
        "rotary_embedding_kv_append": (ops.rotary_embedding_kv_append,
                                       (trand((2, 2, 8), "fp32"), trand((2, 1, 8), "fp32", seed=1),
                                        trand((2, 1, 8), "fp32", seed=2), torch.tensor([1, 2]), torch.zeros(2, 2, 1, 8),
                                        torch.zeros(2, 2, 1, 8), torch.tensor([3, -1]), 4, 10000.0, False, "auto")),
        "fused_add_rms_norm_quant_matmul_rope_kv_append": (
            ops.fused_add_rms_norm_quant_matmul_rope_kv_append,
            (trand((1, 32), "fp32", seed=1), trand((1, 32), "fp32", seed=2), trand((32,), "fp32", seed=3),
             torch.from_numpy(make_packed(rng, 16, 32, 6)), 6, 1e-6, 2, 1, torch.tensor([5]), torch.zeros(2, 2, 1, 4),
             torch.zeros(2, 2, 1, 4), torch.tensor([3]), 4, 10000.0, False, "cpu")),
        "fused_add_rms_norm_quant_matmul_rope_kv_append_no_x": (
            ops.fused_add_rms_norm_quant_matmul_rope_kv_append,
            (None, trand((1, 32), "fp32", seed=2), trand((32,), "fp32", seed=3),
             torch.from_numpy(make_packed(rng, 16, 32, 6)), 6, 1e-6, 2, 1, torch.tensor([5]), torch.zeros(2, 2, 1, 4),
             torch.zeros(2, 2, 1, 4), torch.tensor([-1]), 2, 10000.0, True, "auto")),
        "paged_attention": (ops.paged_attention, (trand((2, 2, 4), "fp32"), trand((2, 2, 1, 4), "fp32"),
                                                  trand((2, 2, 1, 4), "fp32"), torch.tensor([[0, 1], [1, 0]], dtype=torch.int32),
                                                  None, torch.tensor([3, 1], dtype=torch.int32), 0.5, "auto")),
        "rotary_embedding_kv_append_paged_attention": (
            ops.rotary_embedding_kv_append_paged_attention,
            (trand((2, 2, 8), "fp32"), trand((2, 1, 8), "fp32", seed=1), trand((2, 1, 8), "fp32", seed=2),
             torch.tensor([1, 0]), trand((2, 2, 1, 8), "fp32", seed=3), trand((2, 2, 1, 8), "fp32", seed=4),
             torch.tensor([1, 2]), torch.tensor([[0, 1], [1, 0]], dtype=torch.int32), None,
             torch.tensor([2, 1], dtype=torch.int32), 4, 10000.0, False, 0.5, "auto")),
        "rotary_embedding_kv_append_paged_attention_seq_ids": (
            ops.rotary_embedding_kv_append_paged_attention,
            (trand((2, 2, 8), "fp32"), trand((2, 1, 8), "fp32", seed=1), trand((2, 1, 8), "fp32", seed=2),
             torch.tensor([2, 3], dtype=torch.int32), trand((2, 2, 1, 8), "fp32", seed=3),
             trand((2, 2, 1, 8), "fp32", seed=4), torch.tensor([2, -1]), torch.tensor([[0, 1]], dtype=torch.int32),
             torch.tensor([0, 0], dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32), 8, 10000.0, True, 0.5,
             "cpu")),
        "varlen_attention": (ops.varlen_attention, (trand((5, 2, 4), "fp32"), trand((6, 1, 4), "fp32"),
                                                    trand((6, 1, 4), "fp32"), torch.tensor([0, 2, 5], dtype=torch.int32),
                                                    torch.tensor([0, 2, 6], dtype=torch.int32), 0.5, True, "auto")),
    }
    op, a = args[case]
    torch.library.opcheck(op, a)


def _block(x, res, w, gate_up, rot_pos, q, k, backend="auto"):
    h = ks.rms_norm(x, w, 1e-5, backend=backend)
    ks.fused_add_rms_norm(h, res, w, backend=backend)
    a = ks.silu_and_mul(ks.gemm(h, gate_up, backend=backend), backend=backend)
    ks.rotary_embedding(q, k, rot_pos, 8, 10000.0, True, backend=backend)
    return ks.softmax(a, backend=backend) + q.sum() + k.sum()


def _block_args():
    return (trand((4, 32), "fp32", seed=1), trand((4, 32), "fp32", seed=2), trand((32,), "fp32", seed=3),
            trand((16, 32), "fp32", seed=4), torch.tensor([0, 1, 2, 3]), trand((4, 2, 8), "fp32", seed=5),
            trand((4, 1, 8), "fp32", seed=6))


@pytest.mark.parametrize("backend", ["auto", "cpu", "torch"])
def test_compile_fullgraph(backend):
    torch._dynamo.reset()
    eager_args = _block_args()
    want = _block(*eager_args, backend=backend)
    args = _block_args()
    compiled = torch.compile(_block, fullgraph=True, backend="eager" if backend == "torch" else "inductor")
    got = compiled(*args, backend=backend)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    # in-place effects happened inside the compiled graph too
    assert torch.allclose(args[1], eager_args[1]) and torch.allclose(args[5], eager_args[5])


def test_compile_model_ops_fullgraph():
    torch._dynamo.reset()
    rng = np.random.default_rng(1)
    packed = torch.from_numpy(make_packed(rng, 10, 32, 6))

    def f(ids, x, kc, vc, k, v, slots, bt, ctx):
        e = ks.embedding(ids, packed, table_format="q8_0", dtype=torch.float32)
        ks.kv_cache_append(kc, vc, k, v, slots)
        o = ks.paged_attention(x, kc, vc, bt, ctx)
        return (ks.quant_matmul(e, packed, "q8_0"), ks.quant_matmul_a8(e, packed, "q8_0"), ks.argmax(e),
                ks.dequantize(packed, "q8_0"), o)

    def args():
        return (torch.tensor([1, 9]), trand((2, 2, 8), "fp32", seed=1), torch.zeros(3, 2, 1, 8),
                torch.zeros(3, 2, 1, 8), trand((2, 1, 8), "fp32", seed=2), trand((2, 1, 8), "fp32", seed=3),
                torch.tensor([4, 5]), torch.tensor([[2, 0], [2, 1]], dtype=torch.int32),
                torch.tensor([2, 2], dtype=torch.int32))

    want = f(*args())
    got = torch.compile(f, fullgraph=True)(*args())
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_compile_quant_matmul_a8_fullgraph(backend):
    torch._dynamo.reset()
    packed = torch.from_numpy(make_packed(np.random.default_rng(4), 12, 96, 5))

    def f(x):
        return ks.quant_matmul_a8(x, packed, "q4_1", backend=backend)

    x = _a8_input("fp32", 96, seed=9)
    want = f(x)
    got = torch.compile(f, fullgraph=True, backend="eager" if backend == "torch" else "inductor")(x)
    assert _same_bits(got, want)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_compile_quant_matmul_fusions_fullgraph(backend):
    torch._dynamo.reset()
    packed = torch.from_numpy(make_packed(np.random.default_rng(2), 12, 32, 5))

    def f(x, r, nw, gu):
        y, res = ks.fused_add_rms_norm_quant_matmul(x, r, nw, packed, "q4_1", 1e-5, backend=backend)
        y0 = ks.fused_add_rms_norm_quant_matmul(None, res, nw, packed, "q4_1", backend=backend)
        return y, res, y0, ks.silu_and_mul_quant_matmul(gu, packed, "q4_1", backend=backend)

    def args(lead=(3,)):  # (lead: the leading dims of x, residual and gate_up; out [*lead, N])
        return (trand((*lead, 32), "fp32", seed=1), trand((*lead, 32), "fp32", seed=2), trand((32,), "fp32", seed=3),
                trand((*lead, 64), "fp32", seed=4))

    for lead in ((3,), (2, 3), ()):
        torch._dynamo.reset()
        want = f(*args(lead))
        got = torch.compile(f, fullgraph=True, backend="eager" if backend == "torch" else "inductor")(*args(lead))
        for a, b in zip(got, want):
            assert tuple(a.shape) == tuple(b.shape) and torch.equal(a, b), lead
        assert tuple(got[0].shape) == (*lead, 12) and tuple(got[3].shape) == (*lead, 12), lead
    # residual_out without x is rejected while tracing too
    g = torch.compile(lambda r, nw: ks.fused_add_rms_norm_quant_matmul(None, r, nw, packed, "q4_1", residual_out=r + 1,
                                                                       backend=backend), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="residual_out is given but x is missing"):
        g(*args()[1:3])


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_compile_rotary_embedding_kv_append_fullgraph(backend):
    # the in-place effects on q, k and both caches happen inside the compiled graph, bit for bit
    # the eager call's
    torch._dynamo.reset()

    def f(q, k, v, pos, kc, vc, slots):
        ks.rotary_embedding_kv_append(q, k, v, pos, kc, vc, slots, 16, 10000.0, True, backend=backend)
        return q.sum() + kc.sum()

    want_args, args = _rope_kv_inputs("fp32", seed=50), _rope_kv_inputs("fp32", seed=50)
    want = f(*want_args)
    got = torch.compile(f, fullgraph=True, backend="eager" if backend == "torch" else "inductor")(*args)
    assert torch.equal(got, want)
    for a, b in zip(args, want_args):
        assert torch.equal(a, b)
    # k None is rejected while tracing too
    g = torch.compile(lambda q, v, pos, kc, vc, slots: ks.rotary_embedding_kv_append(q, None, v, pos, kc, vc, slots,
                                                                                     backend=backend),
                      fullgraph=True, backend="eager")
    a = _rope_kv_inputs("fp32")
    with pytest.raises(Exception, match="rotary_embedding_kv_append: k is missing"):
        g(a[0], *a[2:])


@pytest.mark.parametrize("slots", [[3, -1, 7, -1], [-1, -1, -1], [-1, 0], [9]])
def test_compile_kv_cache_append_reference_skips_slots(slots):
    # the PyTorch reference's compiled append (no boolean index: a fullgraph trace on torch 2.5
    # could not take one) writes what the eager one writes, skipped slots included, with no token
    # kept at all, and with a skipped token beside a kept token at slot 0 (row 0 is where a skipped
    # token's write would go if it were not the kept token's own bytes)
    torch._dynamo.reset()

    def f(kc, vc, k, v, s):
        ks.kv_cache_append(kc, vc, k, v, s, backend="torch")
        return kc.sum() + vc.sum()

    def inputs():
        g = torch.Generator().manual_seed(11)
        kc, vc = (torch.randn((4, 4, 2, 8), generator=g) for _ in range(2))
        k, v = (torch.randn((len(slots), 2, 8), generator=g) for _ in range(2))
        return kc, vc, k, v, torch.tensor(slots)

    want_args, args = inputs(), inputs()
    want = f(*want_args)
    got = torch.compile(f, fullgraph=True, backend="eager")(*args)
    assert torch.equal(got, want)
    for a, b in zip(args, want_args):
        assert torch.equal(a, b)
    kept = [s for s in slots if s >= 0]
    fresh = inputs()
    assert torch.equal(args[0].view(16, 2, 8)[[s for s in range(16) if s not in kept]],
                       fresh[0].view(16, 2, 8)[[s for s in range(16) if s not in kept]])


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_compile_fused_add_rms_norm_quant_matmul_rope_kv_append_fullgraph(backend):
    # out, residual_out and the in-place effects on both caches inside the compiled graph, bit for
    # bit the eager call's
    torch._dynamo.reset()

    def f(x, r, nw, w, pos, kc, vc, slots):
        out, res = ks.fused_add_rms_norm_quant_matmul_rope_kv_append(x, r, nw, w, "q8_0", 4, 2, pos, kc, vc, slots,
                                                                     1e-5, 16, 10000.0, False, backend=backend)
        out0 = ks.fused_add_rms_norm_quant_matmul_rope_kv_append(None, res, nw, w, "q8_0", 4, 2, pos + 1, kc, vc,
                                                                 slots - 1, backend=backend)
        return out, res, out0  # (the caches: compared as the arguments below)

    want_args, args = _norm_rope_inputs("fp32", seed=50), _norm_rope_inputs("fp32", seed=50)
    want = f(*want_args)
    got = torch.compile(f, fullgraph=True, backend="eager" if backend == "torch" else "inductor")(*args)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(args, want_args):
        assert torch.equal(a, b)


def test_compile_rotary_embedding_kv_append_paged_attention_fullgraph():
    # out and the in-place effects on q, k and both caches inside the compiled graph, bit for bit the
    # eager call's (the native op: the PyTorch reference reads context_lens on the host)
    torch._dynamo.reset()

    def f(q, k, v, positions, k_cache, v_cache, slot_mapping, block_tables, seq_ids, context_lens):
        out = ks.rotary_embedding_kv_append_paged_attention(q, k, v, positions, k_cache, v_cache, slot_mapping,
                                                            block_tables, context_lens, 8, 10000.0, False,
                                                            seq_ids=seq_ids)
        return out, q.sum() + k_cache.sum()

    want_args, args = _rope_attn_inputs("fp32", seed=50, with_seq_ids=True), \
        _rope_attn_inputs("fp32", seed=50, with_seq_ids=True)
    want = f(**want_args)
    got = torch.compile(f, fullgraph=True)(**args)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for name in ("q", "k", "k_cache", "v_cache"):
        assert torch.equal(args[name], want_args[name]), name


def test_compile_autograd_routes_to_reference():
    torch._dynamo.reset()
    x = trand((3, 8), "fp32").requires_grad_()
    w = trand((8,), "fp32").requires_grad_()
    f = torch.compile(lambda a, b: ks.rms_norm(a, b).sum(), fullgraph=True, backend="eager")
    f(x, w).backward()
    assert x.grad is not None and w.grad is not None


@pytest.mark.parametrize("order", ["kernscope_first", "torch_first"])
def test_registration_any_import_order(order):
    first, second = ("kernscope", "torch") if order == "kernscope_first" else ("torch", "kernscope")
    code = (f"import {first}, {second}\n"
            "import kernscope as ks, torch\n"
            "assert hasattr(torch.ops.kernscope, 'rms_norm')\n"
            "f = torch.compile(lambda x, w: ks.rms_norm(x, w), fullgraph=True, backend='eager')\n"
            "x, w = torch.randn(2, 8), torch.randn(8)\n"
            "assert torch.equal(f(x, w), ks.rms_norm(x, w))\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_kernscope_does_not_import_torch():
    code = ("import sys, numpy as np, kernscope as ks\n"
            "ks.rms_norm(np.ones((1, 4), np.float32), np.ones(4, np.float32))\n"
            "ks.available(); ks.which('rms_norm')\n"
            "assert 'torch' not in sys.modules\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
