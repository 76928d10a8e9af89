"""JobMetrics: a job's training metrics folded for the console and the CLI. No I/O, no Textual.

Inputs (each read where the client reads it, decoded and checked by the wire's decoders):

* the metrics stream (``JobKeys.metrics``): one :class:`MetricsEntry` per node and interval,
  every point a rank printed since the node's last entry (:meth:`JobMetrics.apply_entry`);
* the latest fields of each rank's resource sample (``step``, ``total``, ``rate``, ``m``;
  :meth:`JobMetrics.apply_sample`);
* the history hash (``JobKeys.metrics_history``: ``rank0/loss``, ``median/loss``, ``min/loss``,
  ``max/loss`` -> an encoded :class:`Series`), the curves from before the console attached,
  read on attach and again every ~30 s (:meth:`JobMetrics.apply_history`);
* restarts, from the events the :class:`~elastic_console.job.state.JobView` folds
  (:meth:`JobMetrics.note_restart`).

What it keeps, bounded whatever the job's size or its workers print:

* per rank, its latest state only (:class:`RankLatest`: step, total, rate and the latest
  values as a tuple aligned with :attr:`JobMetrics.names`): a few hundred bytes a rank,
  ~8 MiB at 32,768 ranks;
* curves (a :class:`Series` each: RECENT raw points + BUCKETS decimated buckets) for at most
  :data:`MAX_CURVE_METRICS` metrics (loss-like names first): rank 0's, the aggregate across
  ranks (``min``, ``median``, ``max`` at each step, from the points seen), and up to
  :data:`MAX_CHOSEN` chosen ranks'. 8 metrics x 8 curves x ~1,000 entries: ~6 MiB at most;
* at most :data:`MAX_NAMES` distinct metric names (a worker printing a billion distinct names
  costs a counter: ``names_dropped``); ranks beyond :data:`MAX_LATEST_RANKS` are counted too.

The aggregate: the points of one step (of one attempt) from every rank are gathered until no
point of that step came for :data:`SETTLE_MS` of server time (nodes publish once an interval,
so their points of one step arrive within an interval or two), or until more than
:data:`MAX_PENDING_STEPS` steps are open; then the step's min, median and max go on the
curves. The median is exact up to :data:`AGG_SAMPLE` values a step (beyond, of the first
ones; min and max stay exact). A point of a step already settled is late: counted, not drawn.

A step whose number an earlier attempt already reached was trained again after a restart
resumed from a checkpoint: :attr:`CurvePoint.redone` (``Series.redone``).

Cost: :attr:`JobMetrics.fold_ns` / :attr:`JobMetrics.entries` is the fold's cost per entry
(``bench/console_bench.py`` prints it with a metrics feed).
"""

from __future__ import annotations

import math
import re
import time
from array import array
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from elastic_agent.coordination.wire.metric_records import (
    NAME_RE,
    MetricsEntry,
    decode_latest,
)
from elastic_agent.coordination.wire.metric_series import (
    BUCKETS,
    RECENT,
    Point,
    Series,
    SeriesError,
    decode_series,
)
from elastic_agent.coordination.wire.protocol import MAX_RANK, is_rank, stream_id_ms

__all__ = [
    "AGGREGATES",
    "MAX_CHOSEN",
    "MAX_CURVE_METRICS",
    "MAX_NAMES",
    "CurvePoint",
    "JobMetrics",
    "Marker",
    "Progress",
    "RankLatest",
    "is_loss_like",
]

#: Distinct metric names kept for a job (a rank may have 32; most jobs have a handful).
MAX_NAMES = 64
#: Metrics with curves (the others: per-rank latest values only).
MAX_CURVE_METRICS = 8
#: Ranks whose curves are drawn beside rank 0's and the aggregate.
MAX_CHOSEN = 4
#: Ranks with a latest state: the design's largest job.
MAX_LATEST_RANKS = 32_768
#: Values of one step and metric kept for its median (min and max see every value).
AGG_SAMPLE = 1_024
#: Steps gathered at once for the aggregate; beyond, the oldest is settled.
MAX_PENDING_STEPS = 64
#: A step's aggregate is settled once no point of it came for this long (server time).
SETTLE_MS = 3_000
#: Restarts remembered for the markers.
MAX_MARKERS = 256
#: Fields of the history hash read (8 metrics x 4 series are written; the rest is foreign).
MAX_HISTORY_FIELDS = 64
#: The aggregate curves, and the history hash's names of its series.
AGGREGATES = ("min", "median", "max")
HISTORY_SOURCES = ("rank0", *AGGREGATES)
#: Above this many ranks the progress summary (a walk over every rank) is recomputed at
#: most once a second.
SUMMARY_EVERY_RANKS = 1_024
SUMMARY_INTERVAL_S = 1.0

_LOSS = re.compile(r"loss|perplexity|ppl", re.IGNORECASE)
_NAN = math.nan


def is_loss_like(name: str) -> bool:
    """A name that says it is a loss (``loss``, ``train_loss``, ``val/loss``, ``ppl``): those
    come first wherever metrics are listed."""
    return _LOSS.search(name) is not None


class RankLatest(NamedTuple):
    """A rank's latest training state. ``values`` is aligned with :attr:`JobMetrics.names`
    (None where the rank has no value; shorter when names came after its last update)."""

    step: int | None
    total: int | None
    rate: float | None
    values: tuple[float | None, ...]
    attempt: int  # of the newest point seen (-1: only samples so far)
    dropped: int  # names the rank's agent refused (over its bound)


class CurvePoint(NamedTuple):
    """A point of a curve as drawn: a raw point (``lo == hi == value``) or a bucket of
    several (``value`` its last, ``lo``/``hi`` its range)."""

    step: int
    ms: int
    value: float
    lo: float
    hi: float
    attempt: int
    redone: bool


class Marker(NamedTuple):
    """A restart: when (server ms), the round it ended, why."""

    ms: int
    round: int | None
    reason: str


class Progress(NamedTuple):
    """The header's progress: ``step``/``total`` of the rank it is measured on, and an ETA."""

    step: int
    total: int
    rate: float | None
    eta_s: float | None
    rank: int
    basis: str  # "slowest rank" (several ranks know the total) or "rank"


class Summary(NamedTuple):
    """Facts over every rank, worked out at most once a second at scale."""

    slowest: int | None  # the rank with the lowest step, when ranks differ
    low: int | None  # the lowest and highest steps (of the newest attempt)
    high: int | None
    progress: Progress | None


class _Step:
    """The values of one step (of one attempt) gathered across ranks: per metric index
    ``[lo, hi, sample]``."""

    __slots__ = ("acc", "last_ms", "ms")

    def __init__(self, ms: int) -> None:
        self.ms = ms
        self.last_ms = ms
        self.acc: dict[int, list[Any]] = {}


class JobMetrics:
    """The fold (see the module docstring). ``recent``/``buckets``: the size of each curve
    (the CLI asks for more, to print every point the stream still holds). ``only``: curves
    for these metrics alone (the CLI's ``--metric``)."""

    def __init__(self, *, recent: int = RECENT, buckets: int = BUCKETS,
                 only: Iterable[str] | None = None) -> None:
        self.recent = recent
        self.buckets = buckets
        self._only = frozenset(only) if only is not None else None
        self.names: list[str] = []
        self._index: dict[str, int] = {}
        #: Metric indices with curves (at most MAX_CURVE_METRICS), in the order they came.
        self._curved: list[int] = []
        self.latest: dict[int, RankLatest] = {}
        # source ("rank0", "min", "median", "max", "rank<N>") -> metric index -> its curve
        self._curves: dict[str, dict[int, Series]] = {s: {} for s in HISTORY_SOURCES}
        self.history: dict[str, Series] = {}  # "rank0/loss" -> the agent's series
        self.chosen: list[int] = []
        #: Whether the aggregate is worked out here from every rank's points. A big job's
        #: console reads only the entries of rank 0's and the chosen ranks' nodes (its reader's
        #: ``metrics_nodes``): then its aggregate is the agents' (the history hash) alone.
        self.live_aggregate = True
        self.markers: deque[Marker] = deque(maxlen=MAX_MARKERS)
        self._pending: dict[tuple[int, int], _Step] = {}
        self._settled: dict[int, int] = {}  # attempt -> its highest settled step
        self._newest_ms = 0
        self._world: int | None = None
        self._summary: Summary = Summary(None, None, None, None)
        self._summary_version = -1
        self._summary_at = 0.0
        #: Goes up on every change (a screen redraws only when it moved).
        self.version = 0
        #: Counters: entries and points folded, points of a settled step, names and ranks
        #: beyond the bounds, history fields that did not decode, samples refused.
        self.entries = 0
        self.points = 0
        self.late = 0
        self.names_dropped = 0
        self.ranks_dropped = 0
        self.history_bad = 0
        self.samples_bad = 0
        #: Nanoseconds spent in :meth:`apply_entry` (its cost per entry: / ``entries``).
        self.fold_ns = 0

    # -- names -------------------------------------------------------------------------------
    def _name(self, name: str) -> int | None:
        """The index of ``name`` (a new one if there is room), None past MAX_NAMES."""
        i = self._index.get(name)
        if i is not None:
            return i
        if len(self.names) >= MAX_NAMES or not NAME_RE.fullmatch(name):
            self.names_dropped += 1
            return None
        i = self._index[name] = len(self.names)
        self.names.append(name)
        if self._only is None or name in self._only:
            self._curve_slot(i)
        return i

    def _curve_slot(self, i: int) -> None:
        curved = self._curved
        if len(curved) < MAX_CURVE_METRICS:
            curved.append(i)
            return
        if not is_loss_like(self.names[i]):
            return
        # A loss always has a curve: it takes the newest slot of a metric that is not one.
        for j in reversed(curved):
            if not is_loss_like(self.names[j]):
                curved.remove(j)
                for curves in self._curves.values():
                    curves.pop(j, None)
                curved.append(i)
                return

    def metric_names(self) -> list[str]:
        """Every metric name seen, loss-like first, then in the order they came."""
        return sorted(self.names, key=lambda n: (not is_loss_like(n), self._index[n]))

    def curve_metrics(self) -> list[str]:
        """The metrics with curves, loss-like first, then in the order they came."""
        return sorted((self.names[i] for i in self._curved),
                      key=lambda n: (not is_loss_like(n), self._index[n]))

    @property
    def any_step(self) -> bool:
        """Whether any rank has a step (the rank table shows its STEP columns then)."""
        return self._any_step

    _any_step = False

    # -- inputs ------------------------------------------------------------------------------
    def set_world(self, world: int) -> None:
        """A round gave the world size: ranks at or beyond it no longer exist."""
        if not 0 <= world <= MAX_RANK:
            return
        self._world = world
        gone = [r for r in self.latest if r >= world]
        for r in gone:
            del self.latest[r]
        if gone:
            self.version += 1

    def note_restart(self, ms: int, round_: int | None, reason: str) -> None:
        """A ``restarting`` event (server ms): a marker on the curves."""
        if self.markers and self.markers[-1].ms == ms and self.markers[-1].round == round_:
            return
        self.markers.append(Marker(int(ms), round_, str(reason)[:64]))
        self.version += 1

    def apply_sample(self, rank: int, sample: Mapping[str, Any]) -> None:
        """The metric fields of rank ``rank``'s resource sample (none: nothing to do)."""
        if "step" not in sample and "m" not in sample:
            return
        latest = decode_latest(sample)
        if latest is None:
            self.samples_bad += 1
            return
        old = self.latest.get(rank)
        if old is None and not self._room_for(rank):
            return
        values = self._values(latest.values, old.values if old is not None else ())
        step = latest.step if latest.step is not None else (old.step if old else None)
        total = latest.total if latest.total is not None else (old.total if old else None)
        rate = latest.rate if latest.rate is not None else (old.rate if old else None)
        new = RankLatest(step, total, rate, values, old.attempt if old else -1, latest.dropped)
        if new != old:
            self.latest[rank] = new
            self._any_step = self._any_step or step is not None
            self.version += 1

    def _room_for(self, rank: int) -> bool:
        if not is_rank(rank) or (self._world is not None and rank >= self._world) \
                or len(self.latest) >= MAX_LATEST_RANKS:
            self.ranks_dropped += 1
            return False
        return True

    def _values(self, values: Mapping[str, float], old: tuple[float | None, ...]
                ) -> tuple[float | None, ...]:
        """``values`` as a tuple aligned with ``names``, over ``old`` (kept where not given)."""
        out: list[float | None] = list(old)
        for name, v in values.items():
            i = self._name(name)
            if i is None:
                continue
            if i >= len(out):
                out.extend([None] * (i + 1 - len(out)))
            out[i] = v
        return tuple(out)

    def apply_entry(self, entry: MetricsEntry) -> None:
        """Fold one entry of the metrics stream (decoded by ``decode_metrics_entry``)."""
        t0 = time.perf_counter_ns()
        attempt = entry.attempt
        curves = self._curves
        chosen = self.chosen
        pending = self._pending
        settled = self._settled.get(attempt, -1)
        newest = max(stream_id_ms(entry.id), self._newest_ms)
        # Each rank's newest point of the entry, for its latest state.
        last: dict[int, tuple[int, dict[str, float]]] = {}
        index, curved, name = self._index, set(self._curved), self._name
        live_aggregate = self.live_aggregate
        for rank, step, ms, values in entry.points:
            self.points += 1
            if ms > newest:
                newest = ms
            # The values of the metrics with curves (a name seen first is interned here).
            idx = []
            for k, v in values.items():
                i = index.get(k)
                if i is None:
                    i = name(k)
                    curved = set(self._curved)
                if i is not None and i in curved:
                    idx.append((i, v))
            prev = last.get(rank)
            if prev is None or step >= prev[0]:
                last[rank] = (step, values)
            if rank == 0 or rank in chosen:
                source = curves.setdefault(f"rank{rank}", {})
                for i, v in idx:
                    self._add(source, i, step, ms, v, attempt)
            if not live_aggregate:
                continue
            if step <= settled:
                self.late += 1
                continue
            key = (attempt, step)
            acc = pending.get(key)
            if acc is None:
                acc = pending[key] = _Step(ms)
            elif ms > acc.last_ms:
                acc.last_ms = ms
            for i, v in idx:
                slot = acc.acc.get(i)
                if slot is None:
                    acc.acc[i] = [v, v, array("d", (v,))]
                    continue
                if v < slot[0] or slot[0] != slot[0]:
                    slot[0] = v
                if v > slot[1] or slot[1] != slot[1]:
                    slot[1] = v
                if len(slot[2]) < AGG_SAMPLE:
                    slot[2].append(v)
        for rank, (step, values) in last.items():
            self._latest_point(rank, step, values, attempt)
        self._newest_ms = newest
        self.entries += 1
        self.settle(newest)
        self.version += 1
        self.fold_ns += time.perf_counter_ns() - t0

    def _latest_point(self, rank: int, step: int, values: dict[str, float], attempt: int) -> None:
        old = self.latest.get(rank)
        if old is None:
            if not self._room_for(rank):
                return
        elif attempt < old.attempt or (attempt == old.attempt and old.step is not None
                                       and step < old.step):
            return  # older than what the rank's sample or a newer entry said
        self.latest[rank] = RankLatest(
            step, old.total if old else None, old.rate if old else None,
            self._values(values, old.values if old else ()), attempt,
            old.dropped if old else 0)
        self._any_step = True

    def _add(self, source: dict[int, Series], i: int, step: int, ms: int, value: float,
             attempt: int) -> None:
        s = source.get(i)
        if s is None:
            s = source[i] = Series(self.recent, self.buckets)
        last = s.latest()
        if last is not None and attempt < last.attempt:
            self.late += 1  # an older attempt's point after a newer one's: out of order
            return
        if last is not None and last.attempt == attempt:
            if step == last.step:  # the same step printed again: its newest value
                s.recent[-1] = Point(step, ms, value, attempt)
                return
            if step < last.step:
                self.late += 1
                return
        s.add(step, ms, value, attempt)

    def settle(self, now_ms: int | float) -> None:
        """Put on the aggregate curves the steps no point came for since ``SETTLE_MS`` before
        ``now_ms`` (server time; ``math.inf``: every open step), oldest first."""
        pending = self._pending
        if not pending:
            return
        over = len(pending) - MAX_PENDING_STEPS
        done = []
        # Oldest first, and only a prefix: a step settled before an older one would make
        # the older one late.
        for n, key in enumerate(sorted(pending)):
            if n >= over and pending[key].last_ms + SETTLE_MS > now_ms:
                break
            done.append(key)
        if not done:
            return
        for key in done:
            acc = pending.pop(key)
            attempt, step = key
            if step <= self._settled.get(attempt, -1):
                self.late += 1
                continue
            self._settled[attempt] = step
            if len(self._settled) > 256:
                del self._settled[min(self._settled)]
            for i, (lo, hi, sample) in acc.acc.items():
                finite = sorted(v for v in sample if math.isfinite(v))
                median = _median(finite) if finite else (sample[0] if sample else _NAN)
                for name, value in (("min", lo), ("median", median), ("max", hi)):
                    self._add(self._curves[name], i, step, acc.ms, value, attempt)
        self.version += 1

    def apply_history(self, fields: Mapping[Any, Any]) -> None:
        """The history hash (field -> encoded Series), as read: fields named
        ``<rank0|min|median|max>/<metric>`` with a series that decodes are kept, the rest
        counted in ``history_bad``."""
        for n, (field, raw) in enumerate(fields.items()):
            if n >= MAX_HISTORY_FIELDS:
                self.history_bad += len(fields) - n
                break
            name = field.decode("utf-8", "replace") if isinstance(field, bytes) else str(field)
            source, _, metric = name.partition("/")
            if source not in HISTORY_SOURCES or not NAME_RE.fullmatch(metric):
                self.history_bad += 1
                continue
            try:
                series = decode_series(raw, self.recent, self.buckets)
            except SeriesError:
                self.history_bad += 1
                continue
            if self._name(metric) is None:
                continue
            self.history[name] = series
        self.version += 1

    # -- chosen ranks ------------------------------------------------------------------------
    def choose(self, rank: int) -> bool:
        """Draw ``rank``'s curves too (from now on; :meth:`backfill` adds its past). At most
        MAX_CHOSEN: the one chosen first makes room. False when it already was (or is 0, whose
        curves are always kept)."""
        if rank == 0 or rank in self.chosen or not is_rank(rank):
            return False
        if len(self.chosen) >= MAX_CHOSEN:
            self.unchoose(self.chosen[0])
        self.chosen.append(rank)
        self._curves.setdefault(f"rank{rank}", {})
        self.version += 1
        return True

    def unchoose(self, rank: int) -> None:
        if rank in self.chosen:
            self.chosen.remove(rank)
            self._curves.pop(f"rank{rank}", None)
            self.version += 1

    def backfill(self, rank: int, entries: Iterable[MetricsEntry]) -> None:
        """``rank``'s points from ``entries`` (the stream's, oldest first) before its curves
        (made since it was chosen) began."""
        if rank != 0 and rank not in self.chosen:
            return
        source = self._curves.setdefault(f"rank{rank}", {})
        live = {i: list(s.points()) for i, s in source.items()}
        firsts = {i: pts[0][1] for i, pts in live.items() if pts}
        fresh: dict[int, Series] = {}
        for entry in entries:
            for p in entry.points:
                if p.rank != rank:
                    continue
                for k, v in p.values.items():
                    i = self._index.get(k)
                    if i is None or i not in self._curved or p.ms >= firsts.get(i, math.inf):
                        continue
                    self._add(fresh, i, p.step, p.ms, v, entry.attempt)
        for i, pts in live.items():
            for step, ms, value, _, _, attempt in pts:
                self._add(fresh, i, step, ms, value, attempt)
        source.clear()
        source.update(fresh)
        self.version += 1

    # -- queries -----------------------------------------------------------------------------
    def curve(self, metric: str, source: str) -> list[CurvePoint]:
        """The points of ``metric``'s curve from ``source`` (``rank0``, ``min``, ``median``,
        ``max`` or ``rank<N>`` of a chosen rank): the history's before the live curve's first
        (attempt, step), then the live curve's; oldest first."""
        i = self._index.get(metric)
        live = self._curves.get(source, {}).get(i) if i is not None else None
        if source in AGGREGATES and not self.live_aggregate:
            live = None  # some ranks' points only: the agents' aggregate is the whole job's
        hist = self.history.get(f"{source}/{metric}")
        parts = [s for s in (hist, live) if s is not None]
        if not parts:
            return []
        # The history is the agents' record up to its last write: the live curve takes over
        # at its first point (by attempt and step: the two were timed by different readers).
        first_live = _first(live) if live is not None else None
        out = []
        for s in parts:
            for step, ms, value, lo, hi, attempt in s.points():
                if s is hist and first_live is not None and (attempt, step) >= first_live:
                    break
                out.append(CurvePoint(step, ms, value, lo, hi, attempt,
                                      any(x.redone(step, attempt) for x in parts)))
        return out

    def sources(self, metric: str) -> list[str]:
        """The sources that have points of ``metric``."""
        i = self._index.get(metric)
        out = []
        for source, curves in self._curves.items():
            if (i is not None and i in curves) or f"{source}/{metric}" in self.history:
                out.append(source)
        return out

    def values_of(self, rank: int) -> dict[str, float]:
        """Rank ``rank``'s latest value of each metric."""
        latest = self.latest.get(rank)
        if latest is None:
            return {}
        return {self.names[i]: v for i, v in enumerate(latest.values) if v is not None}

    def summary(self) -> Summary:
        """The slowest rank and the progress (:class:`Summary`), worked out again when the
        fold changed (above SUMMARY_EVERY_RANKS ranks: at most once a second)."""
        if self._summary_version == self.version:
            return self._summary
        now = time.monotonic()
        if len(self.latest) > SUMMARY_EVERY_RANKS and now - self._summary_at < SUMMARY_INTERVAL_S:
            return self._summary
        self._summary_version, self._summary_at = self.version, now
        self._summary = self._summarize()
        return self._summary

    def _summarize(self) -> Summary:
        newest = max((v.attempt for v in self.latest.values()), default=-1)
        low = high = slowest = None
        with_total: list[tuple[int, int, RankLatest]] = []
        for rank, v in self.latest.items():
            step = v.step
            if step is None or v.attempt < newest:
                continue
            if low is None or step < low or (step == low and rank < (slowest or 0)):
                low, slowest = step, rank
            if high is None or step > high:
                high = step
            if v.total:
                with_total.append((step, rank, v))
        if low is None or low == high:
            slowest = None  # one rank, or every rank at the same step: nobody lags
        progress = None
        if with_total:
            step, rank, v = min(with_total, key=lambda t: (t[0], t[1]))
            total = v.total or 0
            eta = ((total - step) / v.rate if v.rate and v.rate > 0 and step < total else
                   (0.0 if step >= total else None))
            progress = Progress(step, total, v.rate, eta, rank,
                                "slowest rank" if len(with_total) > 1 else "rank")
        return Summary(slowest, low, high, progress)

    def cost_per_entry_us(self) -> float:
        """Microseconds :meth:`apply_entry` took per entry, on average."""
        return self.fold_ns / 1000 / self.entries if self.entries else 0.0


def _median(values: list[float]) -> float:
    n = len(values)
    mid = n // 2
    return values[mid] if n % 2 else (values[mid - 1] + values[mid]) / 2


def _first(series: Series) -> tuple[int, int] | None:
    """(attempt, step) of a series' first point."""
    if series.buckets:
        return series.buckets[0].attempt, series.buckets[0].first
    return (series.recent[0].attempt, series.recent[0].step) if series.recent else None
