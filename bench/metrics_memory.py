"""What the training metrics cost in memory, whatever the run's length or the worker's output.

1. A 30-day curve: one metric's ``Series`` (agent/coordination/wire/metric_series.py), as the
   host of rank 0 keeps it and a console holds it, fed one point a second and one every
   100 ms for 30 days (2.6 and 25.9 million points; a restart every ``--restart-days`` days
   resumes 10 minutes back, so the curve has attempts and redone steps). Printed: the entries
   kept (raw points + buckets), the encoded bytes (one field of ``metrics_history`` in Redis),
   the Python memory of the series (tracemalloc, fed under it from the first point: the 1 s
   run; the 100 ms run decoded from its encoding, as a console or a later host of rank 0
   holds it), and the time per ``add``.
2. The console's fold at 1,024 and 32,768 ranks: bench/metrics_fold_bench.py's ``memory``
   (every rank's latest state, the curves full).
3. Hostile output: one rank printing ``--lines`` lines each with a new metric name, a number
   too long to be one and a value of 1e999, then a number 10 MB long without a newline, fed
   to the agent's ``MetricsTracker`` in 64 KiB chunks with a take every 2,000 lines (the
   publication): its memory (tracemalloc) as the lines go by, the names kept and dropped.
   Then Redis: a real redis-server, and a node whose rank prints the largest points the
   tracker keeps (32 names of 48 characters, numbers of 32, 256 steps an interval) through
   the agent's publisher for ``--intervals`` intervals (more than the stream's ``MAXLEN``):
   ``MEMORY USAGE`` of every metrics key of the job.

    python bench/metrics_memory.py [--days 30] [--lines 2000000] [--intervals 6000]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import sys
import time
import tracemalloc

import psutil
import redis

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire import metric_records
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.metric_series import BUCKETS, RECENT, Series, decode_series
from elastic_agent.supervision.diagnosis import metrics as tracker_mod
from elastic_agent.supervision.diagnosis.metrics import MetricsTracker
from elastic_agent.supervision.diagnosis.metrics_publish import MetricsPublisher
from elastic_agent.supervision.hosting.standalone import RedisServer

DAY_S = 86_400
T0 = 1_790_000_000_000
CHUNK = 64 * 1024  # what one read of a worker's pipe hands the agent at most
#: Points a rank prints an interval in 3b: more than one entry's cap holds at these sizes.
POINTS = 16


def curve(days: float, period_s: float, restart_days: float, traced: bool
          ) -> tuple[Series, float, list[tuple[float, int]]]:
    """A series fed ``days`` of points every ``period_s``: (series, us per add, [(day, traced
    bytes)] when ``traced``)."""
    n = int(days * DAY_S / period_s)
    per_restart = int(restart_days * DAY_S / period_s) if restart_days > 0 else n + 1
    back = int(600 / period_s)  # a resume from a checkpoint 10 minutes back
    rng = random.Random(0)
    marks = {int(d * DAY_S / period_s) for d in (1, 10, days)} if traced else set()
    seen: list[tuple[float, int]] = []
    if traced:
        gc.collect()
        tracemalloc.start()
    s = Series()
    step, attempt = 0, 0
    start = time.perf_counter()
    for i in range(1, n + 1):
        if i % per_restart == 0:
            attempt += 1
            step = max(0, step - back)
        loss = 2.0 / math.sqrt(1 + step / 1000) + rng.random() * 0.01
        s.add(step, T0 + int(i * period_s * 1000), loss, attempt)
        step += 1
        if i in marks:
            seen.append((i * period_s / DAY_S, tracemalloc.get_traced_memory()[0]))
    took = time.perf_counter() - start
    if traced:
        tracemalloc.stop()
    return s, took / n * 1e6, seen


def traced_decode(encoded: str) -> int:
    """Bytes a series holds once decoded from ``encoded`` (what a reader keeps)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    s = decode_series(encoded)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(s.recent) == RECENT
    return used


def part_curves(args: argparse.Namespace) -> None:
    print(f"1. a 30-day curve: Series(RECENT={RECENT}, BUCKETS={BUCKETS}), "
          f"{args.days:g} days, a restart every {args.restart_days:g} days")
    for period, traced in ((1.0, False), (0.1, False), (1.0, True)):
        if traced and not args.traced_feed:
            continue
        s, us, seen = curve(args.days, period, args.restart_days, traced)
        if traced:
            print("    Python memory, fed under tracemalloc from the first point: " + ", ".join(
                f"day {d:g}: {b / 1024:.0f} KiB" for d, b in seen))
            continue
        encoded = s.encode()
        kept = len(s.recent) + len(s.buckets)
        print(f"  one point every {period:g} s: {len(s):,} points -> {kept:,} entries kept "
              f"({len(s.recent)} raw + {len(s.buckets)} buckets of up to {s.width:,} points, "
              f"{len(s.max_step)} attempts); encoded {len(encoded) / 1024:.1f} KiB; "
              f"{us:.2f} us per add")
        print(f"    Python memory decoded from its encoding: "
              f"{traced_decode(encoded) / 1024:.0f} KiB")


def part_fold() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import metrics_fold_bench as fold  # bench/ is no package

    print("2. the console's fold (bench/metrics_fold_bench.py: every rank's latest state, "
          "curves full, 4 metrics, 4 chosen ranks)")
    for ranks in (1_024, 32_768):
        print(f"  {ranks:6,} ranks: {fold.memory(ranks, 4, 4) / 2**20:6.1f} MiB")


def _hostile(t: MetricsTracker, first: int, count: int, marks: set[int] | None = None,
             report: list[str] | None = None) -> None:
    """Feed ``count`` hostile lines (numbered from ``first``) in pipe-sized chunks, taking
    (the publication) every 2,000 lines."""
    big = "9" * 40
    buf: list[str] = []
    size = 0
    for done in range(first + 1, first + count + 1):
        line = f"step {done} name_{done}=1e999 m{done}: -{big} lr={done}e-9\n"
        buf.append(line)
        size += len(line)
        if size >= CHUNK or done % 2_000 == 0 or done == first + count:
            t.feed(0, "stdout", "".join(buf).encode())
            buf, size = [], 0
        if done % 2_000 == 0:
            t.take()
        if marks and report is not None and done in marks:
            report.append(f"{done:,} lines: {tracemalloc.get_traced_memory()[0] / 1024:.0f} KiB")


def part_tracker(lines: int, traced_lines: int) -> None:
    print("3a. hostile output into the agent's tracker: lines each with a new name, a 40-digit "
          "number and 1e999; then 10 MB without a newline")
    gc.collect()
    tracemalloc.start()
    t = MetricsTracker()
    t.start_attempt(0)
    nans: list[tuple[object, ...]] = []
    t.on_nan = lambda *a: nans.append(a)
    report: list[str] = []
    _hostile(t, 0, traced_lines, {10 ** k for k in range(2, 12)} | {traced_lines}, report)
    # the 10 MB number, a pipe read at a time (the bench holds 64 KiB of it, not 10 MB)
    nines = b"9" * CHUNK
    t.feed(0, "stdout", b"step 1 loss=" + nines)
    for _ in range(10_000_000 // CHUNK):
        t.feed(0, "stdout", nines)
    t.take()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    r = t.ranks[0]
    print("  under tracemalloc, the tracker's memory: " + "; ".join(report))
    print(f"  after the 10 MB line: {current / 1024:.0f} KiB held, peak {peak / 1024:.0f} KiB "
          f"(64 KiB of it the bench's chunk); names kept {len(r.values)} (at most "
          f"{tracker_mod.MAX_NAMES} a rank), dropped {r.dropped:,}; nan reports {len(nans)}")
    proc = psutil.Process()
    gc.collect()
    rss0 = proc.memory_info().rss
    start = time.perf_counter()
    _hostile(t, traced_lines, lines)
    took = time.perf_counter() - start
    rss1 = proc.memory_info().rss
    print(f"  {lines:,} lines more, untraced: {took / lines * 1e6:.1f} us a line; the process's "
          f"RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB; dropped {t.ranks[0].dropped:,}")


def part_redis(intervals: int) -> None:
    names = [f"{'x' * 44}{i:04d}" for i in range(tracker_mod.MAX_NAMES)]
    number = "1." + "2" * 30  # 32 characters: the longest number read
    print(f"3b. Redis: one node, {intervals:,} intervals of {POINTS} points of {len(names)} names "
          f"of {len(names[0])} characters and 32-character numbers (the tracker's limits: each "
          f"entry trimmed to its cap; the stream keeps ~{metric_records.METRICS_MAXLEN:,} "
          "entries), a restart every 600 intervals")
    server = RedisServer().start()
    try:
        r = make_client(server.url)
        job = "metrics-memory"
        keys = JobKeys(job)
        now = [0.0]  # the agent's clock: 2 s an interval (the history is written every 30 s)
        t = MetricsTracker(clock=lambda: now[0])
        pub = MetricsPublisher(t, job, "node-a", lambda *a, **k: None, clock=lambda: now[0])
        pub.start_attempt(0, holds_rank0=True)
        step = 0
        start = time.perf_counter()
        for k in range(intervals):
            text = "".join(
                "step " + str(step + i) + " " + " ".join(f"{n}={number}" for n in names) + "\n"
                for i in range(POINTS))
            step += POINTS
            t.feed(0, "stdout", text.encode())
            now[0] += 2.0
            pipe = r.pipeline(transaction=False)
            _, queued = pub.ride(pipe)
            pub.landed(pipe.execute(raise_on_error=False) if queued else [])
            if k % 600 == 599:  # a restart every 20 minutes of intervals: a new round
                pub.start_attempt(pub.round + 1, holds_rank0=True)
        took = time.perf_counter() - start
        pattern = keys.prefix.replace("{", "\\{").replace("}", "\\}") + "metrics*"
        found = [k.decode() for k in r.scan_iter(match=pattern, count=1000)]
        sizes = {k: r.memory_usage(k, samples=0) or 0 for k in found}
        stream = sizes.get(keys.metrics, 0)
        print(f"  {len(found)} keys, {sum(sizes.values()) / 2**20:.1f} MiB in all: the stream "
              f"{r.xlen(keys.metrics):,} entries, {stream / 2**20:.1f} MiB; the history "
              f"{r.hlen(keys.metrics_history)} series, "
              f"{sizes.get(keys.metrics_history, 0) / 1024:.0f} KiB; the rounds' steps "
              f"{r.hlen(keys.metrics_steps)} fields; {took / intervals * 1e3:.1f} ms an "
              "interval (parse + publish)")
        print(f"  Redis used_memory {r.info('memory')['used_memory'] / 2**20:.1f} MiB")
        r.close()
    except redis.RedisError as exc:
        print(f"  Redis: {exc}")
    finally:
        server.cleanup()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--days", type=float, default=30.0)
    p.add_argument("--restart-days", type=float, default=3.0,
                   help="a restart (a new attempt, 10 minutes of steps redone) every N days")
    p.add_argument("--lines", type=int, default=2_000_000, help="hostile lines for 3a")
    p.add_argument("--traced-lines", type=int, default=200_000,
                   help="of those, fed under tracemalloc first (about 7x slower)")
    p.add_argument("--intervals", type=int, default=6_000, help="publications for 3b")
    p.add_argument("--only", default="123", help="the parts to run (digits)")
    p.add_argument("--no-traced-feed", dest="traced_feed", action="store_false",
                   help="skip feeding the 1 s curve again under tracemalloc (minutes)")
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}")
    if "1" in args.only:
        part_curves(args)
    if "2" in args.only:
        part_fold()
    if "3" in args.only:
        part_tracker(args.lines, args.traced_lines)
        part_redis(args.intervals)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
