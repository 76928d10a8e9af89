"""One node's training metrics on their way to Redis, riding with its resource samples.

Every resource-sampling interval (records/events.py ``ResourceSampler``, 2 s) the node's
:class:`~.metrics.MetricsTracker` is taken and, in the same pipeline (one round trip) as the
samples' HSET:

* each rank's latest state (``step``, ``total``, ``rate``, ``m`` its latest values, ``mdrop``
  names refused) is merged into that rank's resource sample: no command of its own;
* the points printed since the last interval go to Redis in ONE script call: one XADD of the
  node's entry (``metric_records.encode_metrics_entry``) to ``JobKeys.metrics`` (``MAXLEN ~``),
  and the ranks' latest finite values of at most :data:`HISTORY_METRICS` names into the
  round's ``JobKeys.metrics_latest`` sets (ZADD, member = rank, score = value; PEXPIRE);
  and the highest step its ranks named in the round, when it rose, into
  ``JobKeys.metrics_steps`` (a Lua max: what "no progress" compares, restart_patterns.py). A
  node with no new points and no new step sends nothing: printing no metrics costs nothing.

The whole run's curves: the agent that hosts global rank 0 keeps a
:class:`~elastic_agent.coordination.wire.metric_series.Series` of rank 0's values of those
names (its own points: no read), and of the job's min, median and max across ranks: its
script call also returns, for each name, the set's size and the members at index 0, n/2 and
n-1 (ZCARD and ZRANGE by index, O(log N)). Every :data:`HISTORY_EVERY_S` it writes the series
that changed into ``JobKeys.metrics_history`` (HSET, inside the same script call), and once
more when the agent exits. A later host of rank 0 (another round, another node) reads the hash
once (inside its first script call) and continues the curves.

``nan`` events: the first non-finite value of each rank in each attempt (the tracker reports
it at once), at most :data:`NAN_EVENTS_PER_INTERVAL` a node an interval; the rest wait for the
next intervals (at most one per local rank an attempt). With ``--on-nan stop``
:attr:`MetricsPublisher.stop` completes at the first one, and the agent ends the job.

Cost per node per interval, whatever the job's size N (N nodes, R ranks each):

* commands sent: +1 (the script call), and only in an interval with new points or a higher
  step (the host of rank 0 sends one HSET more when it exits, for the curves' last points);
* Redis's work in that call: one XADD of at most 64 KiB (the node's points), at most
  ``R x 8`` ZADD members (O(log(N R)) each), 8 PEXPIREs and an HGET (and HSET) of the round's
  step (once a round, an HGETALL of at most 81 fields); on the host of rank 0, 8 x (ZCARD +
  3 ZRANGE by index), O(log(N R)) each, and every 30 s one HSET of its series;
* Redis's memory: the stream is trimmed (``METRICS_MAXLEN`` entries of at most 64 KiB), each
  round's latest sets hold at most 8 x N R members and expire :data:`LATEST_TTL_MS` after their
  last write, the history hash holds at most 32 series of bounded size (``metric_series``).
* the agent's memory: the tracker's bounds (metrics.py), at most :data:`CARRY_ENTRIES` entries
  waiting through an outage, and on the host of rank 0 at most 32 series.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
import time
from collections.abc import Callable
from typing import Any

import redis

from elastic_agent.coordination.wire import metric_records
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.metric_series import (
    MAX_ENCODED,
    Series,
    SeriesError,
    decode_series,
)
from elastic_agent.coordination.wire.protocol import stream_id_ms

from .metrics import MetricsTracker, Point
from .restart_patterns import MAX_STEP, STEP_ROUNDS

log = logging.getLogger(__name__)

#: Names whose curves are kept for the whole run (rank 0's, and min/median/max across ranks).
HISTORY_METRICS = 8
#: Series kinds: rank 0's own values, and the job's spread across ranks.
KINDS = ("rank0", "min", "median", "max")
#: Seconds between two writes of the history hash.
HISTORY_EVERY_S = 30.0
#: A round's latest sets outlive their last write by this much (then a later round's take
#: over): a restart storm leaves few behind.
LATEST_TTL_MS = 30_000
NAN_EVENTS_PER_INTERVAL = 4
#: Entries kept while Redis is unreachable (or from the attempt before a restart).
CARRY_ENTRIES = 4
#: Fields read from the history hash when this agent starts hosting rank 0.
HISTORY_SCAN = 64
#: ZADD members passed to one call of the script's unpack() (Lua's stack is limited).
_ZADD_BATCH = 1000
#: Rounds whose highest step one call raises at most (the current one, and the carried).
_STEP_RAISES = 4

_SERIES_NAME = re.compile(r"(rank0|min|median|max)/(" + metric_records.NAME_RE.pattern + r")")

# KEYS[1] the metrics stream, KEYS[2] the history hash, KEYS[3] the rounds' highest steps,
# KEYS[4..] a round's latest sets, one per name. ARGV: maxlen, entries, ttl ms, spread (1/0:
# read each set's min, median, max), history read (1/0), history fields to write, rounds whose
# step rose; then 4 fields per entry (v, node, attempt, ranks), 2 per history field (name,
# series), 2 per round (round, its highest step here), and per latest set its member count c
# and c (score, member) pairs. Returns {entry ids, per set {card, min, median, max}, the
# history hash as {name, series, ...} (empty if it has more than HISTORY_SCAN fields; a field
# larger than MAX_ENCODED is left out)}. A round's step is raised, never lowered (a Lua max):
# a round's first writer folds the oldest round into 'base' once the hash holds more than
# STEP_ROUNDS fields, so the rounds kept are within the claimer's HMGET of the newest
# STEP_ROUNDS (at most 4 x STEP_ROUNDS fields are scanned: a hash grown by someone else is
# left as it is). The steps go last, through pcall: a key of the wrong type costs
# the steps, not the points.
_PUBLISH = """
local i = 8
local ids = {}
for e = 1, tonumber(ARGV[2]) do
  ids[e] = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'v', ARGV[i],
                      'node', ARGV[i + 1], 'attempt', ARGV[i + 2], 'ranks', ARGV[i + 3])
  i = i + 4
end
local history = {}
if ARGV[5] == '1' and redis.call('HLEN', KEYS[2]) <= HISTORY_SCAN then
  for _, f in ipairs(redis.call('HKEYS', KEYS[2])) do
    if redis.call('HSTRLEN', KEYS[2], f) <= MAX_ENCODED then
      history[#history + 1] = f
      history[#history + 1] = redis.call('HGET', KEYS[2], f)
    end
  end
end
local w = tonumber(ARGV[6])
if w > 0 then
  redis.call('HSET', KEYS[2], unpack(ARGV, i, i + 2 * w - 1))
  i = i + 2 * w
end
local steps_at = i
i = i + 2 * tonumber(ARGV[7])
local spread = {}
for k = 4, #KEYS do
  local c = tonumber(ARGV[i])
  i = i + 1
  local first = i
  while i < first + 2 * c do
    local last = math.min(i + 2 * ZADD_BATCH, first + 2 * c) - 1
    redis.call('ZADD', KEYS[k], unpack(ARGV, i, last))
    i = last + 1
  end
  if c > 0 then redis.call('PEXPIRE', KEYS[k], ARGV[3]) end
  if ARGV[4] == '1' then
    local n = redis.call('ZCARD', KEYS[k])
    if n > 0 then
      -- The median of an even count is the mean of the middle two, as the console's.
      local lo, hi = math.floor((n - 1) / 2), math.floor(n / 2)
      local m = redis.call('ZRANGE', KEYS[k], lo, hi, 'WITHSCORES')
      local med = m[2]
      if hi > lo then
        local a, b = tonumber(m[2]), tonumber(m[4])
        if a and b then med = tostring((a + b) / 2) end
      end
      spread[#spread + 1] = {n, redis.call('ZRANGE', KEYS[k], 0, 0, 'WITHSCORES')[2], med,
                             redis.call('ZRANGE', KEYS[k], -1, -1, 'WITHSCORES')[2]}
    else
      spread[#spread + 1] = {0}
    end
  end
end
for s = 0, tonumber(ARGV[7]) - 1 do
  local r, v = ARGV[steps_at + 2 * s], ARGV[steps_at + 2 * s + 1]
  local had = redis.pcall('HGET', KEYS[3], r)
  if type(had) == 'table' then break end
  local old = tonumber(had)
  if old == nil or tonumber(v) > old then
    redis.call('HSET', KEYS[3], r, v)
    local n, folds = had == false and redis.call('HLEN', KEYS[3]) or 0, 0
    while n > STEP_ROUNDS and n <= 4 * STEP_ROUNDS and folds < 2 do
      local all = redis.call('HGETALL', KEYS[3])
      local low, lowf, lowv = nil, nil, nil
      for j = 1, #all, 2 do
        local rr = tonumber(all[j])
        if all[j] ~= 'base' and rr ~= nil and (low == nil or rr < low) then
          low, lowf, lowv = rr, all[j], all[j + 1]
        end
      end
      if low == nil then break end
      local base = tonumber(redis.call('HGET', KEYS[3], 'base'))
      local lv = tonumber(lowv)
      if lv ~= nil and (base == nil or lv > base) then
        redis.call('HSET', KEYS[3], 'base', lowv)
      end
      redis.call('HDEL', KEYS[3], lowf)
      n, folds = redis.call('HLEN', KEYS[3]), folds + 1
    end
  end
end
return {ids, spread, history}
""".replace("HISTORY_SCAN", str(HISTORY_SCAN)).replace("MAX_ENCODED", str(MAX_ENCODED)).replace(
    "ZADD_BATCH", str(_ZADD_BATCH)).replace("STEP_ROUNDS", str(STEP_ROUNDS))
_PUBLISH_SHA = hashlib.sha1(_PUBLISH.encode()).hexdigest()


def priority(name: str) -> tuple[int, str]:
    """The order in which names get a curve: loss-like names first, then the usual training
    quantities, then the rest, alphabetically within each (every node orders alike)."""
    low = name.lower()
    if "loss" in low:
        return 0, low
    if any(w in low for w in ("lr", "learning_rate", "grad_norm", "acc", "ppl", "perplexity")):
        return 1, low
    return 2, low


def curve_names(names: Any) -> list[str]:
    """The at most :data:`HISTORY_METRICS` names of ``names`` that get curves."""
    return sorted(names, key=priority)[:HISTORY_METRICS]


class _Pending:
    """Points of one attempt not yet written: rank -> [(step, monotonic time, values)]."""

    __slots__ = ("attempt", "ranks")

    def __init__(self, attempt: int, ranks: dict[int, list[Point]]) -> None:
        self.attempt = attempt
        self.ranks = ranks


class MetricsPublisher:
    """The node's side (see the module docstring). Lives on the agent's event loop."""

    def __init__(self, tracker: MetricsTracker, job_id: str, node_id: str,
                 emit: Callable[..., Any], on_nan: str = "observe", host: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tracker = tracker
        self.keys = JobKeys(job_id)
        self.node_id = node_id
        self.host = host
        self.emit = emit
        self.on_nan = on_nan
        self._clock = clock
        tracker.on_nan = self._nan_seen
        self.round = -1
        self.holds_rank0 = False
        #: Completes with the first ``nan`` event's data under ``--on-nan stop``.
        self.stop: asyncio.Future[dict[str, Any]] | None = None
        self._nans: list[dict[str, Any]] = []  # nan events not yet emitted
        self._nan_budget = NAN_EVENTS_PER_INTERVAL
        self._carry: list[_Pending] = []
        #: Entries lost for good (an outage longer than CARRY_ENTRIES intervals).
        self.dropped_entries = 0
        self._script_loaded = False
        # What the ride in flight queued, for landed().
        self._sent: list[_Pending] = []
        self._sent_names: list[str] = []
        self._sent_spread = False
        self._sent_history_read = False
        self._sent_history_write = False
        self._sent_at = 0.0
        self._sent_history: list[str] = []
        self._rank0_step: int | None = None
        # The host of rank 0's curves: "kind/name" -> Series.
        self.series: dict[str, Series] = {}
        self._names: list[str] = []  # the names with curves, at most HISTORY_METRICS
        self._changed: set[str] = set()
        self._history_read = False  # read once when this agent starts hosting rank 0
        self._history_at = clock()
        #: Round -> the highest step this node's ranks named in it (the newest STEP_ROUNDS),
        #: what Redis acknowledged of those, and what the call in flight raises.
        self._highs: dict[int, int] = {}
        self._highs_sent: dict[int, int] = {}
        self._sent_highs: dict[int, int] = {}

    # -- attempts -------------------------------------------------------------------------

    def start_attempt(self, round_: int, holds_rank0: bool) -> None:
        """The workers of round ``round_`` are about to start (before their first byte).
        ``holds_rank0``: this node runs global rank 0 in it."""
        self._note_high()  # the ending attempt's highest step, before its ranks are cleared
        leftover = self.tracker.take()
        self._keep(_Pending(self.tracker.attempt, {r: pts for r, (_, pts) in leftover.items()
                                                   if pts}))
        self.tracker.start_attempt(round_)
        self.round = round_
        if holds_rank0 != self.holds_rank0:
            # Another node hosted rank 0 meanwhile, or will: its curves are in the hash.
            self.series.clear()
            self._names.clear()
            self._changed.clear()
            self._history_read = False
        self.holds_rank0 = holds_rank0
        self._rank0_step = None
        if self.on_nan == "stop":
            self.stop = asyncio.get_running_loop().create_future()

    def _note_high(self) -> None:
        attempt = self.tracker.attempt
        highs = [r.high for r in self.tracker.ranks.values() if r.high is not None]
        if attempt < 0 or not highs:
            return
        high = max(highs)
        if high > self._highs.get(attempt, -1):
            self._highs[attempt] = high
            while len(self._highs) > STEP_ROUNDS:
                oldest = min(self._highs)
                del self._highs[oldest]
                self._highs_sent.pop(oldest, None)

    def steps_reached(self) -> dict[int, int]:
        """Round -> the highest step this node's ranks named in it (counts of metric lines
        are no steps), the current round's up to now: the claimer of a round's restart
        adds these to what Redis has (pattern_watch.py), its own last steps included."""
        self._note_high()
        return dict(self._highs)

    def _keep(self, pending: _Pending) -> None:
        if not pending.ranks:
            return
        self._carry.append(pending)
        while len(self._carry) > CARRY_ENTRIES:
            self._carry.pop(0)
            self.dropped_entries += 1

    # -- nan ------------------------------------------------------------------------------

    def _nan_seen(self, rank: int, step: int, metric: str, value: float) -> None:
        data = {"rank": rank, "step": step, "metric": metric,
                "value": metric_records.encode_values({metric: value})[metric],
                "node": self.node_id, "host": self.host, "attempt": self.round,
                "policy": self.on_nan}
        if self.stop is not None and not self.stop.done():
            self.emit(EventType.NAN, **data)  # what ends the job is out first, budget or not
            self.stop.set_result(data)
            return
        self._nans.append(data)
        self._emit_nans()

    def _emit_nans(self) -> None:
        while self._nans and self._nan_budget > 0:
            self._nan_budget -= 1
            self.emit(EventType.NAN, **self._nans.pop(0))

    # -- each interval --------------------------------------------------------------------

    def ride(self, pipe: Any, final: bool = False) -> tuple[dict[int, dict[str, Any]], int]:
        """Queue this interval's writes on ``pipe`` (records/events.py ``SampleRider``)."""
        self._nan_budget = len(self._nans) if final else NAN_EVENTS_PER_INTERVAL
        self._emit_nans()
        self._note_high()
        rises = {r: h for r, h in self._highs.items()
                 if h > self._highs_sent.get(r, -1) and h < MAX_STEP}
        self._sent_highs = dict(sorted(rises.items())[-_STEP_RAISES:])
        taken = self.tracker.take()
        fields: dict[int, dict[str, Any]] = {}
        latest: dict[int, dict[str, float]] = {}
        for rank, (snap, _pts) in taken.items():
            if snap:
                values = snap.get("m")
                if isinstance(values, dict):
                    latest[rank] = values
                    snap = {**snap, "m": metric_records.encode_values(values)}
                fields[rank] = snap
            if rank == 0 and isinstance(snap.get("step"), int):
                self._rank0_step = snap["step"]
        self._keep(_Pending(self.tracker.attempt, {r: pts for r, (_, pts) in taken.items()
                                                   if pts}))
        if self.holds_rank0 and 0 in latest:
            for name in curve_names(latest[0]):
                if name not in self._names and len(self._names) < HISTORY_METRICS:
                    self._names.append(name)
        self._sent, self._carry = self._carry, []
        self._sent_spread = bool(self._sent) and self.holds_rank0 and bool(self._names)
        self._sent_names = []
        due = final or self._clock() - self._history_at >= HISTORY_EVERY_S
        # With this interval's points (no command of its own); when the agent exits, alone,
        # after the last points landed (their replies add to the curves: records/events.py
        # ResourceSampler.final rides again until nothing is left).
        write = self.holds_rank0 and due and bool(self._changed) and (
            not self._sent if final else bool(self._sent))
        self._sent_history_read = bool(self._sent) and self.holds_rank0 and not self._history_read
        self._sent_history_write = write
        history = {k: self.series[k].encode() for k in sorted(self._changed)} if write else {}
        if write:  # what changes from here on (this ride's own points) is for the next write
            self._history_at = self._clock()
            self._changed = set()
        self._sent_history = list(history)
        if self._sent or self._sent_highs:  # the history and the steps ride in the script call
            self._queue_publish(pipe, latest, history)
            return fields, 1
        if history:  # a final write with no points to go with it
            pipe.hset(self.keys.metrics_history, mapping=history)
            return fields, 1
        return fields, 0

    def _queue_publish(self, pipe: Any, latest: dict[int, dict[str, float]],
                       history: dict[str, str]) -> None:
        now = self._sent_at = self._clock()  # the ages are counted to here
        entries: list[str] = []
        for pending in self._sent:
            body = {rank: [(p.step, int((now - p.at) * 1000), p.values) for p in pts]
                    for rank, pts in pending.ranks.items()}
            f = metric_records.encode_metrics_entry(self.node_id, max(0, pending.attempt), body)
            entries += [f["v"], f["node"], f["attempt"], f["ranks"]]
        # The names this node's latest values go to: its own top names, and the host's.
        names = curve_names({n for vals in latest.values() for n in vals})
        if self._sent_spread:
            names = list(dict.fromkeys([*self._names, *names]))[:2 * HISTORY_METRICS]
        self._sent_names = names
        keys = [self.keys.metrics, self.keys.metrics_history, self.keys.metrics_steps]
        members: list[Any] = []
        for name in names:
            keys.append(self.keys.metrics_latest(name, self.round))
            pairs = [(v[name], rank) for rank, v in latest.items()
                     if name in v and math.isfinite(v[name])]
            members.append(len(pairs))
            for score, rank in pairs:
                members += [repr(score), str(rank)]
        args = [metric_records.METRICS_MAXLEN, len(self._sent), LATEST_TTL_MS,
                1 if self._sent_spread else 0, 1 if self._sent_history_read else 0,
                len(history), len(self._sent_highs), *entries,
                *(x for kv in history.items() for x in kv),
                *(str(x) for kv in self._sent_highs.items() for x in kv), *members]
        if self._script_loaded:
            pipe.evalsha(_PUBLISH_SHA, len(keys), *keys, *args)
        else:
            pipe.eval(_PUBLISH, len(keys), *keys, *args)

    def landed(self, replies: list[Any] | BaseException) -> None:
        """The replies of what :meth:`ride` queued, in order (records/events.py)."""
        sent, self._sent = self._sent, []
        highs, self._sent_highs = self._sent_highs, {}
        if isinstance(replies, BaseException):
            # Perhaps a restarted Redis on the next connection: its scripts are gone too.
            self._script_loaded = False
            if self._sent_history_write:
                self._changed.update(self._sent_history)
            for pending in sent:
                self._keep(pending)
            return
        reply = replies[0] if replies else None
        ok = isinstance(reply, list) and len(reply) == 3
        if highs and ok:  # else they go again with the next call
            self._script_loaded = True
            for r, h in highs.items():
                if h > self._highs_sent.get(r, -1):
                    self._highs_sent[r] = h
        elif highs and not sent and isinstance(reply, redis.ResponseError) and (
                "NOSCRIPT" in str(reply)):
            self._script_loaded = False  # Redis restarted: the text goes with the next call
        if self._sent_history_read and ok:  # first: the former host's curves, then ours
            self._history_in(reply[2])
        if sent:
            self._published(sent, reply)
        if self._sent_history_write and isinstance(reply, Exception):
            log.debug("metrics history not written: %s", reply)
            self._changed.update(self._sent_history)  # the next write carries them

    def _published(self, sent: list[_Pending], reply: Any) -> None:
        if isinstance(reply, redis.exceptions.NoScriptError) or (
                isinstance(reply, redis.ResponseError) and "NOSCRIPT" in str(reply)):
            self._script_loaded = False  # Redis restarted: the text goes with the next call
            for pending in sent:
                self._keep(pending)
            return
        if isinstance(reply, Exception) or not (isinstance(reply, list) and len(reply) == 3):
            log.debug("metrics not written: %r", reply)
            for pending in sent:
                self._keep(pending)
            return
        self._script_loaded = True
        ids, spread, _ = reply
        if not self.holds_rank0 or not isinstance(ids, list) or len(ids) != len(sent):
            return
        now = self._sent_at
        for pending, entry_id in zip(sent, ids):
            ms = _id_ms(entry_id)
            if ms is None or pending.attempt < 0:
                continue
            for p in pending.ranks.get(0, ()):
                at = ms - int((now - p.at) * 1000)
                for name, value in p.values.items():
                    if name in self._names:
                        self._add(f"rank0/{name}", p.step, at, value, pending.attempt)
        ms = _id_ms(ids[-1]) if ids else None
        if self._sent_spread and ms is not None and self._rank0_step is not None:
            self._spread_in(spread, ms, self._rank0_step)

    def _spread_in(self, spread: Any, ms: int, step: int) -> None:
        """min/median/max of each name across the job's ranks, at rank 0's latest step."""
        if not isinstance(spread, list):
            return
        for name, row in zip(self._sent_names, spread):
            if name not in self._names or not isinstance(row, list) or len(row) != 4:
                continue
            values = [_score(v) for v in row[1:]]
            if any(v is None for v in values):
                continue  # not a score Redis would return: skip this interval's point
            for kind, value in zip(("min", "median", "max"), values):
                key = f"{kind}/{name}"
                s = self.series.get(key)
                last = s.latest() if s is not None else None
                if last is not None and last.attempt == self.round and last.step >= step:
                    continue  # no step since the last point: nothing new to draw
                self._add(key, step, ms, value, self.round)  # type: ignore[arg-type]

    def _add(self, key: str, step: int, ms: int, value: float, attempt: int) -> None:
        s = self.series.get(key)
        if s is None:
            s = self.series[key] = Series()
        s.add(step, ms, value, attempt)
        self._changed.add(key)

    def _history_in(self, flat: Any) -> None:
        """The hash a former host of rank 0 wrote (``[name, series, ...]``): its curves
        continue here. Hostile input: only fields named as this module names them, each
        decoded with its bounds."""
        self._history_read = True
        if not isinstance(flat, list):
            return
        for field, value in zip(flat[::2], flat[1::2]):
            key = field.decode("utf-8", "replace") if isinstance(field, bytes) else str(field)
            m = _SERIES_NAME.fullmatch(key)
            if m is None or key in self.series:
                continue
            name = m.group(2)
            if name not in self._names:
                if len(self._names) >= HISTORY_METRICS:
                    continue
                self._names.append(name)
            try:
                self.series[key] = decode_series(value)
            except SeriesError as exc:
                log.warning("metrics history %s is unreadable (%s): its curve starts over",
                            key[:80], exc)


def _id_ms(entry_id: Any) -> int | None:
    text = entry_id.decode("ascii", "replace") if isinstance(entry_id, bytes) else entry_id
    if not isinstance(text, str):
        return None
    try:
        return stream_id_ms(text)
    except (ValueError, TypeError):
        return None


def _score(v: Any) -> float | None:
    try:
        f = float(v.decode() if isinstance(v, bytes) else v)
    except (TypeError, ValueError, UnicodeDecodeError):
        return None
    return f if math.isfinite(f) else None

