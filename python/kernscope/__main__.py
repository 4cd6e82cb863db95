"""``python -m kernscope``: what this installation can run, and the routing table that
orders it. Needs no GPU: the CUDA variants and cells are listed either way, with the
CUDA backend's status."""
from __future__ import annotations

import sys

import kernscope as ks


def _bound(x: object) -> str:
    return "any" if x is None else str(x)


def main() -> int:
    print(f"kernscope {ks.__version__}; CUDA backend: "
          f"{'available' if ks.backend_available('cuda') else 'not available'}")
    print("\nvariants (op, backend: name [dtypes])")
    for r in ks.available():
        print(f"  {r.op:<20} {r.backend:<6} {r.variant} [{','.join(r.dtypes)}]")
    t = ks.routing_table()
    print(f"\nrouting table ({', '.join(t['files'])}; first matching cell wins, then priority order)")
    for c in t["cells"]:
        rows = f"{_bound(c['rows'][0])}..{_bound(c['rows'][1])}"
        cols = f"{_bound(c['cols'][0])}..{_bound(c['cols'][1])}"
        print(f"  {c['op']:<18} {c['backend']:<5} {c['arch']:<6} {c['dtype']:<5} rows {rows:<10} cols {cols:<10} "
              f"{c['basis']:<9} {' > '.join(c['order'])}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `python -m kernscope | head`: the reader left; not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        sys.exit(0)
