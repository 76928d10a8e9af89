"""A worker that proves its process group works and reports its torchrun environment."""

import json
import os
import sys

import torch
import torch.distributed as dist

out = sys.argv[1]
dist.init_process_group("gloo")
t = torch.tensor([float(os.environ["RANK"])])
dist.all_reduce(t)
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RUN_ID"]
report = {k: os.environ.get(k) for k in keys}
report["sum"] = t.item()
with open(f"{out}.{os.environ['RANK']}", "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
