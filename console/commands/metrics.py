"""`metrics`: one curve of a job's training metrics, as the console's metrics view draws it.

    elastic-console metrics JOB [--metric M] [--rank R | --aggregate] [--json | --csv]

The points are the history the agents keep (``JobKeys.metrics_history``: rank 0's and the
aggregate's whole run, decimated) followed by the metrics stream's recent points (every point
each rank printed, as long as the stream keeps them). Rank 0's by default; ``--rank R`` that
rank's (the stream's points only: the history is rank 0's and the aggregate's);
``--aggregate`` the median across ranks at each step with its min and max. ``--metric``
defaults to the job's first loss-like metric.

JSON: ``{"metric", "rank" (null for the aggregate), "points": [{"step", "ms" (server time),
"value", "attempt", "redone"}]}`` (the aggregate's points also have ``min`` and ``max``); a
value that is not a finite number is the string ``"nan"``, ``"inf"`` or ``"-inf"``. CSV: the
same columns with a header line. An unknown job or metric, or a curve without a point: one
line on stderr, exit 1. Read-only.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from typing import Any

from elastic_agent.coordination.transport.endpoints import Endpoint
from elastic_agent.coordination.wire.metric_records import NAME_RE

from ..job.formatting import fmt_clock
from ..job.metrics import CurvePoint, JobMetrics, is_loss_like
from .common import EXIT_OK, EXIT_USAGE, CliError, _job, _open, _out, _table, _write

__all__ = ["metrics", "value_out"]

#: Raw points kept per curve: every point a 5,000-entry stream can hold for one rank at a
#: typical step rate (a curve is ~100 bytes a point: 6 MiB at most).
CLI_RECENT = 65_536


def value_out(v: float) -> float | str:
    """A value for JSON: the number, or ``"nan"``, ``"inf"``, ``"-inf"`` (JSON has none)."""
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _point(p: CurvePoint, aggregate: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"step": p.step, "ms": p.ms, "value": value_out(p.value),
                           "attempt": p.attempt, "redone": p.redone}
    if aggregate:
        out["min"], out["max"] = value_out(p.lo), value_out(p.hi)
    return out


async def metrics(ep: Endpoint, args: argparse.Namespace) -> int:
    job = _job(args)
    if args.metric is not None and not NAME_RE.fullmatch(args.metric):
        raise CliError(f"{args.metric[:60]!r} is not a metric name (letters, digits, "
                       "'_./-', starting with a letter or '_')", EXIT_USAGE)
    client = await _open(ep, job)
    try:
        entries = await client.metrics_recent(follow=False)
        names: dict[str, None] = {}
        for e in entries:
            for p in e.points:
                names.update(dict.fromkeys(p.values))
        history = await client.metrics_history(list(names))
    finally:
        await client.close()
    for field in history:
        _, _, name = field.partition("/")
        if NAME_RE.fullmatch(name):
            names.setdefault(name)
    if not names:
        raise CliError(f"job '{job}' has no training metrics yet: the agents read them from "
                       "the workers' output (docs/CONSOLE.md, metrics)")
    metric = args.metric or min(names, key=lambda n: (not is_loss_like(n),
                                                      list(names).index(n)))
    if metric not in names:
        shown = ", ".join(sorted(names)[:20]) + (" ..." if len(names) > 20 else "")
        raise CliError(f"job '{job}' has no metric '{metric}': its metrics are {shown}")
    fold = JobMetrics(recent=CLI_RECENT, only=[metric])
    rank = None if args.aggregate else (args.rank or 0)
    if rank:
        fold.choose(rank)
    fold.apply_history(history)
    for entry in entries:
        fold.apply_entry(entry)
    fold.settle(math.inf)  # every step the stream holds is as complete as it will be
    source = "median" if rank is None else f"rank{rank}"
    points = fold.curve(metric, source)
    if not points:
        who = "the ranks" if rank is None else f"rank {rank}"
        raise CliError(f"job '{job}': {who} printed no point of '{metric}' that Redis still "
                       "keeps" + (" (--aggregate: every rank's)" if rank is not None else ""))
    if rank is None:
        lows = {p.step: p for p in fold.curve(metric, "min")}
        highs = {p.step: p for p in fold.curve(metric, "max")}
        points = [p._replace(lo=lows[p.step].value if p.step in lows else p.lo,
                             hi=highs[p.step].value if p.step in highs else p.hi)
                  for p in points]
    aggregate = rank is None
    if args.json:
        _out(json.dumps({"metric": metric, "rank": rank,
                         "points": [_point(p, aggregate) for p in points]}))
    elif args.csv:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["step", "ms", "value", "attempt", "redone", *(
            ["min", "max"] if aggregate else [])])
        for p in points:
            w.writerow([p.step, p.ms, _text(p.value), p.attempt, int(p.redone), *(
                [_text(p.lo), _text(p.hi)] if aggregate else [])])
        _write(buf.getvalue().splitlines())
    else:
        what = "median across ranks (min..max)" if aggregate else f"rank {rank}"
        _out(f"{metric}: {what}, {len(points)} points")
        _table(["STEP", "TIME", "VALUE", *(["MIN", "MAX"] if aggregate else []), "ATTEMPT",
                "REDONE"],
               ([str(p.step), fmt_clock(p.ms), _text(p.value),
                 *([_text(p.lo), _text(p.hi)] if aggregate else []), str(p.attempt),
                 "redone" if p.redone else ""] for p in points))
    return EXIT_OK


def _text(v: float) -> str:
    return f"{v:.7g}" if math.isfinite(v) else str(value_out(v))
