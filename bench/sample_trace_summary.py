#!/usr/bin/env python3
"""Medians of cuda_cluster_local_topk's phase cycles (KS_SAMPLE_TRACE=1 lines from bench_ops on
stdin), one line per (L, C) configuration: "sample trace L=.. C=.. (median of N launches; SM
cycles): load .., select .., ...". Used by scripts/gpu_profile_ops.sh and gpu_sampling_check.sh."""
import re
import statistics
import sys

groups = {}
for line in sys.stdin:
    if "sample trace" not in line:
        continue
    head, _, rest = line.partition("(")
    fields = re.findall(r"([a-z+]+) (-?\d+)", rest.split(":", 1)[1])
    groups.setdefault(head.strip(), []).append(fields)
for head, runs in groups.items():
    names = [n for n, _ in runs[0]]
    med = [statistics.median(int(r[i][1]) for r in runs) for i in range(len(names))]
    print(head, "(median of", len(runs), "launches; SM cycles):", ", ".join(f"{n} {m:.0f}" for n, m in zip(names, med)))
