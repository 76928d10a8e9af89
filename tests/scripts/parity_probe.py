"""A worker for the torchrun comparison: it records its environment, writes to both streams
and, on the first attempt, fails on rank 1 through torch's ``@record`` (an error file)."""

import json
import os
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    rank = int(os.environ["RANK"])
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    with open(os.path.join(sys.argv[1], f"env.{attempt}.{rank}.json"), "w") as f:
        json.dump(dict(os.environ), f)
    print(f"out line 1 from {rank}", flush=True)
    print(f"err line from {rank}", file=sys.stderr, flush=True)
    print(f"out line 2 from {rank} attempt {attempt}", flush=True)
    done = os.path.join(sys.argv[1], f"done.{attempt}.{{}}")
    open(done.format(rank), "w").close()
    if rank == 1 and attempt == "0":
        # Both launchers stop the group when rank 1 fails: wait until rank 0 has written
        # everything, or its files would depend on who wins that race.
        deadline = time.monotonic() + 60
        while not os.path.exists(done.format(0)) and time.monotonic() < deadline:
            time.sleep(0.01)
        raise ValueError("probe failure on rank 1")


main()
