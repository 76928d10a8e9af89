"""How fast the console's reader folds log entries, without Textual: its ceiling per rank count.

A ``redis-server`` on a free loopback port; ``console_bench.Feeder`` writes ``--seconds`` of
its 50k lines/s feed for ``--ranks`` ranks (one entry per worker stream every 100 ms: at 4,096
ranks about one line an entry) after a ``JobClient`` has set its cursor. Then the client's
``follow_many()`` reads the backlog and ``JobView.apply_many`` folds every record, as the app's
reader does, until every line is in. Printed: entries and lines per second, microseconds per entry,
and the entry rate the 50k lines/s feed needs at that world size, with the ratio of the two
(below 1: the console cannot keep up even with nothing else to do).

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
        got = 0
        t0 = time.perf_counter()
        async for records in client.follow_many():
            view.apply_many(records)
            got += sum(len(rec.lines) for rec in records if isinstance(rec, LogBatch))
            if got >= lines:
                break
        return {"seconds": time.perf_counter() - t0, "lines": lines, "entries": entries}
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
    per_s = r["entries"] / r["seconds"]
    need = r["entries"] / args.seconds
    print(f"reader: {args.ranks} ranks, {r['lines']:,} lines in {r['entries']:,} entries "
          f"({r['lines'] / r['entries']:.2f} lines an entry)")
    print(f"  folded: {per_s:,.0f} entries/s, {r['lines'] / r['seconds']:,.0f} lines/s, "
          f"{r['seconds'] / r['entries'] * 1e6:.1f} us an entry")
    print(f"  the {RATE:,} lines/s feed needs {need:,.0f} entries/s: "
          f"ceiling / need = {per_s / need:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
