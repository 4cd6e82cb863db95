"""quant_matmul with dense BF16 weights (cuda_warp_per_column's dense kernel) against kernscope's
gemv and torch's (bench/peers.py: torch.mv, its FP32 contract form and torch.compile), one GPU call.

  python3 bench/plot_quant_dense.py BENCH_CSV PEERS_CSV --csv OUT.csv --md OUT.md --png OUT.png

BENCH_CSV: bench_ops --ops gemv,quant_matmul --dtypes bf16 (rows gemv and quant_gemv_bf16);
PEERS_CSV: bench/peers.py --ops gemv --dtypes bf16 from the same call. The peers' rows get the
bench's metadata (GPU, driver, CUDA, commit, copy bandwidth) and their % of it; OUT.csv holds both."""
import argparse
import csv

from plot_common import pct_bars


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("bench")
    ap.add_argument("peers")
    ap.add_argument("--csv", required=True)
    ap.add_argument("--md", required=True)
    ap.add_argument("--png", required=True)
    a = ap.parse_args()
    rows = [r for r in csv.DictReader(open(a.bench)) if r["op"] in ("gemv", "quant_gemv_bf16") and r["dtype"] == "bf16"]
    meta = rows[0]
    copy = float(meta["copy_gbs"])
    shapes = sorted({r["shape"] for r in rows if r["op"] == "quant_gemv_bf16"}, key=lambda s: [int(v) for v in s.split("x")])
    for p in csv.DictReader(open(a.peers)):
        if p["dtype"] != "bf16" or p["shape"] not in shapes:
            continue
        rows.append(dict(gpu=meta["gpu"], driver=meta["driver"], cuda=meta["cuda"], commit=meta["commit"], op="gemv",
                         shape=p["shape"], dtype="bf16", impl=p["impl"], config="torch.mv" if p["impl"] == "torch_native"
                         else p["impl"], us=p["us"], gbs=p["gbs"], pct_copy=f"{100 * float(p['gbs']) / copy:.1f}",
                         copy_gbs=meta["copy_gbs"]))
    with open(a.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(meta))
        w.writeheader()
        w.writerows(rows)

    def label(r):
        return "kernscope quant_matmul (dense bf16)" if r["op"] == "quant_gemv_bf16" else (
            "kernscope gemv" if r["impl"] == "kernscope" else f"torch {r['impl']}")

    impls = []
    for r in rows:
        if label(r) not in impls:
            impls.append(label(r))
    us = {(label(r), r["shape"]): float(r["us"]) for r in rows}
    pct = {(label(r), r["shape"]): float(r["pct_copy"]) for r in rows}
    base = "kernscope quant_matmul (dense bf16)"
    with open(a.md, "w") as f:
        f.write(f"One row of bf16 x times bf16 weights [N, K] on {meta['gpu']} (driver {meta['driver']}, CUDA "
                f"{meta['cuda']}), commit {meta['commit']}, CUDA-graph replay, inputs rotated past L2, median; "
                f"copy bandwidth {copy:.0f} GB/s. Cells: µs (% of copy bandwidth), then the dense quant_matmul's time "
                "over each implementation's (> 1: the other is faster).\n\n")
        f.write("| N x K | " + " | ".join(impls) + " |\n|" + "---|" * (len(impls) + 1) + "\n")
        for s in shapes:
            cells = []
            for i in impls:
                if (i, s) not in us:
                    cells.append("")
                    continue
                c = f"{us[(i, s)]:.2f} ({pct[(i, s)]:.0f}%)"
                if i != base and (base, s) in us:
                    c += f", {us[(base, s)] / us[(i, s)]:.2f}×"
                cells.append(c)
            f.write(f"| {s} | " + " | ".join(cells) + " |\n")
    series = [(i, [pct.get((i, s), 0.0) for s in shapes]) for i in impls]
    pct_bars(a.png, shapes, series, copy, f"dense bf16 GEMV, {meta['gpu']}, {meta['commit']}")


if __name__ == "__main__":
    main()
