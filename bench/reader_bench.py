"""How fast the console's reader folds log entries, without Textual: its ceiling per rank count.

A ``redis-server`` on a free loopback port; ``console_bench.Feeder`` writes ``--seconds`` of
its 50k lines/s feed for ``--ranks`` ranks (as agents write it: one entry per node every 50 ms
with the batches of each of its 16 workers' streams that printed, ~1.2 lines a batch at 4,096
ranks) after a ``JobClient`` has set its cursor. Then the client's
``follow_many()`` reads the backlog and ``JobView.apply_many`` folds every record, as the app's
reader does, until every line is in. Printed: lines and batches per second, microseconds per batch,
and the ratio of lines folded per second to the feed's 50k (below 1: the console cannot keep
up even with nothing else to do).

``--live S``: the reader follows the feed as it is written instead, for ``S`` seconds: the
feeder of ``bench/console_bench.py`` in a child process of its own writes 50k lines/s in
real time (no history), and the reader, caught up from the start, folds what comes. This is
the console's steady state: many small reads (a few entries of each node stream), where the
costs per read and per stream weigh more than in a backlog. Printed: lines fed and folded a
second, the reader's CPU (its process's, it has nothing else) per line and as % of a core,
the XREADs it made a second (Redis's own count) and their mean cost in Redis, and how old the
newest line it folded was at the end.

torchrun has no console: the baseline is the feed the goal asks for.

    python bench/reader_bench.py [--ranks 4096] [--seconds 4] [--nproc-per-node 16] [--live S]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire.log_records import LogBatch
from elastic_agent.supervision.hosting.standalone import RedisServer
from elastic_console.job.client import JobClient
from elastic_console.job.state import JobView
from elastic_console.tui.gc_policy import GcPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import console_bench

RATE = 50_000
JOB = "reader-bench"


async def fold(url: str, feeder: console_bench.Feeder, seconds: float) -> dict[str, float]:
    client = JobClient(url, JOB)
    view = JobView(JOB)
    try:
        await client.history(max_events=10, max_log_entries_per_stream=0)  # cursor: now
        lines = feeder.prefill(seconds)
        GcPolicy().settle()  # the app's collector settings (no full collection on its own)
        entries = feeder.entries_written
        got = batches = 0
        t0 = time.perf_counter()
        async for records in client.follow_many():
            view.apply_many(records)
            for rec in records:
                if isinstance(rec, LogBatch):
                    got += len(rec.lines)
                    batches += 1
            if got >= lines:
                break
        return {"seconds": time.perf_counter() - t0, "lines": lines, "entries": entries,
                "batches": batches}
    finally:
        await client.close()


async def follow_live(url: str, seconds: float) -> dict[str, float]:
    """Follow the live feed for ``seconds``: lines folded, CPU spent, the newest line's age."""
    client = JobClient(url, JOB)
    view = JobView(JOB)
    r = make_client(url)
    try:
        await client.history(max_events=10, max_log_entries_per_stream=0)  # cursor: now
        GcPolicy().settle()  # the app's collector settings (no full collection on its own)
        before = r.info("commandstats").get("cmdstat_xread", {})
        got = newest = 0
        t0, c0 = time.perf_counter(), time.process_time()
        async for records in client.follow_many():
            newest = max(newest, view.apply_many(records))
            for rec in records:
                if isinstance(rec, LogBatch):
                    got += len(rec.lines)
            if time.perf_counter() - t0 >= seconds:
                break
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        secs, micros = r.time()
        age_ms = int(secs) * 1000 + int(micros) // 1000 - newest
        after = r.info("commandstats").get("cmdstat_xread", {})
        reads = after.get("calls", 0) - before.get("calls", 0)
        usec = after.get("usec", 0) - before.get("usec", 0)
        return {"seconds": wall, "cpu": cpu, "lines": got, "reads": reads,
                "read_us": usec / max(1, reads), "age_ms": age_ms,
                "fed": int(r.get(console_bench.fed_key(JOB)) or 0)}
    finally:
        r.close()
        await client.close()


def live(args: argparse.Namespace, server: RedisServer) -> int:
    feeder = subprocess.Popen(
        [sys.executable, console_bench.__file__, "--feeder", "--url", server.url, "--job", JOB,
         "--ranks", str(args.ranks), "--nproc-per-node", str(args.nproc_per_node),
         "--rate", str(RATE), "--seed", "7", "--history", "0"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert feeder.stdout is not None
        if not feeder.stdout.readline().startswith("ready"):
            raise SystemExit("the feeder did not start")
        r = asyncio.run(follow_live(server.url, args.live))
    finally:
        os.killpg(feeder.pid, signal.SIGTERM)  # its own session: it and nothing else
        feeder.wait()
    print(f"reader, live: {args.ranks} ranks ({args.ranks // args.nproc_per_node} nodes x "
          f"{args.nproc_per_node}), {r['seconds']:.1f} s of a {RATE:,} lines/s feed")
    print(f"  fed {r['fed'] / r['seconds']:,.0f} lines/s, folded {r['lines'] / r['seconds']:,.0f} "
          f"lines/s; newest line {r['age_ms']:,} ms old at the end")
    print(f"  reader CPU: {r['cpu'] / r['seconds'] * 100:.0f}% of a core, "
          f"{r['cpu'] / max(1, r['lines']) * 1e6:.1f} us a line")
    print(f"  XREADs: {r['reads'] / r['seconds']:.1f} a second, {r['read_us']:,.0f} us each in "
          "Redis")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of feed to fold")
    parser.add_argument("--nproc-per-node", type=int, default=console_bench.NPROC,
                        help="ranks per node (--ranks 32768 --nproc-per-node 8: 4,096 nodes x 8)")
    parser.add_argument("--live", type=float, default=0.0,
                        help="follow the live feed for this many seconds instead")
    args = parser.parse_args(argv)
    server = RedisServer()
    server.start()
    if args.live:
        try:
            return live(args, server)
        finally:
            server.stop()
    try:
        feeder = console_bench.Feeder(make_client(server.url), JOB, args.ranks, RATE, seed=7,
                                      nproc=args.nproc_per_node)
        feeder.setup()
        r = asyncio.run(fold(server.url, feeder, args.seconds))
    finally:
        server.stop()
    lines_s = r["lines"] / r["seconds"]
    print(f"reader: {args.ranks} ranks, {r['lines']:,} lines in {r['batches']:,} worker-stream "
          f"batches ({r['lines'] / r['batches']:.2f} lines a batch) in {r['entries']:,} entries")
    print(f"  folded: {lines_s:,.0f} lines/s, {r['batches'] / r['seconds']:,.0f} batches/s, "
          f"{r['seconds'] / r['batches'] * 1e6:.1f} us a batch")
    print(f"  the feed is {RATE:,} lines/s: ceiling / need = {lines_s / RATE:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
