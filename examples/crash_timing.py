"""Worker for the crash-to-restart figure of bench/launch_bench.py (no torch import).

Attempt 0 (TORCHELASTIC_RESTART_COUNT == 0): every worker records ``start 0 <rank> <time>``;
rank ``--crash-rank`` (default: the last rank) records ``crash <time>`` after ``--crash-after``
seconds and exits with code 1; the others sleep until the launcher stops them.
Attempt 1 and later: every worker records ``start <attempt> <rank> <time>``, prints
``started at <time>`` and exits 0.

Records are appended, one ``os.write`` each, to the file named by ``--out`` or the
``CRASH_TIMING_FILE`` environment variable, so nobody has to parse launcher output.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

STARTED = time.time()


def append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("CRASH_TIMING_FILE"),
                   help="file to append records to (default: $CRASH_TIMING_FILE)")
    p.add_argument("--crash-after", type=float, default=1.0)
    p.add_argument("--crash-rank", type=int, default=None, help="default: WORLD_SIZE - 1")
    args = p.parse_args(argv)
    if not args.out:
        p.error("give --out or set CRASH_TIMING_FILE")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    crash_rank = world - 1 if args.crash_rank is None else args.crash_rank
    append(args.out, f"start {attempt} {rank} {STARTED:.6f}")
    if attempt > 0:
        print(f"started at {STARTED:.6f}", flush=True)
        return 0
    if rank == crash_rank:
        time.sleep(args.crash_after)
        append(args.out, f"crash {time.time():.6f}")
        return 1
    time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
