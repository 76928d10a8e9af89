"""Worker of bench/preload_bench.py: import torch, init_process_group("gloo"), note the time
past it, train a few steps; in attempt 0 local rank 3 crashes once all have passed init."""
import os
import time

import torch
import torch.distributed as dist


def note(what: str) -> None:
    with open(os.environ["PRELOAD_BENCH_FILE"], "a") as f:
        f.write(f"{what} {os.environ['TORCHELASTIC_RESTART_COUNT']} {os.environ['RANK']} "
                f"{time.time():.6f}\n")


# torchrun 2.13's agent store keeps attempt 0's gloo addresses under the same keys: without a
# per-attempt prefix its restarted workers connect to the dead ones (the same for every launcher).
store, rank, world = next(dist.rendezvous("env://"))
store = dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
note("init")
model = torch.nn.Linear(32, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(5):
    loss = model(torch.randn(16, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
dist.barrier()
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["LOCAL_RANK"] == "3":
    note("crash")
    os._exit(1)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    time.sleep(30)  # the crash ends this attempt
dist.destroy_process_group()
