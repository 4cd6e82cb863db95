#!/usr/bin/env python3
"""Runs torch scaled_dot_product_attention (GQA, bf16, one query token; the peers' call in
bench/peers_model.py) a few times per decode shape, for Nsight Compute to show which kernels SDPA
launches there, their grids and durations (scripts/gpu_attention_check.sh, stage ncu_sdpa).

Usage: bench/sdpa_probe.py "b1 h9/3 d64 T32768" ["b1 h32/8 d128 T8192" ...]
"""
import re
import sys

import torch
import torch.nn.functional as F

for shape in sys.argv[1:]:
    b, h, kvh, d, t = map(int, re.fullmatch(r"b(\d+) h(\d+)/(\d+) d(\d+) T(\d+)", shape).groups())
    q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, kvh, t, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, kvh, t, d, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.cuda.synchronize()
    print("ran", shape, flush=True)
