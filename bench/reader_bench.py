"""How fast the console's reader folds log entries, without Textual: its ceiling per rank count.

A ``redis-server`` on a free loopback port; ``console_bench.Feeder`` writes ``--seconds`` of
its 50k lines/s feed for ``--ranks`` ranks (as agents write it: one entry per node every 50 ms
with the batches of each of its 16 workers' streams that printed, ~1.2 lines a batch at 4,096
ranks) after a ``JobClient`` has set its cursor. Then the client's
``follow_many()`` reads the backlog and ``JobView.apply_many`` folds every record, as the app's
reader does, until every line is in. Printed: lines and batches per second, microseconds per batch,
and the ratio of lines folded per second to the feed's 50k (below 1: the console cannot keep
up even with nothing else to do).

torchrun has no console: the baseline is the feed the goal asks for.

    python bench/reader_bench.py [--ranks 4096] [--seconds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from elastic_agent.coordination.connection import make_client
from elastic_agent.coordination.protocol import LogBatch
from elastic_agent.supervision.standalone import RedisServer
from elastic_console.client import JobClient
from elastic_console.state import JobView

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of feed to fold")
    args = parser.parse_args(argv)
    server = RedisServer()
    server.start()
    try:
        feeder = console_bench.Feeder(make_client(server.url), JOB, args.ranks, RATE, seed=7)
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
