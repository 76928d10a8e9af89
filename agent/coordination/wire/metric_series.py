"""One training metric's curve for a whole run, in a fixed amount of memory.

A :class:`Series` keeps the newest :data:`RECENT` points as they came (full resolution) and
everything older as at most :data:`BUCKETS` buckets, each the min, max, last value and step
range of consecutive points. When the buckets are full, neighbours merge pairwise and every
bucket covers twice as many points: a 30-day run at one step a second (2.6 million points)
still draws from first step to last in the same ~1,000 entries a 5-minute run uses.

A point belongs to an attempt (the rendezvous round it was printed in). A point whose step is
not beyond the highest step an earlier attempt reached was *redone*: the job resumed from a
checkpoint and trained those steps again. :meth:`Series.redone` says so; buckets never mix
attempts, so the boundary of every restart survives decimation.

Encoded for Redis (``JobKeys.metrics_history``) by :meth:`Series.encode` and decoded by
:func:`decode_series`, which checks every field: a series read back is hostile input.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterator
from typing import NamedTuple

#: Raw points kept at full resolution.
RECENT = 512
#: Buckets kept for everything older.
BUCKETS = 512
#: Attempts whose highest step is remembered (to tell redone steps).
MAX_ATTEMPTS = 256
#: The largest encoded series a reader decodes.
MAX_ENCODED = 256 * 1024
_ROUND = 7  # significant digits kept when encoded


class Point(NamedTuple):
    step: int
    ms: int  # server time, ms
    value: float
    attempt: int


class Bucket(NamedTuple):
    """Consecutive points of one attempt: steps ``first..last``, times ``t0..t1``."""

    first: int
    last: int
    t0: int
    t1: int
    lo: float
    hi: float
    value: float  # the last point's value
    count: int
    attempt: int


class Series:
    """The decimated curve of one metric of one rank (or of an aggregate)."""

    def __init__(self, recent: int = RECENT, buckets: int = BUCKETS) -> None:
        if recent < 1 or buckets < 2:
            raise ValueError("a series needs room for at least 1 point and 2 buckets")
        self.recent_cap = recent
        self.bucket_cap = buckets
        self.recent: deque[Point] = deque()
        self.buckets: list[Bucket] = []
        #: Points per full bucket: doubles each time the buckets merge.
        self.width = 1
        self.max_step: dict[int, int] = {}  # attempt -> highest step seen

    def __len__(self) -> int:
        return len(self.recent) + sum(b.count for b in self.buckets)

    def add(self, step: int, ms: int, value: float, attempt: int = 0) -> None:
        """Add a point (steps and times are expected to grow within an attempt)."""
        self.recent.append(Point(step, ms, value, attempt))
        if step > self.max_step.get(attempt, -1):
            self.max_step[attempt] = step
            if len(self.max_step) > MAX_ATTEMPTS:
                del self.max_step[min(self.max_step)]
        while len(self.recent) > self.recent_cap:
            self._fold(self.recent.popleft())

    def _fold(self, p: Point) -> None:
        last = self.buckets[-1] if self.buckets else None
        if last is not None and last.attempt == p.attempt and last.count < self.width:
            self.buckets[-1] = Bucket(last.first, p.step, last.t0, p.ms, _min(last.lo, p.value),
                                      _max(last.hi, p.value), p.value, last.count + 1, p.attempt)
        else:
            self.buckets.append(Bucket(p.step, p.step, p.ms, p.ms, p.value, p.value, p.value, 1,
                                       p.attempt))
        if len(self.buckets) > self.bucket_cap:
            self._merge()

    def _merge(self) -> None:
        """Halve the buckets: neighbours of one attempt merge (an attempt's boundary stays).
        With more attempts than buckets (every neighbour of another attempt: nothing merges),
        neighbours merge across attempts, the later one's number kept."""
        across = False
        while len(self.buckets) > self.bucket_cap:
            self.width *= 2
            merged: list[Bucket] = []
            for b in self.buckets:
                prev = merged[-1] if merged else None
                if prev is not None and (across or prev.attempt == b.attempt) \
                        and prev.count + b.count <= self.width:
                    merged[-1] = Bucket(prev.first, b.last, prev.t0, b.t1, _min(prev.lo, b.lo),
                                        _max(prev.hi, b.hi), b.value, prev.count + b.count,
                                        b.attempt)
                else:
                    merged.append(b)
            across = len(merged) == len(self.buckets)  # no progress: many short attempts
            self.buckets = merged

    def points(self) -> Iterator[tuple[int, int, float, float, float, int]]:
        """``(step, ms, value, lo, hi, attempt)`` from the first step to the last: a bucket as
        its last step and value with its min and max, a recent point as itself."""
        for b in self.buckets:
            yield b.last, b.t1, b.value, b.lo, b.hi, b.attempt
        for p in self.recent:
            yield p.step, p.ms, p.value, p.value, p.value, p.attempt

    def redone(self, step: int, attempt: int) -> bool:
        """Whether ``step`` of ``attempt`` trains a step an earlier attempt reached."""
        return any(a < attempt and s >= step for a, s in self.max_step.items())

    def latest(self) -> Point | None:
        return self.recent[-1] if self.recent else None

    # -- Redis ----------------------------------------------------------------------------

    def encode(self) -> str:
        """Compact JSON: ``{"w": width, "b": [[first,last,t0,t1,lo,hi,value,count,attempt]..],
        "r": [[step,ms,value,attempt]..], "a": [[attempt, max_step]..]}``."""
        return json.dumps({
            "w": self.width,
            "b": [[b.first, b.last, b.t0, b.t1, _r(b.lo), _r(b.hi), _r(b.value), b.count,
                   b.attempt] for b in self.buckets],
            "r": [[p.step, p.ms, _r(p.value), p.attempt] for p in self.recent],
            "a": sorted(self.max_step.items()),
        }, separators=(",", ":"))


class SeriesError(ValueError):
    """An encoded series that does not decode (too big, or a field of the wrong kind)."""


def decode_series(raw: bytes | str, recent: int = RECENT, buckets: int = BUCKETS) -> Series:
    """A series written by :meth:`Series.encode`, every field checked. Raises SeriesError."""
    if len(raw) > MAX_ENCODED:
        raise SeriesError(f"a series of {len(raw)} bytes (at most {MAX_ENCODED})")
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise SeriesError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise SeriesError("not an object")
    s = Series(recent, buckets)
    width, bs, rs, attempts = obj.get("w"), obj.get("b"), obj.get("r"), obj.get("a", [])
    if not (_int(width) and width >= 1 and isinstance(bs, list) and isinstance(rs, list)
            and isinstance(attempts, list)):
        raise SeriesError("missing or malformed fields")
    if len(bs) > buckets or len(rs) > recent or len(attempts) > MAX_ATTEMPTS:
        raise SeriesError("more points than a series holds")
    s.width = width
    for b in bs:
        if not (isinstance(b, list) and len(b) == 9 and all(_int(b[i]) for i in (0, 1, 2, 3, 7, 8))
                and all(_num(b[i]) for i in (4, 5, 6))):
            raise SeriesError("a malformed bucket")
        s.buckets.append(Bucket(b[0], b[1], b[2], b[3], _f(b[4]), _f(b[5]), _f(b[6]),
                                b[7], b[8]))
    for p in rs:
        if not (isinstance(p, list) and len(p) == 4 and _int(p[0]) and _int(p[1])
                and _num(p[2]) and _int(p[3])):
            raise SeriesError("a malformed point")
        s.recent.append(Point(p[0], p[1], _f(p[2]), p[3]))
    for a in attempts:
        if not (isinstance(a, list) and len(a) == 2 and _int(a[0]) and _int(a[1])):
            raise SeriesError("a malformed attempt")
        s.max_step[a[0]] = a[1]
    return s


def _int(v: object) -> bool:
    return type(v) is int and -(1 << 62) < v < (1 << 62)


def _num(v: object) -> bool:
    return type(v) in (int, float) or v is None


def _f(v: int | float | None) -> float:
    return math.nan if v is None else float(v)


def _r(v: float) -> float | None:
    """A value as stored: 7 significant digits; NaN and infinities as null (JSON has none)."""
    if not math.isfinite(v):
        return None
    return float(f"{v:.{_ROUND}g}")


def _min(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else min(a, b)


def _max(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)
