#!/usr/bin/env python3
"""Top-k/top-p sampling and argmax on the GPU against PyTorch: one bench_ops CSV (`--ops
sample,argmax --variants`, with tagged `kernscope[SETTING]` rows from gpu_sampling_check.sh) and the
PyTorch peers' CSV of the same call (bench/peers_model.py: torch_sort / torch / compile) give a
markdown table per op (µs per implementation and shape, kernscope's speed-up over PyTorch's
fastest) and a PNG of µs per shape (log scale).

Usage: bench/plot_sampling.py KERNSCOPE.csv PEERS.csv --md OUT.md --png OUT.png [--ours IMPL ...]
"""
import argparse
import csv
from collections import OrderedDict


def load(ks_path, peers_path):
    table = OrderedDict()  # op -> shape -> {impl: us}
    meta = {}
    for r in csv.DictReader(open(ks_path)):
        meta = {k: r[k] for k in ("gpu", "driver", "cuda", "commit", "copy_gbs")}
        impl = r["impl"]
        impl = impl[len("variant:"):] if impl.startswith("variant:") else impl
        table.setdefault(r["op"], OrderedDict()).setdefault(r["shape"], {})[impl] = float(r["us"])
    peers = set()
    for r in csv.DictReader(open(peers_path)):
        if r["op"] in table and r["shape"] in table[r["op"]]:
            table[r["op"]][r["shape"]]["torch " + r["impl"]] = float(r["us"])
            peers.add("torch " + r["impl"])
    return table, meta, peers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kernscope_csv")
    ap.add_argument("peers_csv")
    ap.add_argument("--md", required=True)
    ap.add_argument("--png", required=True)
    ap.add_argument("--peers-from", help="where the peers' CSV comes from, when not the same call")
    ap.add_argument("--ours", action="append", help="impl whose speed-up over PyTorch gets a row (repeatable; "
                    "default kernscope); the first is plotted")
    a = ap.parse_args()
    table, meta, peers = load(a.kernscope_csv, a.peers_csv)
    a.ours = a.ours or ["kernscope"]
    lines = [f"# Sampling and argmax on {meta.get('gpu')} (driver {meta.get('driver')}, CUDA runtime "
             f"{meta.get('cuda')}, commit {meta.get('commit')})", "",
             "bf16 logits; sampling at temperature 1, top-k 50, top-p 0.9. `bench_ops --ops sample,argmax "
             "--variants` (CUDA-graph replay, inputs rotated past L2, median) and the PyTorch peers "
             "(bench/peers_model.py: the sort-based top-k/top-p sampler and `torch.argmax`, eager and "
             "torch.compile, CUDA-graph replay) " + (a.peers_from or "in the same call") + ". µs; `kernscope` is the automatic choice, "
             "`kernscope[X]` the same under the setting X; **bold**: the fastest.", ""]
    for op, shapes in table.items():
        impls = []
        for v in shapes.values():
            impls += [i for i in v if i not in impls]
        mine = [i for i in impls if i not in peers]
        theirs = [i for i in impls if i in peers]
        lines += [f"## {op}", "", "| impl | " + " | ".join(shapes) + " |", "|---|" + "---|" * len(shapes)]
        for i in mine + theirs:
            cells = []
            for v in shapes.values():
                best = min(v.values())
                cells.append("—" if i not in v else (f"**{v[i]:.2f}**" if v[i] == best else f"{v[i]:.2f}"))
            lines.append(f"| {i} | " + " | ".join(cells) + " |")
        for ours in a.ours if theirs else []:
            if not any(ours in v for v in shapes.values()):
                continue
            ratio = []
            for v in shapes.values():
                t = [v[i] for i in theirs if i in v]
                ratio.append(f"{min(t) / v[ours]:.1f}×" if t and ours in v else "—")
            lines.append(f"| {ours}'s speed-up over PyTorch's fastest | " + " | ".join(ratio) + " |")
        lines.append("")
    open(a.md, "w").write("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(table), figsize=(6 * len(table), 4.5), squeeze=False)
    for ax, (op, shapes) in zip(axes[0], table.items()):
        show = [a.ours[0] if any(a.ours[0] in v for v in shapes.values()) else "kernscope"] + sorted({i for v in shapes.values() for i in v if i.startswith("torch ")})
        width = 0.8 / len(show)
        for k, i in enumerate(show):
            xs = [n + k * width for n, v in enumerate(shapes.values()) if i in v]
            ys = [v[i] for v in shapes.values() if i in v]
            ax.bar(xs, ys, width, label=i)
        ax.set_xticks([n + 0.4 - width / 2 for n in range(len(shapes))])
        ax.set_xticklabels(list(shapes))
        ax.set_yscale("log")
        ax.set_ylabel("µs (log scale; lower is better)")
        ax.set_title(f"{op}, bf16 ({meta.get('gpu')}, {meta.get('commit')})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)


if __name__ == "__main__":
    main()
