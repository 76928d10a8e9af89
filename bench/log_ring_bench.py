"""The console's per-rank rings: lines as tuples (LogBuffer) against packed (PackedLogBuffer).

Each variant runs in a child process of its own: a ``JobView`` of ``--ranks`` ranks is fed
realistic training output (``log_view_bench.make_pool``; each line its own str, as decoded
from Redis) in batches of ``--batch`` lines per rank, round-robin, until every rank's ring
(``--scrollback`` lines) is full and has turned over once. Printed per variant: the RSS the
fed view added to the process (after a full collection), that per line held, and the time
``JobView.apply_logs`` took per line over the whole feed (packing included).

* ``tuples``: the rings before issue 15 (every line a tuple of Python objects);
* ``packed``: the console's rings now (console/job/packed_buffer.py).

torchrun has no console and no rings: the baseline is the tuples variant, and the ratio is
packed / tuples.

    python bench/log_ring_bench.py [--ranks 1024] [--scrollback 2000] [--batch 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from log_view_bench import make_pool

T0 = 1_700_000_000_000


def child(args: argparse.Namespace) -> dict[str, float]:
    from elastic_agent.coordination.wire.log_records import LogBatch
    from elastic_console.job import log_fold, state
    from elastic_console.job.logbuffer import LogBuffer

    if args.variant == "tuples":
        log_fold.PackedLogBuffer = LogBuffer  # type: ignore[misc]  # the rings before issue 15
    pool = [text for _, text in make_pool()]
    proc = psutil.Process()
    gc.collect()
    base = proc.memory_info().rss
    view = state.JobView("bench", scrollback=args.scrollback)
    rounds = 2 * args.scrollback // args.batch + 1
    i = 0
    spent = 0.0
    for seq in range(1, rounds + 1):
        batches = []
        for rank in range(args.ranks):
            lines = [pool[(i + k) % len(pool)].encode().decode() for k in range(args.batch)]
            i += args.batch
            batches.append(LogBatch(f"n{rank // 16}", rank, rank % 16, 0, "out", seq, lines,
                                    f"{T0 + seq * 100}-{rank}"))
        t = time.perf_counter()
        for b in batches:
            view.apply_logs(b)
        spent += time.perf_counter() - t
    gc.collect()
    held = sum(len(ring) for ring in view.logs.values()) + len(view.all_logs)
    added = proc.memory_info().rss - base
    return {"lines_fed": view.lines_total, "lines_held": held, "rss_mib": added / 2**20,
            "bytes_per_line": added / held, "us_per_line": spent / view.lines_total * 1e6}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--scrollback", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=5, help="lines per rank per batch")
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(child(args)))
        return 0
    results = {}
    for variant in ("tuples", "packed"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant,
                              "--ranks", str(args.ranks), "--scrollback", str(args.scrollback),
                              "--batch", str(args.batch)],
                             capture_output=True, text=True, check=True)
        results[variant] = json.loads(out.stdout)
    t, p = results["tuples"], results["packed"]
    print(f"log rings: {args.ranks} ranks x {args.scrollback} lines, {args.batch}-line batches, "
          f"{t['lines_fed']:,} lines fed, {p['lines_held']:,} held")
    print(f"{'':28}{'tuples':>10}{'packed':>10}{'ratio':>8}")
    for key, label, fmt in (("rss_mib", "RSS added MiB", "{:,.0f}"),
                            ("bytes_per_line", "bytes per line held", "{:,.0f}"),
                            ("us_per_line", "apply_logs us per line", "{:.2f}")):
        print(f"{label:28}{fmt.format(t[key]):>10}{fmt.format(p[key]):>10}"
              f"{p[key] / t[key]:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
