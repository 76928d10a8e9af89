"""The home screen with many jobs on the server: how long until the list is on screen.

A fresh redis-server gets ``--jobs`` job records written the way agents leave them (meta hash,
job index entry, heartbeat): most finished, some lost (a stale heartbeat, no final state) and
``--running`` still running with ``--events`` events each (``list_jobs`` folds the recent events
of every job that has not ended: the costly part). Then, ``--repeat`` times:

* ``list_jobs``: ``JobClient.list_jobs()`` alone (what the home screen reads on each refresh);
* ``home screen``: the console app started with no job (``elastic-console`` with no
  subcommand), headless (Textual's ``run_test``), until the job table holds every job and
  the next frame is drawn.

    python bench/home_bench.py [--jobs 1000] [--running 50] [--events 300] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import redis

from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.coordination.wire.event_records import EventType, encode_event
from elastic_agent.coordination.wire.keyspace import JOBS_INDEX, JobKeys
from elastic_agent.supervision.hosting.standalone import RedisServer
from elastic_console.job.client import JobClient
from elastic_console.tui.app import ConsoleApp
from elastic_console.tui.home import JobsScreen


def write_jobs(r: redis.Redis, jobs: int, running: int, events: int) -> None:
    secs, micros = r.time()
    now = int(secs) * 1000 + int(micros) // 1000
    pipe = r.pipeline(transaction=False)
    for i in range(jobs):
        job = f"bench-{i:05d}"
        k = JobKeys(job)
        kind = "running" if i < running else "lost" if i % 10 == 0 else "succeeded"
        meta = {"created_ms": now - 1000 * i, "max_restarts": 3, "heartbeat_timeout_ms": 10_000,
                "nproc_per_node": 8, "min_nodes": 2, "max_nodes": 2}
        if kind == "succeeded":
            meta["final_state"] = "succeeded"
        pipe.hset(k.meta, mapping=meta)
        pipe.zadd(JOBS_INDEX, {job: now - 1000 * i})
        pipe.zadd(k.rdzv_heartbeats, {"node-a": now if kind == "running" else now - 60_000})
        if kind == "running":
            for n in range(events):
                pipe.xadd(k.events, encode_event(EventType.NODE_JOINED, f"node-{n % 2}",
                                                 {"host": f"h{n % 2}"}, n + 1))
        if i % 100 == 99:
            pipe.execute()
    pipe.execute()


async def time_list(url: str) -> float:
    client = JobClient(url)
    try:
        t = time.perf_counter()
        await client.list_jobs()
        return time.perf_counter() - t
    finally:
        await client.close()


async def time_screen(url: str, jobs: int) -> float:
    """Seconds from the app's start until every job is in the table and a frame is drawn."""
    t = time.perf_counter()
    app = ConsoleApp(None, endpoint=parse_endpoint(url), cursor_blink=False)
    async with app.run_test(size=(120, 40)) as pilot:
        while not (isinstance(app.screen, JobsScreen) and app.screen.table.row_count >= jobs):
            await asyncio.sleep(0.002)
        await pilot.pause()  # ...and drawn: the next refresh
        return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--running", type=int, default=50)
    p.add_argument("--events", type=int, default=300)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    server = RedisServer().start()
    try:
        r = redis.Redis.from_url(server.url)
        write_jobs(r, args.jobs, args.running, args.events)
        r.close()
        lists = [asyncio.run(time_list(server.url)) for _ in range(args.repeat)]
        screens = [asyncio.run(time_screen(server.url, args.jobs)) for _ in range(args.repeat)]
    finally:
        server.cleanup()
    print(f"{args.jobs} jobs ({args.running} running with {args.events} events each):")
    print(f"  list_jobs:           median {statistics.median(lists) * 1000:6.0f} ms  "
          f"max {max(lists) * 1000:6.0f} ms")
    print(f"  home screen:         median {statistics.median(screens) * 1000:6.0f} ms  "
          f"max {max(screens) * 1000:6.0f} ms  (app start to every job listed and drawn)")


if __name__ == "__main__":
    main()
