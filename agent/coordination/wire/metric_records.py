"""The records of a job's training metrics (``JobKeys.metrics``): points read from the
workers' output, one entry per node and interval.

Fields: ``v``, ``node``, ``attempt`` and ``ranks``, JSON::

    [[rank, [[step, age_ms, {"loss": 0.25, "lr": 0.001}], ...]], ...]

``age_ms`` is how long before the entry was written the point was printed: a reader's server
time for it is the entry id's milliseconds minus the age (no host clock is trusted). A value is
a number, or ``"nan"``, ``"inf"``, ``"-inf"`` (JSON has no such numbers). The latest state of
each rank (step, total, rate, latest values) rides in its resource sample instead
(``JobKeys.resources``, :func:`decode_latest`).

A worker's output is untrusted and so is every entry: :func:`decode_metrics_entry` checks every
field against the bounds below and returns None for an entry it cannot read.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from .protocol import MAX_RANK, PROTOCOL_VERSION, _loads, is_rank, stream_id_ms

#: The largest entry a reader decodes (a node's points of one interval).
MAX_METRICS_ENTRY_BYTES = 256 * 1024
#: The size a writer trims an entry to (oldest points first): the stream's memory is at most
#: ``METRICS_MAXLEN`` of these (5,000 x 16 KiB = 80 MiB a job), whatever the workers print. A
#: node's interval of ordinary training (8 ranks, a few points of a few metrics) is ~1 KiB.
MAX_METRICS_ENTRY_WRITE = 16 * 1024
#: Points of one rank in one entry, and names a rank may have.
MAX_POINTS = 256
MAX_NAMES = 32
MAX_NAME = 48
#: Trimming of the metrics stream: ~5 entries a node for a 1,024-node job.
METRICS_MAXLEN = 5_000
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]{0,47}")
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class MetricPoint(NamedTuple):
    rank: int
    step: int
    ms: int  # server time, ms
    values: dict[str, float]


class MetricsEntry(NamedTuple):
    node: str
    attempt: int
    points: list[MetricPoint]
    id: str = ""


def _value_out(v: float) -> float | str:
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def encode_values(values: Mapping[str, float]) -> dict[str, float | str]:
    """``{name: value}`` as written (entries, resource samples): a non-finite value as
    ``"nan"``, ``"inf"`` or ``"-inf"``, which :func:`decode_values` reads back."""
    return {k: _value_out(v) for k, v in values.items()}


def encode_metrics_entry(node: str, attempt: int,
                         ranks: Mapping[int, list[tuple[int, int, Mapping[str, float]]]]
                         ) -> dict[str, str]:
    """``ranks``: rank -> ``[(step, age_ms, values)]``. Beyond
    :data:`MAX_METRICS_ENTRY_WRITE` bytes, every rank's older half of its points is dropped
    until the entry fits (or each rank has one point left); beyond what a reader decodes,
    the last ranks are dropped."""
    body = [[rank, [[step, max(0, int(age)), {k: _value_out(v) for k, v in vals.items()}]
                    for step, age, vals in pts[-MAX_POINTS:]]]
            for rank, pts in ranks.items() if pts]
    text = json.dumps(body, separators=(",", ":"), allow_nan=False)
    while len(text) > MAX_METRICS_ENTRY_WRITE and any(len(r[1]) > 1 for r in body):
        for r in body:
            del r[1][: len(r[1]) // 2]  # keep the newest half
        text = json.dumps(body, separators=(",", ":"), allow_nan=False)
    while len(text) > MAX_METRICS_ENTRY_BYTES and body:  # hundreds of ranks of 32 long names
        body.pop()
        text = json.dumps(body, separators=(",", ":"), allow_nan=False)
    return {"v": str(PROTOCOL_VERSION), "node": node, "attempt": str(attempt), "ranks": text}


def _value_in(v: Any) -> float | None:
    if type(v) in (int, float):
        return float(v)
    if isinstance(v, str):
        return _NON_FINITE.get(v)
    return None


def decode_values(raw: Any) -> dict[str, float] | None:
    """A ``{name: value}`` map as written here: names and values checked, at most MAX_NAMES."""
    if not isinstance(raw, dict) or len(raw) > MAX_NAMES:
        return None
    out: dict[str, float] = {}
    for k, v in raw.items():
        if not (isinstance(k, str) and NAME_RE.fullmatch(k)):
            return None
        value = _value_in(v)
        if value is None:
            return None
        out[k] = value
    return out


def decode_metrics_entry(entry_id: str, fields: Mapping[Any, Any]) -> MetricsEntry | None:
    """An entry of the metrics stream, or None when any field is out of bounds."""
    def get(name: str) -> str | None:
        v = fields.get(name, fields.get(name.encode()))
        if isinstance(v, bytes):
            try:
                return v.decode()
            except UnicodeDecodeError:
                return None
        return v if isinstance(v, str) else None

    node, attempt, raw = get("node"), get("attempt"), get("ranks")
    if node is None or attempt is None or raw is None or len(raw) > MAX_METRICS_ENTRY_BYTES:
        return None
    if len(node) > MAX_NAME * 4 or not attempt.isdigit() or len(attempt) > 9:
        return None
    try:
        body = _loads(raw)
    except ValueError:
        return None
    if not isinstance(body, list) or len(body) > MAX_RANK:
        return None
    base = stream_id_ms(entry_id)
    points: list[MetricPoint] = []
    for r in body:
        if not (isinstance(r, list) and len(r) == 2 and is_rank(r[0]) and isinstance(r[1], list)
                and len(r[1]) <= MAX_POINTS):
            return None
        for p in r[1]:
            if not (isinstance(p, list) and len(p) == 3 and type(p[0]) is int and p[0] >= 0
                    and type(p[1]) is int and 0 <= p[1] < 1 << 40):
                return None
            values = decode_values(p[2])
            if values is None:
                return None
            points.append(MetricPoint(r[0], p[0], base - p[1], values))
    return MetricsEntry(node, int(attempt), points, entry_id)


class Latest(NamedTuple):
    """A rank's latest training state, from its resource sample."""

    step: int | None
    total: int | None
    rate: float | None
    values: dict[str, float]
    dropped: int


def decode_latest(sample: Mapping[str, Any]) -> Latest | None:
    """The metric fields of a decoded resource sample (``step``, ``total``, ``rate``, ``m``,
    ``mdrop``), checked; None when it has none or any is malformed."""
    if "step" not in sample and "m" not in sample:
        return None
    step, total, rate = sample.get("step"), sample.get("total"), sample.get("rate")
    dropped = sample.get("mdrop", 0)
    for v in (step, total):
        if v is not None and not (type(v) is int and 0 <= v < 1 << 53):
            return None
    if rate is not None and not (type(rate) in (int, float) and math.isfinite(rate) and rate >= 0):
        return None
    if not (type(dropped) is int and dropped >= 0):
        return None
    values = decode_values(sample.get("m", {}))
    if values is None:
        return None
    return Latest(step, total, float(rate) if rate is not None else None, values, dropped)
