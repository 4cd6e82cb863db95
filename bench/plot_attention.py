"""Decode attention on the H200: kernscope's CUDA variants and torch SDPA as KV-read bandwidth.

Reads a bench_ops --variants CSV (its variant rows, e.g. docs/perf/h200_attention_mma_575f9b9.csv)
and one or more report CSVs (e.g. docs/perf/h200_model.csv: their torch_sdpa rows and their
kernscope rows: the automatic choice, and runs under a switch such as "kernscope
KS_ATTN_SPLIT=0"), and writes a grouped bar chart of GB/s per shape (PNG); each bar is labelled
with its commit. Usage:
  python3 bench/plot_attention.py --variants A.csv --peers B.csv [C.csv ...] --out docs/perf/h200_attention_mma.png
"""
import argparse
import csv


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", required=True)
    ap.add_argument("--peers", required=True, nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = {}
    shapes = []
    sources = [(a.variants, lambda r: r["impl"].startswith("variant:"))]
    sources += [(p, lambda r: r["impl"] == "torch_sdpa" or r["impl"].startswith("kernscope")) for p in a.peers]
    for path, keep in sources:
        with open(path) as f:
            for r in csv.DictReader(f):
                if r["op"] != "decode_attention" or r["dtype"] != "bf16" or " of " in r["shape"] or not keep(r):
                    continue
                impl = r["impl"].replace("variant:", "")
                if impl == "cuda_cta_per_head":
                    continue
                if impl == "kernscope":
                    impl = "kernscope (automatic)"
                if r.get("commit"):  # (peers_model.py's CSVs have no commit column: same call)
                    impl += " @ " + r["commit"]
                rows[(r["shape"], impl)] = float(r["gbs"])
                if r["shape"] not in shapes:
                    shapes.append(r["shape"])
    impls = sorted({i for _, i in rows})
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 4.5))
    w = 0.8 / max(1, len(impls))
    for k, impl in enumerate(impls):
        xs = [i + k * w for i in range(len(shapes))]
        ax.bar(xs, [rows.get((s, impl), 0.0) for s in shapes], width=w, label=impl)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(shapes))])
    ax.set_xticklabels(shapes, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("GB/s of K and V read")
    ax.set_title("paged decode attention, bf16, H200 (CUDA-graph replay, inputs rotated past L2)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)


if __name__ == "__main__":
    main()
