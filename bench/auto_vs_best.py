#!/usr/bin/env python3
"""Is the automatic choice within 3% of the best variant? (issue 6's benchmark check)

Reads bench_ops --variants output (rows whose impl is "variant:<name>" next to the run's
automatic rows) and prints a markdown table per (op, shape, dtype): the automatic time and
variant (from its launch config), every variant's time, the best, and auto / best. Exit status 1
when some row is more than --tolerance slower than the best variant.

usage: auto_vs_best.py bench.csv [--tolerance 0.03] [--out auto_vs_best.md]
"""
import argparse
import csv
import sys
from collections import OrderedDict


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--tolerance", type=float, default=0.03)
    ap.add_argument("--out")
    a = ap.parse_args()
    groups = OrderedDict()
    for r in csv.DictReader(open(a.csv)):
        g = groups.setdefault((r["op"], r["shape"], r["dtype"]), {"auto": None, "variants": {}})
        if r["impl"].startswith("variant:"):
            g["variants"][r["impl"][len("variant:"):]] = float(r["us"])
        elif "[" not in r["impl"] and not r["impl"].endswith("_after_append") and g["auto"] is None:
            # the automatic choice's own row: not a tagged experiment, nor the other entry point
            # bench_ops times beside it (decode attention's paged_attention_after_append)
            g["auto"] = (float(r["us"]), r["config"])
    lines = ["| op | shape | dtype | auto µs (config) | variants µs | best | auto / best | within |",
             "|---|---|---|---|---|---|---|---|"]
    misses = 0
    for (op, shape, dtype), g in groups.items():
        if not g["variants"] or g["auto"] is None:
            continue
        best_name, best = min(g["variants"].items(), key=lambda kv: kv[1])
        auto_us, cfg = g["auto"]
        ratio = auto_us / best
        ok = ratio <= 1 + a.tolerance
        misses += not ok
        vs = ", ".join(f"{n} {u:.2f}" for n, u in sorted(g["variants"].items(), key=lambda kv: kv[1]))
        lines.append(f"| {op} | {shape} | {dtype} | {auto_us:.2f} ({cfg}) | {vs} | {best_name} | {ratio:.3f} | "
                     f"{'yes' if ok else '**no**'} |")
    text = "\n".join(lines) + f"\n\nAutomatic choice within {100 * a.tolerance:.0f}% of the best variant at " \
                              f"{len(lines) - 2 - misses} of {len(lines) - 2} shapes.\n"
    if a.out:
        open(a.out, "w").write(text)
    sys.stdout.write(text)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
