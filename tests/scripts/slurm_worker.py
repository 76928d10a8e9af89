"""A worker for the SLURM tests (tests/test_slurm_cluster.py).

    slurm_worker.py crash-once   rank 1 exits 3 on the first attempt; every rank of a later
                                 attempt exits 0
    slurm_worker.py run          runs until it is stopped
    slurm_worker.py requeue      as crash-once on the job's first run, but the restarted
                                 ranks keep running (until SLURM requeues the job); every
                                 rank of a requeued run exits 0
"""

import os
import sys
import time

rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
requeues = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
mode = sys.argv[1]
print(f"worker rank {rank} of {os.environ['WORLD_SIZE']} pid {os.getpid()} attempt {attempt} "
      f"requeue {requeues}", flush=True)
if mode == "requeue" and requeues > 0:
    sys.exit(0)
if mode in ("crash-once", "requeue") and attempt == 0 and rank == 1:
    time.sleep(0.5)  # the other ranks are up: the crash restarts a running job
    sys.exit(3)
if mode == "crash-once" and attempt > 0:
    sys.exit(0)
while True:
    time.sleep(0.2)  # until the agent (or SLURM) stops it
