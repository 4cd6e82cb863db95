"""What the decode-GEMV plot scripts share (bench/plot_quant_a8.py, bench/plot_quant_a8_resident.py):
their command line (one CSV in, a markdown table and a PNG out) and a grouped bar chart of
% of the measured copy bandwidth per shape with the issue's 80% line."""
import argparse


def args(doc):
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("csv")
    ap.add_argument("--md", required=True)
    ap.add_argument("--png", required=True)
    return ap.parse_args()


def pct_bars(png, labels, series, copy_gbs, title):
    """series: [(legend label, [% copy per label])], drawn side by side per label."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    x = range(len(labels))
    w = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    for j, (name, vals) in enumerate(series):
        ax.bar([i + (j - (len(series) - 1) / 2) * w for i in x], vals, w, label=name)
    ax.axhline(80, color="k", lw=0.8, ls="--", label="80% target")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(f"% of measured copy bandwidth ({float(copy_gbs):.0f} GB/s)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
