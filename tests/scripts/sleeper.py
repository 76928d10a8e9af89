"""A worker that prints a line every 50 ms until told to stop (or for --seconds)."""

import argparse
import os
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--seconds", type=float, default=600)
p.add_argument("--fail-rank", type=int, default=None)
p.add_argument("--fail-after", type=float, default=0.5)
args = p.parse_args()
rank = os.environ["RANK"]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"worker rank={rank} world={os.environ['WORLD_SIZE']} restart={attempt} "
      f"pid={os.getpid()}", flush=True)
start = time.time()
i = 0
while time.time() - start < args.seconds:
    if args.fail_rank is not None and int(rank) == args.fail_rank and attempt == "0" \
            and time.time() - start > args.fail_after:
        print(f"rank {rank} failing on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
    print(f"tick {i} rank {rank} t={time.time():.3f}", flush=True)
    i += 1
    time.sleep(0.05)
