#!/usr/bin/env python3
"""Batched quant_matmul (rows quant_matmul_rows_* of a bench_ops --ops quant_matmul_rows --variants
CSV): a markdown table per matrix (µs per implementation at each row count M, cuda_mma_rows'
speed over the dense FP32 gemm and over the best other variant) and a PNG of µs against M; rows
silu_down_rows_* (SiLU + the down projection: silu_and_mul_quant_matmul's cuda_mma_rows against
the two calls) get a table of their own.

Usage: bench/plot_qmm_rows.py CSV --md OUT.md --png OUT.png
"""
import argparse
import csv
from collections import OrderedDict

IMPLS = ["mma_rows", "staged_x", "warp_per_column", "warp_per_column_m16", "dense_fp32_gemm"]


def load(path):
    table = OrderedDict()  # (format, matrix) -> {M: {impl: us}}
    silu = OrderedDict()  # (format, matrix, M) -> {impl: us}
    meta = {}
    for r in csv.DictReader(open(path)):
        if r["op"].startswith("silu_down_rows_"):
            m, matrix = r["shape"].split(" ")
            silu.setdefault((r["op"][len("silu_down_rows_"):], matrix, int(m[1:])), {})[r["impl"]] = float(r["us"])
            continue
        if not r["op"].startswith("quant_matmul_rows_"):
            continue
        meta = {k: r[k] for k in ("gpu", "driver", "cuda", "commit", "copy_gbs")}
        m, matrix = r["shape"].split(" ")
        impl = r["impl"]
        if impl.startswith("kernscope["):  # the automatic choice under a setting (gpu_rows_check.sh's A/B)
            impl = "auto" + impl[len("kernscope"):]
        else:
            impl = impl[len("variant:cuda_"):] if impl.startswith("variant:") else ("auto" if impl == "kernscope" else impl)
        table.setdefault((r["op"][len("quant_matmul_rows_"):], matrix), OrderedDict()).setdefault(int(m[1:]), {})[impl] = (
            float(r["us"]), float(r["pct_copy"]))
    return table, meta, silu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--md", required=True)
    ap.add_argument("--png", required=True)
    a = ap.parse_args()
    table, meta, silu = load(a.csv)
    lines = [f"# Batched quant_matmul on {meta.get('gpu')} (driver {meta.get('driver')}, CUDA runtime {meta.get('cuda')}, "
             f"commit {meta.get('commit')})", "",
             "fp32 x of M rows times SmolLM2's packed matrices (N×K), `bench_ops --ops quant_matmul_rows --variants`: "
             "CUDA-graph replay, inputs rotated past L2, median, every implementation in the same run. "
             "`dense_fp32_gemm` is ks::gemm (cuBLASLt, FP32 compute) on a dequantized FP32 copy of the matrix, the "
             "path SmolLM2's batched decode took from 16 sequences before cuda_mma_rows. µs; **bold**: the fastest; "
             f"% copy: cuda_mma_rows' packed weight + x + out bytes against the measured copy bandwidth "
             f"({float(meta.get('copy_gbs', 0)):.0f} GB/s).", "",
             "| format | N×K | M | " + " | ".join(IMPLS) + " | auto | mma_rows vs dense | mma_rows vs best other variant | mma_rows % copy |",
             "|---|---|---|" + "---|" * len(IMPLS) + "---|---|---|---|"]
    for (fmt, matrix), by_m in table.items():
        for m, v in by_m.items():
            best = min(us for k, (us, _) in v.items() if not k.startswith("auto"))
            cells = [("—" if i not in v else (f"**{v[i][0]:.2f}**" if v[i][0] == best else f"{v[i][0]:.2f}")) for i in IMPLS]
            mr = v.get("mma_rows", (float("nan"), 0))
            others = [us for k, (us, _) in v.items() if not k.startswith("auto") and k not in ("mma_rows", "dense_fp32_gemm")]
            vs_dense = f"{v['dense_fp32_gemm'][0] / mr[0]:.2f}×" if "dense_fp32_gemm" in v else "—"
            vs_other = f"{min(others) / mr[0]:.2f}×" if others else "—"
            lines.append(f"| {fmt} | {matrix} | {m} | " + " | ".join(cells) +
                         f" | {v.get('auto', (float('nan'), 0))[0]:.2f} | {vs_dense} | {vs_other} | {mr[1]:.1f}% |")
    settings = sorted({k for by_m in table.values() for v in by_m.values() for k in v if k.startswith("auto[")})
    if settings:  # the automatic choice under each setting, against the automatic choice as built
        lines += ["", "The automatic choice under each setting (gpu_rows_check.sh's A/B; same call), µs and the speed over "
                  "the default (>1: faster):", "",
                  "| format | N×K | M | auto | " + " | ".join(f"`{t[5:-1]}`" for t in settings) + " |",
                  "|---|---|---|---|" + "---|" * len(settings)]
        for (fmt, matrix), by_m in table.items():
            for m, v in by_m.items():
                base = v.get("auto", (float("nan"), 0))[0]
                cells = [f"{v[t][0]:.2f} ({base / v[t][0]:.2f}×)" if t in v else "—" for t in settings]
                lines.append(f"| {fmt} | {matrix} | {m} | {base:.2f} | " + " | ".join(cells) + " |")
    if silu:  # SiLU + down: one kernel against the model's two calls
        lines += ["", "SiLU and the down projection (gate_up of M rows): `silu_and_mul_quant_matmul` pinned to "
                  "`cuda_mma_rows` (one kernel) against `silu_and_mul` then the automatic `quant_matmul` (two), µs "
                  "(same call):", "",
                  "| format | N×K | M | two calls | one kernel | speed-up |", "|---|---|---|---|---|---|"]
        for (fmt, matrix, m), v in silu.items():
            two, one = v.get("silu_and_mul+quant_matmul"), v.get("fused:cuda_mma_rows")
            ratio = f"{two / one:.2f}×" if two and one else "—"
            lines.append(f"| {fmt} | {matrix} | {m} | {two if two else float('nan'):.2f} | "
                         f"{one if one else float('nan'):.2f} | {ratio} |")
    open(a.md, "w").write("\n".join(lines) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = list(table.keys())
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.8), squeeze=False)
    for ax, k in zip(axes[0], keys):
        ms = list(table[k].keys())
        for i in IMPLS:
            pts = [(m, table[k][m][i][0]) for m in ms if i in table[k][m]]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=i)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows of x (M)")
        ax.set_ylabel("µs")
        ax.set_title(f"{k[0]} {k[1]}", fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Batched quant_matmul, fp32 x, {meta.get('gpu')}, commit {meta.get('commit')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)


if __name__ == "__main__":
    main()
