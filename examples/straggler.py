"""A straggler: one rank takes 1.6x longer per step than the others, and every step ends in
an ``all_reduce``, so the whole job runs at its pace (issue 22).

    elastic-agent --standalone --nproc-per-node 4 examples/straggler.py
    elastic-console status JOB    # after ~2 intervals: "stragglers: rank 3 on HOST, 1.6x"

$SLOW_RANK (default 3; -1: a balanced job) computes $SLOW_FACTOR (1.6) times $STEP_S
(0.1 s) per step, the others $STEP_S; the job runs about $SECONDS (60) seconds. The step's
work is a sleep, so the figures do not depend on how busy the machine's cores are. Each rank
prints its step every 50 steps.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    slow = int(os.environ.get("SLOW_RANK", "3"))
    factor = float(os.environ.get("SLOW_FACTOR", "1.6"))
    step_s = float(os.environ.get("STEP_S", "0.1"))
    steps = int(float(os.environ.get("SECONDS", "60")) / (step_s * max(factor, 1.0)))
    t = torch.ones(1024)
    for step in range(steps):
        time.sleep(step_s * (factor if rank == slow else 1.0))  # this rank's compute
        dist.all_reduce(t)
        if step % 50 == 0:
            print(f"rank {rank}: step {step} of {steps}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
