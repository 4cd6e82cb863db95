"""GPU tests: torch CUDA tensors (every op against the CPU backend and FP64),
non-default streams, CUDA-graph capture, torch.compile on CUDA, cupy and jax
arrays, several devices. Skipped without a CUDA device (and a test whose op
has no CUDA kernel yet skips, saying so). scripts/gpu_python_check.sh runs
these on the GPU machine."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import (DTYPES, QNAMES, TOL, U, assert_close, f64, make_packed, ref_dequantize, ref_norm_input,
                      ref_rms_norm, ref_rounded_matmul, ref_silu_and_mul, ref_softmax, sum_bound)

torch = pytest.importorskip("torch")
import kernscope as ks  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

TORCH = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def need_kernel(op: str, dt: str = "fp32") -> None:
    """Skip unless the CUDA backend has a variant of op for dt."""
    if not ks.backend_available("cuda"):
        pytest.fail("kernscope was built without the CUDA backend (or sees no device) on a CUDA machine")
    try:
        ks.which(op, dt, "cuda")
    except ks.BackendUnavailableError as e:
        pytest.skip(f"no CUDA kernel for {op} ({dt}) yet: {e}")


def has_kernel(op: str, dt: str = "fp32") -> bool:
    try:
        ks.which(op, dt, "cuda")
        return True
    except ks.BackendUnavailableError:
        return False


def trand(shape, dt, seed=0, device="cuda", scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(TORCH[dt]).to(device)


def np64(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def close(a, b, dt, what=""):
    # Two implementations of one contract: each within tol of FP64, so within 2 tol of each other.
    assert_close(np64(a), np64(b), dt, extra=TOL[dt] * (1 + 2 * np.abs(np64(b))), what=what)


def test_cuda_backend_built_and_visible():
    assert ks.backend_available("cuda"), "kernscope's CUDA backend is not compiled in, or sees no device"
    rows = [r for r in ks.available() if r.backend == "cuda"]
    print("CUDA variants:", [(r.op, r.variant, r.dtypes) for r in rows])


# ---- ops without a CUDA kernel fail cleanly (KS_ERROR_BACKEND_UNAVAILABLE) -----------------------
def _cuda_calls(dev="cuda"):
    f = torch.zeros(2, 8, device=dev)
    z = lambda *s, dtype=torch.float32: torch.zeros(*s, dtype=dtype, device=dev)  # noqa: E731
    return {
        "rms_norm": (lambda: ks.rms_norm(f, z(8)), ()),
        "fused_add_rms_norm": None,  # in-place: below
        "silu_and_mul": (lambda: ks.silu_and_mul(f), ()),
        "gemv": (lambda: ks.gemv(z(8), f), ()),
        "softmax": (lambda: ks.softmax(f), ()),
        "argmax": (lambda: ks.argmax(f), ()),
        "embedding": (lambda: ks.embedding(z(1, dtype=torch.int64), f), ()),
        "dequantize": (lambda: ks.dequantize(z(1, 4, dtype=torch.uint8), "f32"), ()),
        "gemm": (lambda: ks.gemm(f, f), ()),
        "quant_matmul": (lambda: ks.quant_matmul(z(1, 32), z(1, 34, dtype=torch.uint8), "q8_0"), ()),
        "rotary_embedding": None,
        "kv_cache_append": None,
        "paged_attention": (lambda: ks.paged_attention(z(1, 1, 8), z(1, 1, 1, 8), z(1, 1, 1, 8),
                                                       z(1, 1, dtype=torch.int32), z(1, dtype=torch.int32) + 1), ()),
    }


@pytest.mark.parametrize("op", ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "gemv", "softmax", "argmax",
                                "embedding", "dequantize", "gemm", "quant_matmul", "rotary_embedding",
                                "kv_cache_append", "paged_attention"])
def test_missing_kernel_raises_backend_unavailable(op):
    if has_kernel(op):
        pytest.skip(f"{op} has a CUDA kernel")
    if op == "fused_add_rms_norm":
        x, r, w = trand((2, 8), "fp32", 1), trand((2, 8), "fp32", 2), trand((8,), "fp32", 3)
        x0, r0 = x.clone(), r.clone()
        with pytest.raises(ks.BackendUnavailableError, match=op):
            ks.fused_add_rms_norm(x, r, w)
        assert torch.equal(x, x0) and torch.equal(r, r0)
    elif op == "rotary_embedding":
        q = trand((2, 2, 8), "fp32", 1)
        q0 = q.clone()
        with pytest.raises(ks.BackendUnavailableError, match=op):
            ks.rotary_embedding(q, None, torch.arange(2, device="cuda"))
        assert torch.equal(q, q0)
    elif op == "kv_cache_append":
        kc = torch.zeros(2, 2, 1, 8, device="cuda")
        with pytest.raises(ks.BackendUnavailableError, match=op):
            ks.kv_cache_append(kc, kc.clone(), trand((1, 1, 8), "fp32"), trand((1, 1, 8), "fp32"),
                               torch.tensor([0], device="cuda"))
        assert not kc.any()
    else:
        fn, _ = _cuda_calls()[op]
        with pytest.raises(RuntimeError, match=op):  # BackendUnavailableError is a RuntimeError
            fn()


# ---- correctness on CUDA ----------------------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (3, 5, 64), (4, 4097), (64, 8192), (0, 16), (1, 65536)])
def test_rms_norm_cuda_vs_fp64(dt, shape):
    need_kernel("rms_norm", dt)
    x, w = trand(shape, dt, 1), trand(shape[-1:], dt, 2)
    y = ks.rms_norm(x, w, 1e-5)
    assert y.device == x.device and y.dtype == x.dtype
    assert_close(np64(y), ref_rms_norm(np64(x), np64(w), 1e-5), dt, what="rms_norm cuda")
    # offset view (misaligned start) and in place
    big = trand((1 + int(np.prod(shape)),), dt, 3)
    xv = big[1:].view(shape)
    # An offset view takes the scalar path (vec=1), whose FP32 sum order differs from the 16-byte
    # path: the two may differ in the last bit, each within tolerance of FP64 (docs/contracts.md).
    close(ks.rms_norm(xv, w, 1e-5), ks.rms_norm(xv.clone(), w, 1e-5), dt, "offset view vs aligned copy")
    assert_close(np64(ks.rms_norm(xv, w, 1e-5)), ref_rms_norm(np64(xv), np64(w), 1e-5), dt, what="offset view")
    xv0 = xv.clone()
    ks.rms_norm(xv, w, 1e-5, out=xv)
    assert_close(np64(xv), ref_rms_norm(np64(xv0), np64(w), 1e-5), dt, what="in place")


@pytest.mark.parametrize("dt", DTYPES)
def test_core_ops_cuda_vs_cpu(dt):
    x, w, r = trand((8, 1024), dt, 1, scale=2.0), trand((1024,), dt, 2), trand((8, 1024), dt, 3)
    xc, wc, rc = x.cpu(), w.cpu(), r.cpu()
    ran = 0
    if has_kernel("rms_norm", dt):
        close(ks.rms_norm(x, w), ks.rms_norm(xc, wc), dt, "rms_norm")
        ran += 1
    if has_kernel("fused_add_rms_norm", dt):
        x2, r2, x3, r3 = x.clone(), r.clone(), xc.clone(), rc.clone()
        ks.fused_add_rms_norm(x2, r2, w)
        ks.fused_add_rms_norm(x3, r3, wc)
        close(x2, x3, dt, "fused x")
        close(r2, r3, dt, "fused residual")
        ran += 1
    if has_kernel("silu_and_mul", dt):
        close(ks.silu_and_mul(x), ks.silu_and_mul(xc), dt, "silu_and_mul")
        ran += 1
    if has_kernel("gemv", dt):
        y = ks.gemv(x[0], r)
        ref = np64(r) @ np64(x[0])
        assert_close(np64(y), ref, dt, extra=sum_bound(np.abs(np64(r)) @ np.abs(np64(x[0])), 1024), what="gemv")
        ran += 1
    if has_kernel("softmax", dt):
        assert_close(np64(ks.softmax(x)), ref_softmax(np64(x)), dt, extra=sum_bound(ref_softmax(np64(x)), 1024))
        ran += 1
    if not ran:
        pytest.skip("no CUDA kernel for the core ops yet")


@pytest.mark.parametrize("dt", DTYPES)
def test_model_ops_cuda_vs_cpu(dt):
    rng = np.random.default_rng(3)
    ran = 0
    if has_kernel("argmax", dt):
        x = trand((4, 32000), dt, 1)
        assert torch.equal(ks.argmax(x).cpu(), ks.argmax(x.cpu()))
        ran += 1
    if has_kernel("gemm", dt):
        # (cuBLASLt and the CPU sum the 96 products in other orders: the contract's FP32 sum
        # allowance on the products' magnitudes, as gemv's, not a bound on the result alone, which
        # cancellation makes small; two ulp of the sums' order at 0.049 failed it at 71ea567)
        a, b = trand((17, 96), dt, 2), trand((33, 96), dt, 3)
        y, yc = ks.gemm(a, b), ks.gemm(a.cpu(), b.cpu())
        assert_close(np64(y), np64(yc), dt, extra=TOL[dt] * (1 + 2 * np.abs(np64(yc)))
                     + 2 * sum_bound(np.abs(np64(a)) @ np.abs(np64(b)).T, 96), what="gemm")
        ran += 1
    for q, name in QNAMES.items():
        packed = torch.from_numpy(make_packed(rng, 16, 128, q))
        if has_kernel("dequantize", dt):
            close(ks.dequantize(packed.cuda(), name, dtype=dt), ks.dequantize(packed, name, dtype=dt), dt, name)
            ran += 1
        if has_kernel("quant_matmul", dt):
            xx = trand((5, 128), dt, q)  # (dense weights too: cuda_warp_per_column's dense kernel)
            close(ks.quant_matmul(xx, packed.cuda(), name), ks.quant_matmul(xx.cpu(), packed, name), dt, name)
            ran += 1
        if has_kernel("embedding", dt):
            ids = torch.tensor([[3, 0], [15, 3]])
            close(ks.embedding(ids.cuda(), packed.cuda(), table_format=name, dtype=dt),
                  ks.embedding(ids, packed, table_format=name, dtype=dt), dt, name)
            ran += 1
    if has_kernel("rotary_embedding", dt):
        for neox in (True, False):
            q, k = trand((7, 8, 64), dt, 4), trand((7, 2, 64), dt, 5)
            qc, kc = q.cpu(), k.cpu()
            pos = torch.tensor([0, 1, 2, 100, 4095, 4096, 100000])
            ks.rotary_embedding(q, k, pos.cuda(), 64, 10000.0, neox)
            ks.rotary_embedding(qc, kc, pos, 64, 10000.0, neox)
            close(q, qc, dt, "rotary q")
            close(k, kc, dt, "rotary k")
        ran += 1
    if has_kernel("kv_cache_append", dt) and has_kernel("paged_attention", dt):
        kc = torch.zeros(16, 16, 2, 64, dtype=TORCH[dt], device="cuda")
        vc = torch.zeros_like(kc)
        k, v = trand((40, 2, 64), dt, 6), trand((40, 2, 64), dt, 7)
        slots = torch.arange(40, device="cuda") + 16  # blocks 1.. of the cache
        ks.kv_cache_append(kc, vc, k, v, slots)
        kcc, vcc = torch.zeros_like(kc).cpu(), torch.zeros_like(vc).cpu()
        ks.kv_cache_append(kcc, vcc, k.cpu(), v.cpu(), slots.cpu())
        assert torch.equal(kc.cpu(), kcc) and torch.equal(vc.cpu(), vcc)
        q = trand((3, 8, 64), dt, 8)
        bt = torch.tensor([[1, 2, 3], [1, 2, 3], [3, 1, 2]], dtype=torch.int32)
        ctx = torch.tensor([40, 1, 0], dtype=torch.int32)
        o = ks.paged_attention(q, kc, vc, bt.cuda(), ctx.cuda())
        oc = ks.paged_attention(q.cpu(), kcc, vcc, bt, ctx)
        close(o, oc, dt, "paged_attention")
        assert not o[2].any()
        ran += 1
    if has_kernel("varlen_attention", dt):
        cq = torch.tensor([0, 5, 5, 205, 206], dtype=torch.int32)
        ck = torch.tensor([0, 5, 5, 300, 306], dtype=torch.int32)
        q, k, v = trand((206, 8, 64), dt, 9), trand((306, 2, 64), dt, 10), trand((306, 2, 64), dt, 11)
        for causal in (True, False):
            o = ks.varlen_attention(q, k, v, cq.cuda(), ck.cuda(), causal=causal)
            oc = ks.varlen_attention(q.cpu(), k.cpu(), v.cpu(), cq, ck, causal=causal)
            close(o, oc, dt, f"varlen_attention causal={causal}")
        # causal prefill (len_q == len_k) against torch SDPA on the GPU, GQA expanded for it
        cu = torch.tensor([0, 300, 301, 812], dtype=torch.int32, device="cuda")
        q, k, v = trand((812, 8, 64), dt, 12), trand((812, 2, 64), dt, 13), trand((812, 2, 64), dt, 14)
        o = ks.varlen_attention(q, k, v, cu, cu)
        for a, b in ((0, 300), (300, 301), (301, 812)):
            want = torch.nn.functional.scaled_dot_product_attention(
                q[a:b].float().transpose(0, 1), k[a:b].float().repeat_interleave(4, 1).transpose(0, 1),
                v[a:b].float().repeat_interleave(4, 1).transpose(0, 1), is_causal=True).transpose(0, 1).to(TORCH[dt])
            close(o[a:b], want, dt, f"varlen_attention vs SDPA rows {a}:{b}")
        ran += 1
    if not ran:
        pytest.skip("no CUDA kernel for the model-path ops yet")


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m", [1, 7])
def test_quant_matmul_fusions_cuda_vs_fp64(dt, m):
    # the FP64 references of test_model_ops.py (h rounded to dt between the norm / activation and
    # the matmul), on CUDA tensors; residual_out bit for bit against the CPU backend
    rng = np.random.default_rng(5)
    k, n = 256, 40
    ran = 0
    for q, name in QNAMES.items():
        packed = make_packed(rng, n, k, q)
        wd, w = ref_dequantize(packed, q), torch.from_numpy(packed).cuda()  # (every format, dense ones too)
        if has_kernel("fused_add_rms_norm_quant_matmul", dt):
            x, r, nw = trand((m, k), dt, 1 + q), trand((m, k), dt, 11 + q), trand((k,), dt, 21 + q)
            out = torch.full((m, n), float("nan"), dtype=TORCH[dt], device="cuda")
            res = torch.full((m, k), float("nan"), dtype=TORCH[dt], device="cuda")
            ks.fused_add_rms_norm_quant_matmul(x, r, nw, w, name, out=out, residual_out=res)
            s, h = ref_norm_input(np64(x), np64(r), np64(nw), 1e-6)
            ref, extra = ref_rounded_matmul(h, wd, dt, (8 * np.sqrt(k) + 16) * U)
            assert_close(np64(out), ref, dt, extra=extra, what=f"fused norm {name}")
            _, res_cpu = ks.fused_add_rms_norm_quant_matmul(x.cpu(), r.cpu(), nw.cpu(), w.cpu(), name)
            assert torch.equal(res.cpu(), res_cpu)
            _, h0 = ref_norm_input(None, np64(r), np64(nw), 1e-6)
            ref0, extra0 = ref_rounded_matmul(h0, wd, dt, (8 * np.sqrt(k) + 16) * U)
            y0 = ks.fused_add_rms_norm_quant_matmul(None, r, nw, w, name)
            assert y0.device == r.device
            assert_close(np64(y0), ref0, dt, extra=extra0, what=f"fused norm, no x, {name}")
            ran += 1
        if has_kernel("silu_and_mul_quant_matmul", dt):
            gu = trand((m, 2 * k), dt, 31 + q)
            ref, extra = ref_rounded_matmul(ref_silu_and_mul(np64(gu)), wd, dt, 16 * U)
            assert_close(np64(ks.silu_and_mul_quant_matmul(gu, w, name)), ref, dt, extra=extra, what=f"silu {name}")
            ran += 1
    if not ran:
        pytest.skip("no CUDA kernel for the quant_matmul fusions yet")


@pytest.mark.parametrize("dt", DTYPES)
def test_rotary_embedding_kv_append_cuda(dt):
    # bit for bit rotary_embedding then kv_cache_append on CUDA (every CUDA RoPE kernel rotates with
    # the same angle and rope_rotate), within tolerance of the CPU backend: decode (1 token) and
    # prefill-sized calls, GQA, rotary_dim < head_dim, a head_dim off the 16-byte path, slots -1
    # skipped, a padding row past slot_mapping's tokens, both pairings, int32 and int64 positions;
    # random caches, so untouched rows are compared too
    need_kernel("rotary_embedding_kv_append", dt)
    g = torch.Generator().manual_seed(9)
    for T, H, KVH, D, rd, blocks, bs in ((1, 8, 2, 128, 128, 4, 16), (37, 8, 2, 128, 64, 6, 16),
                                         (5, 4, 1, 66, 32, 3, 7)):
        n = blocks * bs
        slots = torch.tensor([-1 if t % 4 == 2 else (t * 5) % n for t in range(max(T - 1, 1))], device="cuda")
        for neox in (True, False):
            for pos_dt in (torch.int32, torch.int64):
                seed = 100 * T + 10 * neox + (pos_dt == torch.int64)
                q, k, v = trand((T, H, D), dt, seed), trand((T, KVH, D), dt, seed + 1), trand((T, KVH, D), dt, seed + 2)
                kc, vc = trand((blocks, bs, KVH, D), dt, seed + 3), trand((blocks, bs, KVH, D), dt, seed + 4)
                pos = torch.randint(0, 1 << 20, (T,), generator=g).to(pos_dt).cuda()
                two = [t.clone() for t in (q, k, kc, vc)]
                cpu = [t.cpu() for t in (q, k, kc, vc)]
                assert ks.rotary_embedding_kv_append(q, k, v, pos, kc, vc, slots, rd, 10000.0, neox) is None
                ks.rotary_embedding(two[0], two[1], pos, rd, 10000.0, neox)
                ks.kv_cache_append(two[2], two[3], two[1], v, slots)
                ks.rotary_embedding_kv_append(cpu[0], cpu[1], v.cpu(), pos.cpu(), cpu[2], cpu[3], slots.cpu(), rd,
                                              10000.0, neox)
                what = f"T={T} D={D} rd={rd} neox={neox} {pos_dt}"
                for name, a, b, c in zip(("q", "k", "k_cache", "v_cache"), (q, k, kc, vc), two, cpu):
                    assert torch.equal(a, b), f"{name} vs the two CUDA calls, {what}"
                    close(a, c, dt, f"{name} vs the CPU, {what}")
    # q a strided view of a fused qkv buffer
    T, H, KVH, D = 4, 4, 2, 64
    qkv = trand((T, (H + 2 * KVH) * D), dt, 7)
    q = qkv[:, :H * D].view(T, H, D)
    k, v = qkv[:, H * D:(H + KVH) * D].reshape(T, KVH, D).clone(), qkv[:, (H + KVH) * D:].reshape(T, KVH, D).clone()
    kc, vc = torch.zeros(2, 4, KVH, D, dtype=TORCH[dt], device="cuda"), torch.zeros(2, 4, KVH, D, dtype=TORCH[dt],
                                                                                   device="cuda")
    pos, slots = torch.tensor([5, 0, 9, 2], device="cuda"), torch.tensor([3, -1, 7, 0], device="cuda", dtype=torch.int32)
    q2, k2, kc2, vc2 = q.clone(), k.clone(), kc.clone(), vc.clone()
    ks.rotary_embedding_kv_append(q, k, v, pos, kc, vc, slots, 32, 10000.0, False)
    ks.rotary_embedding(q2, k2, pos, 32, 10000.0, False)
    ks.kv_cache_append(kc2, vc2, k2, v, slots)
    for name, a, b in (("q", q, q2), ("k", k, k2), ("k_cache", kc, kc2), ("v_cache", vc, vc2)):
        assert torch.equal(a, b), f"strided q: {name}"
    # errors name the argument and write nothing
    before = [t.clone() for t in (q, k, kc, vc)]
    for kw, pattern in ((dict(v=k), "v and k overlap"), (dict(rotary_dim=66), "rotary_dim must be even"),
                        (dict(k_cache=qkv.view(-1)[:2 * 4 * KVH * D].view(2, 4, KVH, D)), "k_cache and q overlap")):
        args = dict(q=q, k=k, v=v, positions=pos, k_cache=kc, v_cache=vc, slot_mapping=slots, rotary_dim=32)
        args.update(kw)
        with pytest.raises(ks.InvalidArgumentError, match=f"rotary_embedding_kv_append: {pattern}"):
            ks.rotary_embedding_kv_append(**args)
        for a, b in zip((q, k, kc, vc), before):
            assert torch.equal(a, b)


# ---- streams, graphs, compile -------------------------------------------------------------------
def test_non_default_stream_orders_with_producer():
    need_kernel("rms_norm")
    src, w = trand((64, 4096), "fp32", 1), trand((4096,), "fp32", 2)
    want = ks.rms_norm(src, w)
    torch.cuda.synchronize()
    x = torch.zeros_like(src)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # x's zero fill and src are ready before s's work
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)  # the producer's pending work on s...
        x.copy_(src)  # ...ends with x's values
        y = ks.rms_norm(x, w)  # must run on s, after the copy, without a sync
    s.synchronize()
    assert torch.equal(y, want)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    print("rms_norm launch:", ks.last_launch_config("rms_norm"))


def test_cuda_graph_capture():
    need_kernel("rms_norm", "bf16")
    x, w = trand((8, 2048), "bf16", 1), trand((2048,), "bf16", 2)
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up outside capture
            ks.rms_norm(static_x, w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = ks.rms_norm(static_x, w)
        if has_kernel("fused_add_rms_norm", "bf16"):
            res = torch.zeros_like(static_x)
            ks.fused_add_rms_norm(static_y, res, w)
    for seed in (5, 6):
        new = trand((8, 2048), "bf16", seed)
        static_x.copy_(new)
        g.replay()
        want = ks.rms_norm(new, w)
        if has_kernel("fused_add_rms_norm", "bf16"):
            ks.fused_add_rms_norm(want, torch.zeros_like(want), w)
        torch.cuda.synchronize()
        assert torch.equal(static_y, want)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compile_cuda(mode):
    need_kernel("rms_norm", "bf16")
    need_kernel("silu_and_mul", "bf16")
    torch._dynamo.reset()

    def f(x, w):
        return ks.silu_and_mul(ks.rms_norm(x, w)) * 2

    x, w = trand((16, 512), "bf16", 1), trand((512,), "bf16", 2)
    want = f(x, w)
    cf = torch.compile(f, fullgraph=True, mode=mode)
    for _ in range(3):
        got = cf(x, w)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def test_device_errors():
    x = trand((2, 8), "fp32", 1)
    with pytest.raises(RuntimeError, match="rms_norm"):
        ks.rms_norm(x, trand((8,), "fp32", 2, device="cpu"))  # mixed devices
    with pytest.raises(RuntimeError, match="backend cpu needs host tensors"):
        ks.rms_norm(x, trand((8,), "fp32", 2), backend="cpu")
    with pytest.raises(ks.InvalidArgumentError, match=r"rms_norm: weight must have shape \(8,\)"):
        ks.rms_norm(x, trand((7,), "fp32", 2))  # validation before dispatch, kernel or not


def test_torch_reference_on_cuda():
    x, w = trand((4, 64), "bf16", 1), trand((64,), "bf16", 2)
    y = ks.rms_norm(x, w, backend="torch")
    assert y.is_cuda
    assert_close(np64(y), ref_rms_norm(np64(x), np64(w), 1e-6), "bf16")
    xg = x.double().requires_grad_()
    wg = w.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: ks.rms_norm(a, b, backend="torch"), (xg, wg))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_second_device():
    need_kernel("rms_norm")
    x, w = trand((4, 256), "fp32", 1, device="cuda:1"), trand((256,), "fp32", 2, device="cuda:1")
    y = ks.rms_norm(x, w)
    assert y.device == torch.device("cuda:1")
    assert_close(np64(y), ref_rms_norm(np64(x), np64(w), 1e-6), "fp32")


# ---- cupy and jax --------------------------------------------------------------------------
def test_cupy():
    cp = pytest.importorskip("cupy")
    x = cp.asarray(np.random.default_rng(1).standard_normal((8, 512)), dtype=cp.float32)
    w = cp.asarray(np.random.default_rng(2).standard_normal(512), dtype=cp.float32)
    with pytest.raises(ks.InvalidArgumentError, match=r"rms_norm: weight must have shape \(512,\)"):
        ks.rms_norm(x, w[:3])  # the DLPack import and stream handshake, with or without a kernel
    need_kernel("rms_norm")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        y = ks.rms_norm(x, w)
        y2 = ks.rms_norm(x, w)
    s.synchronize()
    assert isinstance(y, cp.ndarray) and y.dtype == cp.float32
    assert_close(cp.asnumpy(y), ref_rms_norm(cp.asnumpy(x), cp.asnumpy(w), 1e-6), "fp32")
    assert cp.array_equal(y, y2)
    xr, rr = x.copy(), cp.ones_like(x)
    if has_kernel("fused_add_rms_norm"):
        ks.fused_add_rms_norm(xr, rr, w)  # in place on cupy arrays
        assert_close(cp.asnumpy(rr), f64(cp.asnumpy(x)) + 1.0, "fp32")


def test_jax():
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        pytest.skip("jax sees no GPU")
    dev = gpus[0]
    x = jax.device_put(jnp.asarray(np.random.default_rng(1).standard_normal((8, 512)), dtype=jnp.bfloat16), dev)
    w = jax.device_put(jnp.asarray(np.random.default_rng(2).standard_normal(512), dtype=jnp.bfloat16), dev)
    with pytest.raises(ks.InvalidArgumentError, match=r"rms_norm: weight must have shape \(512,\)"):
        ks.rms_norm(x, w[:3])
    need_kernel("rms_norm", "bf16")
    y = ks.rms_norm(x, w)
    assert isinstance(y, jax.Array) and y.dtype == jnp.bfloat16 and next(iter(y.devices())) == dev
    assert_close(np.asarray(y.astype(jnp.float32)), ref_rms_norm(np.asarray(x.astype(jnp.float32)),
                                                                 np.asarray(w.astype(jnp.float32)), 1e-6), "bf16")
    # jax computes on y afterwards: the op's writes are complete (the call waited on its stream)
    assert float(jnp.abs(y.astype(jnp.float32) - ks.rms_norm(x, w).astype(jnp.float32)).max()) == 0.0


# ---- sample: the same ids as the CPU, and CUDA graphs read the offset tensor -------------------
def test_sample_cuda_equals_cpu_and_graph_replays():
    if not has_kernel("sample", "bf16"):
        pytest.skip("sample has no CUDA kernel")
    x = torch.randn(4, 5000, device="cuda", dtype=torch.bfloat16)
    x[1, 7] = float("nan")
    so = torch.tensor([7, 3], device="cuda")
    valid = torch.empty(4, dtype=torch.uint8, device="cuda")
    a = ks.sample(x, so, 0.8, 20, 0.9, valid=valid)
    b = ks.sample(x.cpu(), so.cpu(), 0.8, 20, 0.9)
    assert torch.equal(a.cpu(), b)
    assert valid.tolist() == [1, 0, 1, 1] and a[1].item() == 0
    out = torch.empty(4, dtype=torch.int64, device="cuda")
    ks.sample(x, so, 0.8, 20, 0.9, out=out)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ks.sample(x, so, 0.8, 20, 0.9, out=out)
    for off in range(4):
        so[1] = off
        g.replay()
        torch.cuda.synchronize()
        ref = ks.sample(x.cpu(), torch.tensor([7, off]), 0.8, 20, 0.9)
        assert torch.equal(out.cpu(), ref), off
