"""A hang Python stacks cannot explain: every rank blocks on the same ``all_reduce`` line, but
one rank is in another process group's collective (issue 22).

    elastic-agent --standalone --nproc-per-node 3 examples/collective_hang.py
    elastic-console stacks JOB         # one group: every rank at the same line
    elastic-console collectives JOB    # "suspects: 1": ranks 0 and 2 wait for it

$ODD_RANK (default 1) is the rank that enters the pair group's collective (with the next
rank) while the others enter the world's. Each rank prints "entering the last all_reduce"
before it blocks, so a test knows they are there.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    odd = int(os.environ.get("ODD_RANK", "1")) % world
    pair = dist.new_group([odd, (odd + 1) % world])
    t = torch.ones(4)
    for _ in range(3):  # some history in the recorder
        dist.all_reduce(t)
    group = pair if rank == odd else None
    print(f"rank {rank}: entering the last all_reduce", flush=True)
    dist.all_reduce(torch.ones(8), group=group)  # every rank hangs on this line
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
