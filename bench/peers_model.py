#!/usr/bin/env python3
"""PyTorch peers of the model-path operators, timed the same way as bench/bench_ops.cpp
(CUDA-graph replay, inputs rotated past L2, median of 7) on the GPU machine:

  decode_attention    torch scaled_dot_product_attention (GQA) on a contiguous [b, h, T, d] cache
  rope_neox           the rotate-half formula in eager PyTorch (torch_ref) and torch.compile
  sampling_topk_topp  softmax, sort, cumsum, mask, multinomial (top-k 50, top-p 0.9), eager
                      (torch_sort) and torch.compile (compile; a failure is reported, not fatal)
  argmax              torch.argmax, eager and torch.compile

Shapes and byte counts follow ../shared/anchors/anchors2_h200.py, so the rows join
kernscope's (bench_ops --ops rotary_embedding,paged_attention,sample,argmax).

usage: peers_model.py --csv peers_model.csv [--ops decode_attention,argmax]
"""
import argparse
import csv

import torch
import torch.nn.functional as F

from peers import nsets, time_peer  # the same timing method as the core-op peers (bench/peers.py)

BF = torch.bfloat16


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def rope_rotate_half(q, k, cos, sin):
    def rot(x):
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([a * c - b * s, b * c + a * s], -1)
    q.copy_(rot(q))
    k.copy_(rot(k))


def topk_topp(logits, k=50, p=0.9):
    probs = torch.softmax(logits.float(), -1)
    sp, si = probs.sort(-1, descending=True)
    cum = sp.cumsum(-1)
    drop = cum - sp > p
    drop[:, k:] = True
    idx = torch.multinomial(sp.masked_fill(drop, 0.0), 1)
    return si.gather(-1, idx)


def cases():
    dev = "cuda"
    r = lambda *s: torch.randn(*s, device=dev, dtype=BF)  # noqa: E731
    for (b, hq, hkv, d) in [(1, 9, 3, 64), (1, 32, 8, 128), (32, 32, 8, 128)]:
        for T in (1024, 8192, 32768):
            yield ("decode_attention", f"b{b} h{hq}/{hkv} d{d} T{T}", 2 * b * hkv * T * d * 2,
                   lambda b=b, hq=hq, hkv=hkv, d=d, T=T: (r(b, hq, 1, d), r(b, hkv, T, d), r(b, hkv, T, d)),
                   [("torch_sdpa", sdpa)])
    c_rope = torch.compile(rope_rotate_half, dynamic=False)
    for n in (1, 4096, 32768):
        yield ("rope_neox", f"{n}x(32+8)x128", 2 * n * 40 * 128 * 2 + n * 8,
               lambda n=n: (r(n, 32, 128), r(n, 8, 128), r(n, 64), r(n, 64)),
               [("torch_ref", rope_rotate_half), ("compile", c_rope)])
    c_topk = torch.compile(topk_topp, dynamic=False)
    argmax = lambda x: x.argmax(-1)  # noqa: E731
    c_argmax = torch.compile(argmax, dynamic=False)
    for (b, V) in [(1, 128256), (64, 128256), (256, 151936)]:
        yield ("sampling_topk_topp", f"{b}x{V}", b * V * 2, lambda b=b, V=V: (r(b, V),),
               [("torch_sort", topk_topp), ("compile", c_topk)])
        yield ("argmax", f"{b}x{V}", b * V * 2, lambda b=b, V=V: (r(b, V),), [("torch", argmax), ("compile", c_argmax)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--csv", default="peers_model.csv")
    ap.add_argument("--ops", default="", help="comma list of the ops above to time (default: all)")
    a = ap.parse_args()
    only = set(filter(None, a.ops.split(",")))
    gpu = torch.cuda.get_device_name()
    rows = []
    for op, shape, nbytes, make, impls in cases():
        if only and op not in only:
            continue
        try:
            sets = [make() for _ in range(nsets(nbytes))]
        except torch.OutOfMemoryError:
            print(f"{op} {shape}: out of memory, skipped", flush=True)
            continue
        for name, fn in impls:
            time_peer(rows, dict(gpu=gpu, op=op, shape=shape, dtype="bf16", impl=name), fn, sets, nbytes,
                      f"{op} {shape} {name}", f"{op:20s} {shape:>24s} bf16 {name:12s}")
        del sets
        torch.cuda.empty_cache()
    with open(a.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["gpu", "op", "shape", "dtype", "impl", "us", "gbs"])
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
