"""Worker that prints many lines, as fast as it can or at a steady rate (no torch import).

    print_lines.py --lines 100000              # as fast as possible
    print_lines.py --lines 25000 --rate 20000  # 20k lines/s across the whole job (WORLD_SIZE)

``--rate`` is the job-wide rate: each worker prints ``rate / WORLD_SIZE`` lines per second,
in small flushed batches every ``--tick`` seconds, so a launcher sees a steady stream.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=100_000, help="lines this worker prints")
    p.add_argument("--rate", type=float, default=0.0,
                   help="lines per second across all workers (0: as fast as possible)")
    p.add_argument("--tick", type=float, default=0.01, help="seconds between batches with --rate")
    args = p.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    world = max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))
    out = sys.stdout
    fmt = f"rank {rank} line {{:07d}} the quick brown fox jumps over the lazy dog\n"
    if args.rate <= 0:
        write = out.write
        for i in range(args.lines):
            write(fmt.format(i))
        out.flush()
        return 0
    per_worker = args.rate / world
    start = time.monotonic()
    i = 0
    while i < args.lines:
        due = min(args.lines, int((time.monotonic() - start) * per_worker) + 1)
        if due > i:
            out.write("".join(fmt.format(n) for n in range(i, due)))
            out.flush()
            i = due
        time.sleep(args.tick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
