#!/usr/bin/env python3
"""Eager host overhead per call: kernscope.rms_norm vs torch.nn.functional.rms_norm.

A 1 x 4096 row is so small that a tight loop of eager calls is bound by the host
(Python, argument handling, DLPack import, launch), not by the kernel: the time
per call of such a loop is the per-call host overhead. Each configuration is
timed `--repeats` times over `--iters` calls after a warm-up; the median and the
minimum are reported, in microseconds per call. That loop is bound by whichever of
the host and the device is slower (an eager launch costs the device a few µs even
for a tiny kernel), so a third column, `host`, times the calling thread alone: the
median over bursts of `--burst` calls that start with an idle device and end
without waiting for it (short enough never to fill the launch queue).

Rows:
  torch F.rms_norm              the PyTorch op (the baseline)
  kernscope rms_norm            the public function: allocation + DLPack + C call
  kernscope rms_norm(out=)      without the output allocation
  kernscope _C.rms_norm         the extension alone (no Python layer)
  torch.ops.kernscope.rms_norm  the torch.library custom op (what torch.compile calls)
  torch.empty_like              allocation alone, for scale

Usage (on the GPU machine): python python/bench_overhead.py [--device cuda] [--dtype bf16]
        [--rows 1] [--hidden 4096] [--iters 20000] [--repeats 7] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--dtype", default="bf16", choices=["fp16", "bf16", "fp32"])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--burst", type=int, default=100, help="calls per host-only burst (below the launch queue depth)")
    ap.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    args = ap.parse_args()

    # Run as python/bench_overhead.py, sys.path[0] is python/, whose kernscope/ is the
    # source tree (no built extension): import the installed package instead.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]

    import torch
    import torch.nn.functional as F

    import kernscope as ks

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    x = torch.randn(args.rows, args.hidden, device=device, dtype=dtype)
    w = torch.randn(args.hidden, device=device, dtype=dtype)
    out = torch.empty_like(x)
    eps = 1e-6
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    cases = [
        ("torch F.rms_norm", lambda: F.rms_norm(x, (args.hidden,), w, eps)),
        ("kernscope rms_norm", lambda: ks.rms_norm(x, w, eps)),
        ("kernscope rms_norm(out=)", lambda: ks.rms_norm(x, w, eps, out=out)),
        ("kernscope _C.rms_norm", lambda: ks._C.rms_norm((out, x, w), eps, 0, 0, 0, False)),
        ("torch.ops.kernscope.rms_norm", lambda: torch.ops.kernscope.rms_norm(x, w, eps, "auto")),
        ("torch.empty_like", lambda: torch.empty_like(x)),
    ]

    print(f"kernscope {ks.__version__}, torch {torch.__version__}, python {platform.python_version()}, "
          f"device {torch.cuda.get_device_name() if device.startswith('cuda') else platform.processor() or 'cpu'}")
    print(f"rms_norm {args.rows}x{args.hidden} {args.dtype} on {device}; "
          f"kernscope variant: {_variant(ks, args.dtype, device)}")
    print(f"{args.iters} calls x {args.repeats} repeats; microseconds per call\n")
    print(f"{'case':32s} {'median':>9s} {'min':>9s} {'host':>9s}")
    rows = []
    for name, fn in cases:
        try:
            fn()
            sync()
        except Exception as e:  # e.g. no CUDA kernel yet: BackendUnavailableError
            print(f"{name:32s} {'n/a':>9s} {'':>9s}  ({type(e).__name__}: {str(e)[:80]})")
            rows.append({"case": name, "median_us": "", "min_us": "", "host_us": "",
                         "note": f"{type(e).__name__}: {e}"})
            continue
        for _ in range(min(2000, args.iters)):
            fn()
        sync()
        samples, host = [], []
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fn()
            sync()
            samples.append((time.perf_counter() - t0) / args.iters * 1e6)
            # Host time alone: a burst short enough that the device's launch queue never
            # fills, timed without waiting for the device (the loop above is bound by
            # whichever of host and device is slower).
            for _ in range(args.repeats):
                sync()
                t0 = time.perf_counter()
                for _ in range(args.burst):
                    fn()
                host.append((time.perf_counter() - t0) / args.burst * 1e6)
        sync()
        med, lo, hmed = statistics.median(samples), min(samples), statistics.median(host)
        print(f"{name:32s} {med:9.2f} {lo:9.2f} {hmed:9.2f}")
        rows.append({"case": name, "median_us": f"{med:.3f}", "min_us": f"{lo:.3f}", "host_us": f"{hmed:.3f}",
                     "note": ""})

    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=["case", "median_us", "min_us", "host_us", "note", "device", "dtype", "shape",
                                               "torch", "kernscope"])
            wr.writeheader()
            for r in rows:
                wr.writerow({**r, "device": device, "dtype": args.dtype, "shape": f"{args.rows}x{args.hidden}",
                             "torch": torch.__version__, "kernscope": ks.__version__})
    return 0


def _variant(ks, dtype: str, device: str) -> str:
    try:
        return "%s (%s)" % ks.which("rms_norm", dtype, "cuda" if device.startswith("cuda") else "cpu")
    except Exception as e:
        return f"none: {e}"


if __name__ == "__main__":
    sys.exit(main())
