#!/usr/bin/env python3
"""Quantized GEMV variants from a bench_ops --variants CSV (rows quant_gemv_*): a markdown table
(µs per variant, % of measured copy bandwidth of the best, the automatic choice) and a PNG of
each variant's time relative to the automatic choice.

Usage: bench/plot_quant.py CSV --md OUT.md --png OUT.png [--commit SHA] [--focus VARIANT]
(--focus: the variant whose speed over the best of the others gets the last column; default mma_stream)
"""
import argparse
import csv
from collections import OrderedDict


def load(path):
    table = OrderedDict()  # (format, shape, dtype) -> {impl: (us, pct_copy)}
    meta = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            if not r["op"].startswith("quant_gemv_"):
                continue
            meta = {k: r[k] for k in ("gpu", "driver", "cuda", "commit", "copy_gbs")}
            key = (r["op"][len("quant_gemv_"):], r["shape"], r["dtype"])
            impl = r["impl"].replace("variant:cuda_", "") if r["impl"].startswith("variant:") else "auto"
            table.setdefault(key, {})[impl] = (float(r["us"]), float(r["pct_copy"]))
    return table, meta


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--md", required=True)
    ap.add_argument("--png", required=True)
    ap.add_argument("--commit", default=None, help="overrides the CSV's commit column")
    ap.add_argument("--focus", default="mma_stream", help="variant compared with the best of the others")
    a = ap.parse_args()
    table, meta = load(a.csv)
    commit = a.commit or meta.get("commit", "unknown")
    impls = [i for i in ("warp_per_column", "row_stream", "mma_blocks", "mma_stream", "bulk_stream", "mma_diag")
             if any(i in v for v in table.values())]
    lines = [f"# Quantized GEMV variants on {meta.get('gpu')} (driver {meta.get('driver')}, CUDA runtime "
             f"{meta.get('cuda')}, commit {commit})", "",
             f"M = 1, `bench_ops --ops quant_matmul --variants`: CUDA-graph replay, inputs rotated past L2, median of "
             f"7 replays, every variant in the same run. Measured copy bandwidth {float(meta.get('copy_gbs', 0)):.0f} GB/s; "
             f"% copy counts the packed weight bytes + x + out. µs; **bold**: the fastest.", "",
             "| format | N×K | x | " + " | ".join(impls) + f" | auto (today's routing) | best % copy | {a.focus} vs the best other |",
             "|---|---|---|" + "---|" * len(impls) + "---|---|---|"]
    for (fmt, shape, dt), v in table.items():
        best = min(us for k, (us, _) in v.items() if k != "auto")
        cells = []
        for i in impls:
            if i not in v:
                cells.append("—")
                continue
            us = v[i][0]
            cells.append(f"**{us:.2f}**" if us == best else f"{us:.2f}")
        pct = max(p for k, (_, p) in v.items() if k != "auto")
        auto = v.get("auto", (float("nan"), 0))[0]
        others = [us for k, (us, _) in v.items() if k not in ("auto", a.focus)]
        ratio = f"{min(others) / v[a.focus][0]:.2f}×" if a.focus in v and others else "—"
        lines.append(f"| {fmt} | {shape} | {dt} | " + " | ".join(cells) + f" | {auto:.2f} | {pct:.1f}% | {ratio} |")
    open(a.md, "w").write("\n".join(lines) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = list(table.keys())
    fig, ax = plt.subplots(figsize=(12, 4.8))
    width = 0.8 / len(impls)
    for j, i in enumerate(impls):
        xs, ys = [], []
        for n, k in enumerate(keys):
            if i in table[k] and "auto" in table[k]:
                xs.append(n + (j - (len(impls) - 1) / 2) * width)
                ys.append(table[k]["auto"][0] / table[k][i][0])
        ax.bar(xs, ys, width, label=i)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{f}\n{s}\n{d}" for f, s, d in keys], fontsize=7)
    ax.set_ylabel("speed vs the automatic choice (>1: faster)")
    ax.set_title(f"Quantized GEMV (M = 1) variants, {meta.get('gpu')}, commit {commit}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)


if __name__ == "__main__":
    main()
