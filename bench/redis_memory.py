"""Redis memory per job, for 1,000 finished jobs, and `ls` with 1,000 jobs on the server.

1. One real job (elastic-agent, 2 ranks, each printing --lines lines) on a fresh
   redis-server; every key of it is weighed with ``MEMORY USAGE key SAMPLES 0`` and summed
   by kind: events, logs, coordination (rendezvous, store, meta, counters, resources).
2. A log stream at the default retention (``--log-retention`` 200,000 entries): entries as the
   agent writes them (``encode_node_log_entry``), for a node whose workers print one line
   per flush (the costliest case per line) and for entries of 50 lines; weighed the same way.
3. 1,000 finished jobs: the real job's keys copied 1,000 times under new job ids
   (``DUMP``/``RESTORE``: byte for byte what the agents wrote), each listed in the job index;
   ``used_memory`` before and after.
4. ``elastic-console ls`` with those 1,000 jobs: ``JobClient.list_jobs()`` in process, and the
   command itself (a new process: interpreter start included), median of --repeat runs.

    python bench/redis_memory.py [--lines 2000] [--jobs 1000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

from elastic_agent.coordination.wire.keyspace import JOBS_INDEX, LOGS_MAXLEN, JobKeys
from elastic_agent.coordination.wire.log_records import LogBatch, encode_node_log_entry
from elastic_agent.supervision.hosting.standalone import RedisServer

ROOT = Path(__file__).resolve().parent.parent
WORKER = """
import os, sys
n = int(sys.argv[1])
r = os.environ["RANK"]
for i in range(n):
    print(f"rank {r} step {i} loss 0.{i % 997:03d} lr 3e-4 throughput 1234.5 samples/s")
"""


def mb(n: float) -> str:
    return f"{n / 1024 / 1024:.2f} MiB" if n >= 1024 * 1024 else f"{n / 1024:.1f} KiB"


def kind(key: str, job: str) -> str:
    keys = JobKeys(job)
    if key == keys.events:
        return "events"
    if key == keys.log_streams or keys.is_log_stream(key):
        return "logs"
    return "coordination"


def job_keys(r: redis.Redis, job: str) -> list[str]:
    """Every key of ``job``: its slot's (SCAN) and its log streams (outside that slot, listed
    in the job's set)."""
    keys = JobKeys(job)
    return ([k.decode() for k in r.scan_iter(match=keys.all_key_patterns()[0], count=1000)]
            + keys.streams_elsewhere(r.smembers(keys.log_streams)))


def weigh(r: redis.Redis, job: str) -> dict[str, tuple[int, int]]:
    """kind -> (keys, bytes) of every key of ``job``."""
    out: dict[str, tuple[int, int]] = {}
    for key in job_keys(r, job):
        used = int(r.memory_usage(key, samples=0) or 0)
        n, b = out.get(kind(key, job), (0, 0))
        out[kind(key, job)] = (n + 1, b + used)
    return out


def run_job(url: str, job: str, lines: int, tmp: Path) -> None:
    script = tmp / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "elastic_agent.supervision.cli", "--redis", url, "--job-id",
           job, "--nproc-per-node", "2", "--log-dir", str(tmp / "logs"), str(script), str(lines)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        sys.exit(f"the job failed ({done.returncode}):\n{done.stderr[-2000:]}")


def log_stream_at_retention(r: redis.Redis, lines_per_entry: int) -> int:
    """Bytes of one node's log stream holding LOGS_MAXLEN entries as the agent writes them
    (measured on at most 20,000 entries, scaled: a stream's cost is linear in its entries)."""
    key = f"bench:logs:{lines_per_entry}"
    r.delete(key)
    entries = min(LOGS_MAXLEN, 20_000)
    pipe = r.pipeline(transaction=False)
    for seq in range(entries):
        rank = seq % 8
        lines = [f"rank {rank} step {seq * lines_per_entry + i} loss 0.{i % 997:03d} lr 3e-4 "
                 "throughput 1234.5 samples/s" for i in range(lines_per_entry)]
        pipe.xadd(key, encode_node_log_entry("node-a-1234-abcdef", [LogBatch(
                      "node-a-1234-abcdef", rank, rank, 0, "out", seq, lines)]),
                  maxlen=LOGS_MAXLEN, approximate=True)
        if len(pipe) >= 2000:
            pipe.execute()
    pipe.execute()
    used = int(r.memory_usage(key, samples=0) or 0)
    r.delete(key)
    return used * LOGS_MAXLEN // entries


def copy_jobs(r: redis.Redis, template: str, n: int) -> list[str]:
    tk = JobKeys(template)
    keys = job_keys(r, template)
    dumps = {k[len(tk.prefix):]: r.dump(k) for k in keys if k.startswith(tk.prefix)}
    # A log stream outside the slot is named by its node: the copy's name has the copy's tag.
    streams = {k.split("}:", 1)[1]: r.dump(k) for k in keys if not k.startswith(tk.prefix)}
    created = int(r.hget(tk.meta, "created_ms") or 0)
    jobs = []
    for i in range(n):
        job = f"bench-{i:04d}-{uuid.uuid4().hex[:6]}"
        jk = JobKeys(job)
        pipe = r.pipeline(transaction=False)
        for suffix, blob in dumps.items():
            pipe.restore(jk.prefix + suffix, 0, blob)
        if streams:
            pipe.delete(jk.log_streams)
            pipe.sadd(jk.log_streams, *(jk.logs(node) for node in streams))
        for node, blob in streams.items():
            pipe.restore(jk.logs(node), 0, blob)
        pipe.zadd(JOBS_INDEX, {job: created + i})
        pipe.execute()
        jobs.append(job)
    return jobs


async def list_jobs_s(url: str) -> tuple[float, int]:
    from elastic_console.job.client import JobClient

    client = JobClient(url)
    try:
        t0 = time.perf_counter()
        jobs = await client.list_jobs()
        return time.perf_counter() - t0, len(jobs)
    finally:
        await client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=2000, help="lines printed per rank")
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    with RedisServer() as server, tempfile.TemporaryDirectory() as tmp:
        r = redis.Redis.from_url(server.url)
        job = f"bench-template-{uuid.uuid4().hex[:6]}"
        run_job(server.url, job, args.lines, Path(tmp))
        by_kind = weigh(r, job)
        total = sum(b for _, b in by_kind.values())
        print(f"one finished job (2 ranks x {args.lines} lines), MEMORY USAGE per key:")
        for k in ("events", "logs", "coordination"):
            n, b = by_kind.get(k, (0, 0))
            print(f"  {k:<13} {n:>3} keys  {mb(b):>12}")
        print(f"  {'total':<13} {sum(n for n, _ in by_kind.values()):>3} keys  {mb(total):>12}")
        ttl = r.pttl(JobKeys(job).meta)
        print(f"  expires in    {ttl / 86400000:.2f} days (the default --retention)")

        for per_entry in (1, 50):
            used = log_stream_at_retention(r, per_entry)
            print(f"one node's log stream at the default retention ({LOGS_MAXLEN:,} entries of "
                  f"{per_entry} line{'s' if per_entry > 1 else ''}): {mb(used)} "
                  f"({used / LOGS_MAXLEN / per_entry:.0f} B per line)")

        before = int(r.info("memory")["used_memory"])
        jobs = copy_jobs(r, job, args.jobs)
        after = int(r.info("memory")["used_memory"])
        print(f"{args.jobs} finished jobs: used_memory +{mb(after - before)} "
              f"({mb((after - before) / args.jobs)} per job); index {r.zcard(JOBS_INDEX)} entries")

        times, count = [], 0
        for _ in range(args.repeat):
            t, count = asyncio.run(list_jobs_s(server.url))
            times.append(t)
        print(f"list_jobs() with {count} jobs: median {statistics.median(times) * 1000:.0f} ms "
              f"(min {min(times) * 1000:.0f} ms)")
        env = {**os.environ, "ELASTIC_REDIS_URL": server.url}
        cli = [sys.executable, "-m", "elastic_console.cli", "ls"]
        walls = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            subprocess.run(cli, env=env, capture_output=True, check=True, timeout=120)
            walls.append(time.perf_counter() - t0)
        print(f"`elastic-console ls` with {count} jobs: median {statistics.median(walls):.2f} s "
              f"wall (a new process each time)")
        del jobs


if __name__ == "__main__":
    main()
