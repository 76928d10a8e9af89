"""A worker for the SLURM tests (tests/test_slurm_cluster.py).

    slurm_worker.py crash-once   rank 1 exits 3 on the first attempt; every rank of a later
                                 attempt exits 0
    slurm_worker.py run          runs until it is stopped
    slurm_worker.py requeue      as crash-once on the job's first run, but the restarted
                                 ranks keep running (until SLURM requeues the job); every
                                 rank of a requeued run exits 0
    slurm_worker.py env          reports what it holds of the job's Redis: whether
                                 $ELASTIC_JOB_SECRET reached it, the user of its
                                 ELASTIC_REDIS_URL, a store round trip through it, and
                                 whether it may write the job's command stream; exits 0
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
if mode == "env":
    from urllib.parse import urlsplit

    import redis

    from elastic_agent.coordination.store import RedisStore
    from elastic_agent.coordination.wire.keyspace import JobKeys

    url, job = os.environ["ELASTIC_REDIS_URL"], os.environ["ELASTIC_JOB_ID"]
    with RedisStore(url, job, "env-check", timeout=30) as store:
        store.set(f"rank{rank}", "here")
        stored = store.get(f"rank{rank}") == b"here"
    try:
        redis.Redis.from_url(url).xadd(JobKeys(job).commands, {"v": "1"})
        commands = "written"
    except redis.ResponseError:
        commands = "refused"
    print(f"worker rank {rank} env: secret {'ELASTIC_JOB_SECRET' in os.environ} user "
          f"{urlsplit(url).username} store {stored} commands {commands}", flush=True)
    sys.exit(0)
if mode == "requeue" and requeues > 0:
    sys.exit(0)
if mode in ("crash-once", "requeue") and attempt == 0 and rank == 1:
    time.sleep(0.5)  # the other ranks are up: the crash restarts a running job
    sys.exit(3)
if mode == "crash-once" and attempt > 0:
    sys.exit(0)
while True:
    time.sleep(0.2)  # until the agent (or SLURM) stops it
