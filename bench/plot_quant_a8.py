#!/usr/bin/env python3
"""quant_matmul_a8 against quant_matmul from one bench_ops CSV (--variants --ops
quant_matmul,quant_matmul_a8): a markdown table (µs and % of the measured copy bandwidth of each
op's automatic choice, the best FP32-x variant, cuda_a8_warp, the ratio) and a PNG of % copy per
shape.

Usage: bench/plot_quant_a8.py CSV --md OUT.md --png OUT.png
"""
import csv
from collections import OrderedDict

from plot_common import args, pct_bars


def load(path):
    t = OrderedDict()  # (format, shape, dtype) -> {"auto", "a8", "a8_warp", "best"}
    meta = {}
    for r in csv.DictReader(open(path)):
        if not r["op"].startswith("quant_gemv_"):
            continue
        meta = {k: r[k] for k in ("gpu", "commit", "copy_gbs")}
        a8 = r["op"].startswith("quant_gemv_a8_")
        fmt = r["op"].rsplit("_", 2)[-2] + "_" + r["op"].rsplit("_", 1)[-1]
        e = t.setdefault((fmt, r["shape"], r["dtype"]), {})
        us, pct = float(r["us"]), float(r["pct_copy"])
        if r["impl"] == "kernscope":
            e["a8" if a8 else "auto"] = (us, pct)
        elif a8 and r["impl"] == "variant:cuda_a8_warp":
            e["a8_warp"] = (us, pct)
        elif not a8 and ("best" not in e or us < e["best"][0]):
            e["best"] = (us, r["impl"].replace("variant:", ""))
    return t, meta


def main():
    a = args(__doc__)
    t, meta = load(a.csv)
    lines = [
        "| format | N×K | x | quant_matmul (auto) µs | % copy | best FP32-x variant µs | quant_matmul_a8 (auto) µs | "
        "% copy | cuda_a8_warp µs | quant_matmul ÷ quant_matmul_a8 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (fmt, sh, dt), e in t.items():
        q, b, c, w = e["auto"], e["best"], e["a8"], e["a8_warp"]
        pct = f"**{c[1]:.1f}%**" if c[1] >= 80 else f"{c[1]:.1f}%"
        lines.append(f"| {fmt} | {sh} | {dt} | {q[0]:.2f} | {q[1]:.1f}% | {b[0]:.2f} ({b[1]}) | {c[0]:.2f} | {pct} | "
                     f"{w[0]:.2f} | {q[0] / c[0]:.2f}× |")
    open(a.md, "w").write("\n".join(lines) + "\n")
    keys = list(t)
    pct_bars(a.png, [f"{f} {s} {d}" for f, s, d in keys],
             [("quant_matmul (FP32 x)", [t[k]["auto"][1] for k in keys]),
              ("quant_matmul_a8 (int8 x)", [t[k]["a8"][1] for k in keys])], meta["copy_gbs"],
             f"Decode GEMV (M = 1) on {meta['gpu']}, commit {meta['commit']}: automatic choice of each op")

if __name__ == "__main__":
    main()
