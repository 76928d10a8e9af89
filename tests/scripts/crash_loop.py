"""A worker for the restart-pattern tests.

--crash: exit 3 after --after seconds, in every attempt (on a node whose agent has
CRASH_HERE=1 in its environment when --only-flagged). --silent: print nothing and use no CPU
(no progress, as stall detection counts it). Otherwise it waits, and exits 0 once the
world has at most --done-at-world ranks.
"""

import argparse
import os
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--crash", action="store_true")
p.add_argument("--only-flagged", action="store_true")
p.add_argument("--after", type=float, default=0.3)
p.add_argument("--silent", action="store_true")
p.add_argument("--done-at-world", type=int, default=0)
args = p.parse_args()
world = int(os.environ["WORLD_SIZE"])
if args.silent:
    time.sleep(3600)
print(f"worker rank={os.environ['RANK']} world={world} "
      f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
crash = args.crash and (not args.only_flagged or os.environ.get("CRASH_HERE") == "1")
time.sleep(args.after)
if crash:
    print("crashing on purpose", file=sys.stderr, flush=True)
    sys.exit(3)
if world <= args.done_at_world:
    sys.exit(0)
time.sleep(3600)
