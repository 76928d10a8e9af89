"""Two agents' forked workers: import torch, init_process_group("gloo"), all_reduce; rank 1
crashes after init in the first attempt. In the second, a DataLoader with workers and a
torch.multiprocessing spawn run inside the forked worker."""
import sys

PRELOADED = "torch" in sys.modules  # before our own import: only a forked worker has it

import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def child(i, q):
    q.put(float(torch.ones(2).sum()) + i)


def main():
    dist.init_process_group("gloo")
    t = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"rank {dist.get_rank()} restart {restart} preloaded {PRELOADED} sum {int(t)}",
          flush=True)
    if restart == 0 and dist.get_rank() == 1:
        os._exit(3)
    if restart == 1:
        loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, num_workers=2)
        total = sum(int(b.sum()) for b in loader)
        ctx = torch.multiprocessing.get_context("spawn")
        q = ctx.SimpleQueue()
        torch.multiprocessing.spawn(child, args=(q,), nprocs=1, join=True)
        print(f"rank {dist.get_rank()} loader {total} spawn {q.get()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
