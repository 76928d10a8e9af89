"""A torch-free worker that prints training metrics (tests/test_metrics_agent.py).

    metrics_worker.py steps STEPS [--nan-rank R --nan-step S] [--go PATH] [--sleep S]

Every rank prints ``step N loss X lr Y`` (one flushed write a line) for ``STEPS`` steps,
``--sleep`` seconds apart; rank ``R`` prints ``nan`` as its loss from step ``S`` on. With
``--go`` it then waits for that file before it exits (``done`` printed last).

    metrics_worker.py hostile LINES

prints ``LINES`` lines, each with a new metric name and numbers of any size, then one number
10 MB long without a newline, then exits.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("steps", "hostile"))
    p.add_argument("n", type=int)
    p.add_argument("--nan-rank", type=int, default=-1)
    p.add_argument("--nan-step", type=int, default=-1)
    p.add_argument("--go", default=None)
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    out = sys.stdout
    if args.mode == "hostile":
        big = "9" * 40  # longer than any number read (32 characters)
        for i in range(args.n):
            out.write(f"step {i} name_{i}=1e999 m{i}: -{big} lr={i}e-9\n")
        out.write("step 1 loss=" + "9" * 10_000_000)
        out.flush()
        return 0
    for step in range(args.n):
        loss = "nan" if rank == args.nan_rank and step >= args.nan_step >= 0 else (
            f"{1.0 / (step + 1 + rank):.4f}")
        out.write(f"step {step} loss {loss} lr {0.1 * (rank + 1):.3f}\n")
        out.flush()
        if args.sleep:
            time.sleep(args.sleep)  # the pace of training
    if args.go:
        go = Path(args.go)
        while not go.exists():
            time.sleep(0.02)
    out.write("done\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
