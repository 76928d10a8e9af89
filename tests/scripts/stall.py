"""Workers for the stall tests (torch-free, so they start in milliseconds).

    stall.py hang ODD      every rank waits for a peer that never comes, except rank ODD,
                           which sleeps somewhere else (the odd stack); silent, no CPU. From
                           the second attempt on (TORCHELASTIC_RESTART_COUNT >= 1) every
                           rank finishes at once instead.
    stall.py chatty S      prints a line every 0.2 s for S seconds, then exits 0
    stall.py compute S     computes silently (a busy loop) for S seconds, then exits 0
    stall.py quiet S       sleeps silently for S seconds, then exits 0
"""

import os
import sys
import threading
import time

mode, arg = sys.argv[1], float(sys.argv[2])
rank = int(os.environ["RANK"])
restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def straggler() -> None:
    time.sleep(3600)


def wait_for_peer() -> None:
    threading.Event().wait(3600)


if mode == "hang":
    print(f"rank {rank} attempt {restarts} started", flush=True)
    if restarts >= 1:
        print(f"rank {rank} done", flush=True)
        sys.exit(0)
    if rank == int(arg):
        straggler()
    else:
        wait_for_peer()
elif mode == "chatty":
    end = time.monotonic() + arg
    i = 0
    while time.monotonic() < end:
        print(f"rank {rank} step {i}", flush=True)
        i += 1
        time.sleep(0.2)
elif mode == "compute":
    end = time.monotonic() + arg
    x = 0
    while time.monotonic() < end:
        x += 1
elif mode == "quiet":
    time.sleep(arg)
