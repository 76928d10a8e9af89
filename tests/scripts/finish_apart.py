"""A worker that meets the others once (a gloo all_reduce) and finishes: rank 0 at once, the
other ranks only once the file argv[2] exists (the test makes it when rank 0's torchrun has
exited), argv[3] seconds after that. Each start and finish is one line in the shared file
argv[1] (appended whole, with the worker's parent: its torchrun), so a test can tell whether
any worker ran twice and when the last one finished."""

import os
import sys
import time

import torch
import torch.distributed as dist

log, go, after = sys.argv[1], sys.argv[2], float(sys.argv[3])
rank = int(os.environ["RANK"])


def note(what: str, extra: str = "") -> None:
    line = f"{what} {rank} {os.getppid()} {time.time():.3f} {extra}\n"
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


note("start")
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
if rank > 0:
    deadline = time.monotonic() + 120
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.05)  # the test's signal is a file: nothing to block on
    time.sleep(after)  # the work this rank has left after the other node is gone
note("finish", f"{t.item():g}")
