#!/usr/bin/env python3
"""Peers of kernscope's CUDA operators, timed on the GPU machine in the same call.

Implementations per (op, shape, dtype):
  torch_ref    the contract in PyTorch eager (FP32 upcast, one rounding)
  torch_native PyTorch's own op (F.rms_norm, F.silu(a) * b, torch.mv, torch.softmax)
  compile      torch.compile of the contract (Inductor -> Triton)
  liger        liger-kernel's Triton op, where it has one and its wheel is present

Method as bench/bench_ops.cpp: random inputs, enough sets to exceed ~3x the L2,
20 rounds captured in a CUDA graph, median of 7 replays, µs per call.
usage: peers.py --csv out.csv [--dtypes bf16,fp16,fp32] [--impls torch_ref,torch_native,compile,liger]
"""
import argparse
import csv
import os
import statistics

import torch
import torch._dynamo
import torch.nn.functional as F

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-6


def contract_rms(x, w):
    xf = x.float()
    return (xf * (1.0 / torch.sqrt(xf.square().mean(-1, keepdim=True) + EPS)) * w.float()).to(x.dtype)


def contract_fadd(x, r, w):
    s = x.float() + r.float()
    r.copy_(s.to(r.dtype))
    x.copy_((s * (1.0 / torch.sqrt(s.square().mean(-1, keepdim=True) + EPS)) * w.float()).to(x.dtype))


def contract_silu(x):
    d = x.shape[-1] // 2
    g, u = x[..., :d].float(), x[..., d:].float()
    return (g * torch.sigmoid(g) * u).to(x.dtype)


def contract_gemv(x, w):
    return (w.float() @ x.float()).to(x.dtype)


def contract_softmax(x):
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


def native_fadd(x, r, w):
    r.add_(x)
    x.copy_(F.rms_norm(r, (r.shape[-1],), w, EPS))


NATIVE = {
    "rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS),
    "fused_add_rms_norm": native_fadd,
    "silu_and_mul": lambda x: F.silu(x[..., : x.shape[-1] // 2]) * x[..., x.shape[-1] // 2:],
    "gemv": lambda x, w: torch.mv(w, x),
    "softmax": lambda x: torch.softmax(x, dim=-1),
}
CONTRACT = {"rms_norm": contract_rms, "fused_add_rms_norm": contract_fadd, "silu_and_mul": contract_silu,
            "gemv": contract_gemv, "softmax": contract_softmax}


def liger_impls():
    out = {}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        out["rms_norm"] = lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)
    except Exception as e:  # noqa: BLE001 - report and go on
        print("liger rms_norm unavailable:", e)
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        out["fused_add_rms_norm"] = lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama", True)
    except Exception as e:  # noqa: BLE001
        print("liger fused_add_rms_norm unavailable:", e)
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        out["silu_and_mul"] = lambda x: LigerSiLUMulFunction.apply(x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:])
    except Exception as e:  # noqa: BLE001
        print("liger silu unavailable:", e)
    return out


SHAPES = {
    "rms_norm": [(1, 4096), (16, 4096), (512, 1024), (512, 4096), (4096, 8192), (16384, 8192)],
    "fused_add_rms_norm": [(1, 4096), (16, 4096), (512, 1024), (512, 4096), (4096, 8192), (16384, 8192)],
    "silu_and_mul": [(1, 14336), (16, 14336), (512, 4096), (512, 14336), (4096, 14336)],
    "gemv": [(512, 1024), (4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192), (128256, 4096)],
    "softmax": [(512, 128), (512, 1024), (4096, 4096), (64, 32000), (64, 128256), (256, 151936)],
}


def make(op, a, b, dt):
    r = lambda *s: torch.randn(*s, device="cuda", dtype=dt)  # noqa: E731
    if op == "rms_norm":
        return (r(a, b), r(b)), f"{a}x{b}", 2 * a * b + b
    if op == "fused_add_rms_norm":
        return (r(a, b), r(a, b), r(b)), f"{a}x{b}", 4 * a * b + b
    if op == "silu_and_mul":
        return (r(a, 2 * b),), f"{a}x{2 * b}", 3 * a * b
    if op == "gemv":
        return (r(b), r(a, b)), f"{a}x{b}", a * b + a + b
    return (r(a, b),), f"{a}x{b}", 2 * a * b


def nsets(nbytes):
    """Input sets rotated through the graph: enough to pass the L2 (3 x 60 MB), 1 to 16."""
    return max(1, min(16, int(3 * 60e6 // nbytes) + 1))


def time_peer(rows, row, fn, sets, nbytes, label, line):
    """Times fn over sets (graph_us). On success appends row with us and GB/s to rows and prints
    `line` with the times; a failing peer is reported under `label` and skipped, not fatal."""
    try:
        us = graph_us(fn, sets)
    except Exception as e:  # noqa: BLE001 - a failing peer is reported, not fatal
        print(f"{label} FAILED: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return
    gbs = nbytes / (us * 1e-6) / 1e9
    rows.append(dict(row, us=round(us, 3), gbs=round(gbs, 1)))
    print(f"{line} {us:10.3f} us {gbs:8.1f} GB/s", flush=True)


def graph_us(fn, sets, inner=20, reps=7):
    for args in sets:
        fn(*args)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for args in sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            for args in sets:
                fn(*args)
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        t0.record()
        g.replay()
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1) * 1e3 / (inner * len(sets)))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", default="peers.csv")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--impls", default="torch_ref,torch_native,compile,liger")
    ap.add_argument("--ops", default=",".join(SHAPES))
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.config.cache_size_limit = 512
    impls = a.impls.split(",")
    liger = liger_impls() if "liger" in impls else {}
    compiled = {op: torch.compile(f, dynamic=False) for op, f in CONTRACT.items()}
    rows = []
    gpu = torch.cuda.get_device_name()
    for dname in a.dtypes.split(","):
        dt = DT[dname]
        es = torch.tensor([], dtype=dt).element_size()
        for op in a.ops.split(","):
            for (x, y) in SHAPES[op]:
                probe, shape, elems = make(op, x, y, dt)
                nbytes = elems * es
                k = nsets(nbytes)
                sets = [probe] + [make(op, x, y, dt)[0] for _ in range(k - 1)]
                cands = []
                if "torch_ref" in impls: cands.append(("torch_ref", CONTRACT[op]))
                if "torch_native" in impls: cands.append(("torch_native", NATIVE[op]))
                if "compile" in impls: cands.append(("compile", compiled[op]))
                if op in liger: cands.append(("liger", liger[op]))
                for name, fn in cands:
                    time_peer(rows, dict(gpu=gpu, op=op, shape=shape, dtype=dname, impl=name), fn, sets, nbytes,
                              f"{op} {shape} {dname} {name}", f"{op:20s} {shape:>14s} {dname:5s} {name:13s}")
                del sets, probe
                torch.cuda.empty_cache()
    with open(a.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
