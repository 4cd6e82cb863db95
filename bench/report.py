#!/usr/bin/env python3
"""Merges bench_ops.csv (kernscope) and peers.csv (same GPU call) into
docs/perf/h200.csv, a markdown summary with ratios, and a PNG plot of % of the
copy bandwidth measured in the same run.
usage: report.py --ours bench_ops.csv --peers peers.csv --out docs/perf [--commit SHA]
"""
import argparse
import csv
import os
from collections import defaultdict


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", required=True)
    ap.add_argument("--peers", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="h200")
    ap.add_argument("--ours-extra", default="", help="comma list of CSVs with kernscope rows under other impl names (KS_PDL=0, experiments)")
    ap.add_argument("--peer-impls", default="torch_native,compile",
                    help="peers whose best time the ratio column compares with")
    ap.add_argument("--columns", default="kernscope_nopdl:no-PDL,torch_native:torch native,compile:compile,liger:liger",
                    help="impl:title pairs shown as µs columns after kernscope's")
    ap.add_argument("--title", default="CUDA operators")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args()
    peer_impls = a.peer_impls.split(",")
    columns = [tuple(c.split(":", 1)) for c in a.columns.split(",") if c]
    ours = list(csv.DictReader(open(a.ours)))
    peers = list(csv.DictReader(open(a.peers))) if os.path.exists(a.peers) else []
    meta = ours[0]
    copy = float(meta["copy_gbs"])
    cols = ["gpu", "driver", "cuda", "commit", "op", "shape", "dtype", "impl", "config", "us", "gbs", "pct_copy"]
    extra = []  # comma list of CSVs: kernscope rows under other impl names (no-PDL, experiments)
    for path in filter(None, a.ours_extra.split(",")):
        if os.path.exists(path):
            extra += list(csv.DictReader(open(path)))
    merged = []
    for r in ours + extra:
        merged.append({c: r[c] for c in cols})
    for p in peers:
        merged.append(dict(gpu=meta["gpu"], driver=meta["driver"], cuda=meta["cuda"], commit=meta["commit"], op=p["op"],
                           shape=p["shape"], dtype=p["dtype"], impl=p["impl"], config="", us=p["us"], gbs=p["gbs"],
                           pct_copy=f"{100 * float(p['gbs']) / copy:.1f}"))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.name}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(merged)
    by = defaultdict(dict)
    for r in merged:
        by[(r["op"], r["shape"], r["dtype"])][r["impl"]] = float(r["us"])
    titles = dict(columns)
    lines = [f"# {a.title} on {meta['gpu']} (driver {meta['driver']}, CUDA runtime {meta['cuda']}, commit {meta['commit']})", "",
             f"Measured device-to-device copy bandwidth in the same run: **{copy:.0f} GB/s**. CUDA-graph replay, inputs "
             "rotated past L2, median of 7 replays (bench/bench_ops.cpp, bench/peers*.py). Ratio = best of "
             f"{', '.join(titles.get(i, i) for i in peer_impls)} ÷ kernscope (> 1: kernscope faster)."
             + (" no-PDL: the same kernels launched without programmatic dependent launch (KS_PDL=0), where measured."
                if "kernscope_nopdl" in titles else ""), "",
             "| op | shape | dtype | kernscope µs | GB/s | % copy | " + " | ".join(f"{t} µs" for _, t in columns)
             + " | ratio vs best peer |",
             "|---|---|---|---|---|---|" + "---|" * len(columns) + "---|"]
    # (the automatic choice's own row: a CSV also holds variant and tagged rows of the same shape)
    pct = {(r["op"], r["shape"], r["dtype"]): (float(r["gbs"]), float(r["pct_copy"])) for r in ours if r["impl"] == "kernscope"}
    wins = total = 0
    for key in sorted(by, key=lambda k: (k[0], k[2], k[1])):
        d = by[key]
        if "kernscope" not in d:
            continue
        peers_best = [d[i] for i in peer_impls if i in d]
        ratio = min(peers_best) / d["kernscope"] if peers_best else float("nan")
        if peers_best:  # rows without a peer are listed, not counted
            total += 1
            wins += ratio >= 1.0
        g, pc = pct[key]
        f = lambda i: f"{d[i]:.2f}" if i in d else "—"  # noqa: E731
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {d['kernscope']:.2f} | {g:.0f} | {pc:.1f} | "
                     + " | ".join(f(i) for i, _ in columns) + (f" | {ratio:.2f}× |" if peers_best else " | no peer |"))
    lines += ["", f"kernscope is at least as fast as the best of {', '.join(titles.get(i, i) for i in peer_impls)} "
              f"at {wins} of {total} rows."]
    with open(os.path.join(a.out, f"{a.name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if a.no_plot:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        ops = sorted({r["op"] for r in ours})
        fig, axes = plt.subplots(len(ops), 1, figsize=(11, 3.6 * len(ops)), squeeze=False)
        for ax, op in zip(axes[:, 0], ops):
            rows = [r for r in merged if r["op"] == op and r["dtype"] == "bf16"]
            shapes = list(dict.fromkeys(r["shape"] for r in rows))
            impls = list(dict.fromkeys(r["impl"] for r in rows))
            wdt = 0.8 / max(1, len(impls))
            for j, im in enumerate(impls):
                vals = [next((float(r["pct_copy"]) for r in rows if r["shape"] == s and r["impl"] == im), 0) for s in shapes]
                ax.bar([i + j * wdt for i in range(len(shapes))], vals, wdt, label=im)
            ax.set_xticks([i + 0.4 - wdt / 2 for i in range(len(shapes))], shapes, fontsize=8, rotation=15, ha="right")
            ax.set_ylabel("% of copy BW")
            ax.set_title(f"{op} (bf16)")
            ax.axhline(100, color="gray", lw=0.5)
            ax.legend(fontsize=7, ncol=5)
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, f"{a.name}.png"), dpi=90)
    except Exception as e:  # noqa: BLE001
        print("plot skipped:", e)


if __name__ == "__main__":
    main()
