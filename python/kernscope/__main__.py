"""``python -m kernscope``: what this installation can run, and the routing table that
orders it. Needs no GPU: the CUDA variants and cells are listed either way, with the
CUDA backend's status."""
from __future__ import annotations

import sys

import kernscope as ks


def _bound(x: object) -> str:
    return "any" if x is None else str(x)


def main() -> int:
    import argparse

    # no options: --help describes the listing, anything else is refused (exit 2)
    argparse.ArgumentParser(prog="python -m kernscope", description=__doc__).parse_args()
    print(f"kernscope {ks.__version__}; CUDA backend: "
          f"{'available' if ks.backend_available('cuda') else 'not available'}")
    print("\nvariants (op, backend: name [dtypes])")
    avail = ks.available()
    w_op = max((len(r.op) for r in avail), default=0)
    w_var = max((len(r.variant) for r in avail), default=0)
    for r in avail:
        print(f"  {r.op:<{w_op}} {r.backend:<6} {r.variant:<{w_var}} [{','.join(r.dtypes)}]")
    t = ks.routing_table()
    print(f"\nrouting table ({', '.join(t['files'])}; first matching cell wins, then priority order)")
    lines = [(c["op"], c["backend"], c["arch"], c["dtype"] + ("" if c["qtype"] == "*" else ":" + c["qtype"]),
              f"{_bound(c['rows'][0])}..{_bound(c['rows'][1])}",
              f"{_bound(c['cols'][0])}..{_bound(c['cols'][1])}", c["basis"], " > ".join(c["order"]))
             for c in t["cells"]]
    widths = [max((len(line[i]) for line in lines), default=0) for i in range(7)]
    for line in lines:
        op, backend, arch, dtype, rows, cols, basis, order = line
        print(f"  {op:<{widths[0]}} {backend:<{widths[1]}} {arch:<{widths[2]}} {dtype:<{widths[3]}} "
              f"rows {rows:<{widths[4]}} cols {cols:<{widths[5]}} {basis:<{widths[6]}} {order}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `python -m kernscope | head`: the reader left; not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        sys.exit(0)
