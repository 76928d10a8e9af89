"""An accelerate script on the CPU: every rank adds its rank + 1 into one sum (gloo, through
Accelerator(cpu=True)) and writes what it saw to argv[1].<rank>, so a test can tell that
every rank met the others in one job."""

import json
import os
import sys

import torch
from accelerate import Accelerator

acc = Accelerator(cpu=True)
total = acc.reduce(torch.tensor([float(acc.process_index + 1)]), reduction="sum")
report = {"rank": acc.process_index, "world": acc.num_processes, "sum": total.item(),
          "distributed_type": str(acc.distributed_type),
          "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
          "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"}
with open(f"{sys.argv[1]}.{acc.process_index}", "w") as f:
    json.dump(report, f)
acc.end_training()
