"""A worker that draws a progress bar as tqdm does: ``\\r`` + frame, flushed, ``--rate`` times a
second for ``--seconds``, with no newline until the end; then the final frame, a newline and
one more line. Each frame carries the wall time it was drawn at (``t=...``). Every byte
written to stdout is also appended to ``--copy``, for comparison with the agent's log file."""

from __future__ import annotations

import argparse
import sys
import time

WIDTH = 40


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--copy", required=True)
    args = p.parse_args()
    out = sys.stdout.buffer
    with open(args.copy, "wb") as copy:
        def write(data: bytes) -> None:
            out.write(data)
            out.flush()
            copy.write(data)

        start = time.monotonic()
        due = start
        i = 0
        while (now := time.monotonic()) < start + args.seconds:
            done = int(WIDTH * (now - start) / args.seconds)
            write(f"\rstep {i:6d} t={time.time():.3f} |{'#' * done:<{WIDTH}}|".encode())
            i += 1
            due += 1.0 / args.rate
            time.sleep(max(0.0, due - time.monotonic()))
        write(f"\rdone {i} frames{' ' * 12}|{'#' * WIDTH}|\n".encode())
        write(b"after the bar\n")


if __name__ == "__main__":
    main()
