"""The console's fold of training metrics (console/job/metrics.py): its cost per entry of the
metrics stream, and its memory at 1,024 and 32,768 ranks.

Every node writes one entry per interval (2 s): its ranks' points since the last one. The
bench builds such entries with the agent's encoder (8 ranks a node, ``--points`` steps a rank
an interval, ``--metrics`` named values a point), decodes them as the console's reader does,
and folds them into a ``JobMetrics``; it prints the time per entry (decode, fold) and what that
costs a console per second at 1,024 and 32,768 ranks (where the console decodes only rank 0's
and the chosen ranks' nodes' entries: ``console/tui/feed.py`` ``METRICS_ALL_RANKS``), then the
fold's memory (tracemalloc) with every rank's latest state and the curves full.

    python bench/metrics_fold_bench.py [--points 4] [--metrics 4] [--intervals 40]
"""

from __future__ import annotations

import argparse
import math
import time
import tracemalloc

from elastic_agent.coordination.wire.metric_records import decode_metrics_entry, encode_metrics_entry
from elastic_console.job.metrics import JobMetrics

INTERVAL_S = 2.0
RANKS_PER_NODE = 8
T0 = 1_700_000_000_000
NAMES = ("loss", "lr", "grad_norm", "tokens_per_s", "accuracy", "mfu", "epoch", "memory")


def entries(nodes: int, intervals: int, points: int, metrics: int, first_node: int = 0
            ) -> list[tuple[str, dict[str, str]]]:
    """(entry id, fields) of ``nodes`` nodes over ``intervals`` intervals, oldest first."""
    out = []
    names = NAMES[:metrics]
    for k in range(intervals):
        ms = T0 + int(k * INTERVAL_S * 1000)
        for n in range(first_node, first_node + nodes):
            ranks = {}
            for r in range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE):
                ranks[r] = [(k * points + i, (points - i) * 400,
                             {name: 1.0 / (1 + k * points + i) + r * 1e-4 + j
                              for j, name in enumerate(names)})
                            for i in range(points)]
            out.append((f"{ms}-{n}", encode_metrics_entry(f"node-{n}", 0, ranks)))
    return out


def fold_cost(nodes: int, intervals: int, points: int, metrics: int) -> tuple[float, float]:
    """Microseconds per entry to decode and to fold."""
    raw = entries(nodes, intervals, points, metrics)
    t0 = time.perf_counter()
    decoded = [decode_metrics_entry(i, f) for i, f in raw]
    t1 = time.perf_counter()
    m = JobMetrics()
    for e in decoded:
        assert e is not None
        m.apply_entry(e)
    m.settle(math.inf)
    t2 = time.perf_counter()
    return (t1 - t0) / len(raw) * 1e6, (t2 - t1) / len(raw) * 1e6


def skip_cost(nodes: int, intervals: int, points: int, metrics: int) -> float:
    """Microseconds per entry the reader of a big job spends on an entry of a node it does
    not decode (``Following.metrics_nodes``): the entry as XREAD hands it over, a flat list."""
    from elastic_console.job.follow import Following, _entry_fields

    reader = Following.__new__(Following)
    reader.metrics_nodes = {"node-0"}
    raw = [[k.encode() if isinstance(k, str) else k for kv in f.items() for k in
            (kv[0], kv[1].encode())] for _, f in entries(nodes, intervals, points, metrics, 1)]
    t0 = time.perf_counter()
    kept = sum(reader._metrics_wanted(_entry_fields(fields)) for fields in raw)
    assert kept == 0
    return (time.perf_counter() - t0) / len(raw) * 1e6


def memory(ranks: int, points: int, metrics: int) -> int:
    """Bytes the fold holds with ``ranks`` ranks' latest states and full curves."""
    tracemalloc.start()
    m = JobMetrics()
    nodes = ranks // RANKS_PER_NODE
    # Every rank's latest (one interval of every node), then rank 0's node long enough to
    # fill the curves (RECENT + BUCKETS points and more).
    for i, f in entries(nodes, 1, 1, metrics):
        e = decode_metrics_entry(i, f)
        assert e is not None
        m.apply_entry(e)
    for rank in range(1, 5):
        m.choose(rank * RANKS_PER_NODE - 1)
    for i, f in entries(1, 600, points, metrics):
        e = decode_metrics_entry(i, f)
        assert e is not None
        m.apply_entry(e)
    m.settle(math.inf)
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(m.latest) == ranks
    return used


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", type=int, default=4, help="steps a rank prints an interval")
    p.add_argument("--metrics", type=int, default=4, help="named values a point")
    p.add_argument("--intervals", type=int, default=40)
    args = p.parse_args()
    decode_us, fold_us = fold_cost(64, args.intervals, args.points, args.metrics)
    per_point = fold_us / (RANKS_PER_NODE * args.points)
    print(f"entry: {RANKS_PER_NODE} ranks x {args.points} points x {args.metrics} metrics")
    print(f"  decode {decode_us:8.1f} us/entry   fold {fold_us:8.1f} us/entry "
          f"({per_point:.2f} us/point)")
    skip_us = skip_cost(64, args.intervals, args.points, args.metrics)
    print(f"  an entry of a node not followed (a big job): {skip_us:.1f} us")
    for ranks in (1_024, 32_768):
        per_s = ranks / RANKS_PER_NODE / INTERVAL_S
        share = per_s * (decode_us + fold_us) / 1e6
        print(f"  {ranks:6,} ranks: {per_s:6,.0f} entries/s -> {share:6.1%} of a core "
              "(decode + fold, every node's)")
    per_s = 32_768 / RANKS_PER_NODE / INTERVAL_S
    decoded = 5 / INTERVAL_S  # entries a second of 5 nodes
    scoped = ((per_s - decoded) * skip_us + decoded * (decode_us + fold_us)) / 1e6
    print(f"  32,768 ranks, rank 0's and 4 chosen ranks' nodes decoded: {scoped:6.1%} of a core")
    for ranks in (1_024, 32_768):
        print(f"  memory at {ranks:6,} ranks (latest + full curves): "
              f"{memory(ranks, args.points, args.metrics) / 2**20:6.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
