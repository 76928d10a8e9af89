"""A worker for the torchrun comparison: it records its environment, writes to both streams
and, on the first attempt, fails on rank 1 through torch's ``@record`` (an error file)."""

import json
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    rank = int(os.environ["RANK"])
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    with open(os.path.join(sys.argv[1], f"env.{attempt}.{rank}.json"), "w") as f:
        json.dump(dict(os.environ), f)
    print(f"out line 1 from {rank}", flush=True)
    print(f"err line from {rank}", file=sys.stderr, flush=True)
    print(f"out line 2 from {rank} attempt {attempt}")
    if rank == 1 and attempt == "0":
        raise ValueError("probe failure on rank 1")


main()
