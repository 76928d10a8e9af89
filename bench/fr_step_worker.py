"""A training loop for bench/flight_recorder_bench.py: each step computes (matmuls) and
all-reduces a gradient-sized tensor, as DDP would. Rank 0 writes the mean step time (ms) of
the timed steps to $RESULT_FILE."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    steps = int(os.environ.get("STEPS", "200"))
    a = torch.randn(192, 192)
    grad = torch.randn(64 * 1024)

    def step() -> None:
        x = a
        for _ in range(8):
            x = torch.tanh(x @ a)
        dist.all_reduce(grad)

    for _ in range(20):  # warm up
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    ms = (time.perf_counter() - t0) / steps * 1000
    if dist.get_rank() == 0 and os.environ.get("RESULT_FILE"):
        with open(os.environ["RESULT_FILE"], "w") as f:
            f.write(f"{ms:.4f}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
