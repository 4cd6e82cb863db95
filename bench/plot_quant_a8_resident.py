#!/usr/bin/env python3
"""quant_matmul_a8's CUDA variants side by side from one scripts/gpu_quant_check.sh call
(KS_QUANT_A8_VARIANTS=1: bench_ops --variants --ops quant_matmul_a8, bf16 x, M = 1; the tagged rows
that follow in the same CSV are left out): a markdown table of µs and % of the measured copy
bandwidth per variant and the automatic choice, with cuda_a8_bulk_stream ÷ cuda_a8_resident, and a
PNG of % copy per shape.

Usage: bench/plot_quant_a8_resident.py CSV --md OUT.md --png OUT.png
"""
import csv
from collections import OrderedDict

from plot_common import args, pct_bars

VARIANTS = ("cuda_a8_resident", "cuda_a8_bulk_stream", "cuda_a8_warp")


def load(path):
    t = OrderedDict()  # (format, shape) -> {"auto": (us, pct, config), variant: (us, pct)}
    meta = {}
    for r in csv.DictReader(open(path)):
        if not r["op"].startswith("quant_gemv_a8_") or r["dtype"] != "bf16" or "[" in r["impl"]:
            continue
        meta = {k: r[k] for k in ("gpu", "commit", "copy_gbs")}
        e = t.setdefault((r["op"][len("quant_gemv_a8_"):], r["shape"]), {})
        us, pct = float(r["us"]), float(r["pct_copy"])
        if r["impl"] == "kernscope":
            e["auto"] = (us, pct, r["config"].split(" ")[0])
        elif r["impl"].startswith("variant:"):
            e[r["impl"][len("variant:"):]] = (us, pct)
    return t, meta


def main():
    a = args(__doc__)
    t, meta = load(a.csv)
    lines = [
        "| format | N×K | automatic choice µs | % copy | cuda_a8_resident µs | cuda_a8_bulk_stream µs | cuda_a8_warp µs "
        "| bulk ÷ resident |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(e, v):
        return f"{e[v][0]:.2f}" if v in e else "declines"

    for (fmt, sh), e in t.items():
        au = e["auto"]
        pct = f"**{au[1]:.1f}%**" if au[1] >= 80 else f"{au[1]:.1f}%"
        ratio = (f"{e['cuda_a8_bulk_stream'][0] / e['cuda_a8_resident'][0]:.2f}×"
                 if "cuda_a8_resident" in e and "cuda_a8_bulk_stream" in e else "")
        lines.append(f"| {fmt} | {sh} | {au[0]:.2f} ({au[2]}) | {pct} | {cell(e, 'cuda_a8_resident')} | "
                     f"{cell(e, 'cuda_a8_bulk_stream')} | {cell(e, 'cuda_a8_warp')} | {ratio} |")
    open(a.md, "w").write("\n".join(lines) + "\n")
    keys = list(t)
    pct_bars(a.png, [f"{f} {s}" for f, s in keys],
             [(v, [t[k][v][1] if v in t[k] else 0 for k in keys]) for v in VARIANTS], meta["copy_gbs"],
             f"quant_matmul_a8 variants, bf16 x, M = 1, on {meta['gpu']}, commit {meta['commit']} (0: declines)")

if __name__ == "__main__":
    main()
