"""A hung collective: one rank sleeps before an ``all_reduce`` while every other rank waits
inside it. Nothing prints, nothing fails: the hang `elastic-console stacks` is for.

    elastic-agent --standalone --nproc-per-node 8 examples/hang.py
    elastic-console stacks JOB        # "1 rank [3]: stall ← train_step ← main" comes first

$HANG_RANK (default 3) is the rank that stalls; $HANG_SECONDS (default 3600) how long it
sleeps (after which the job completes); $HANG_MODE=gil makes it stall in a C call that holds
the GIL (``sleep(3)`` of libc through ``ctypes.PyDLL``) instead of ``time.sleep``. The other
ranks print "waiting in all_reduce" before they block, so a test knows they are there.
"""

from __future__ import annotations

import ctypes
import os
import time

import torch
import torch.distributed as dist


def stall(seconds: float) -> None:
    """The odd rank's stuck frame."""
    if os.environ.get("HANG_MODE") == "gil":
        libc = ctypes.PyDLL(None)  # PyDLL: the call keeps the GIL, as a stuck extension would
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            libc.sleep(1)
    else:
        time.sleep(seconds)


def train_step(rank: int, hang_rank: int, seconds: float) -> torch.Tensor:
    t = torch.ones(1) * rank
    if rank == hang_rank:
        print(f"rank {rank}: stalling for {seconds:g} s before all_reduce", flush=True)
        stall(seconds)
    else:
        print(f"rank {rank}: waiting in all_reduce", flush=True)
    dist.all_reduce(t)
    return t


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hang_rank = int(os.environ.get("HANG_RANK", "3"))
    seconds = float(os.environ.get("HANG_SECONDS", "3600"))
    dist.barrier()  # everyone is up before the hang begins
    t = train_step(rank, hang_rank, seconds)
    print(f"rank {rank}: all_reduce done ({t.item():g})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
