"""Following a job's streams: the reading half of :class:`~elastic_console.job.client.JobClient`.

One blocking ``XREAD`` (one per hash slot on a cluster) names the job's event stream and every
log stream with the last id seen of each; what it returns is decoded and handed over in lists,
the cursor moved past each list before it is yielded. :class:`Following` is a mixin of
JobClient (it shares its connections, its cursor and its bookkeeping of unreadable keys); the
reading contract is in the client's module docstring. asyncio; no Textual.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.crc import key_slot

from elastic_agent.coordination.transport.connection import raise_if_cancelled
from elastic_agent.coordination.wire.event_records import Event, EventType, decode_event
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.log_records import LogBatch, LogEntryDecoder
from elastic_agent.coordination.wire.metric_records import MetricsEntry, decode_metrics_entry

from .state import ConnectionChange, Skipped

__all__ = ["BLOCK_MS", "LOG_STREAM_NAMES_MAX", "READ_COUNT", "Following", "Record"]

#: What :meth:`Following.follow` yields (MetricsEntry: only once the metrics stream's cursor
#: was set, by ``JobClient.metrics_recent``).
Record = Event | LogBatch | MetricsEntry | ConnectionChange

BLOCK_MS = 2_000  # one XREAD BLOCK; also bounds how late a Ctrl-C or a new stream is seen
STREAMS_REFRESH_S = 3.0  # re-read the set of log streams at least this often
READ_COUNT = 250  # entries per stream per XREAD: bounds one reply's size (and its memory)
#: Entries decoded per list follow_many yields: a node's entry holds up to ~30 batches (~3 us
#: each to decode), so a list is a couple of milliseconds of work for its consumer.
DECODE_SLICE = 32
#: Metrics entries decoded per list: a node's entry holds up to 256 points a rank (~1 ms to
#: decode and as much to fold for 16 ranks' two steps), so a list of DECODE_SLICE of them
#: held the keys for tens of milliseconds.
METRICS_SLICE = 2
#: At most one XREAD per this interval. Each one names every log stream (130 arguments for
#: 64 nodes, ~0.2 ms just to encode) and wakes as soon as any stream has an entry, so a busy
#: job was read in hundreds of tiny replies a second; waiting this long lets entries gather.
READ_INTERVAL_S = 0.02
#: ...and at least this long per stream it names, up to READ_INTERVAL_MAX_S (read_interval).
#: A read costs ~2.5 us per stream here (its arguments, the cursor, the reply's keys) and
#: about as much in Redis, whether a stream has entries or not: at 4,096 streams, 50 reads a
#: second were half a core for nothing; one every 0.1 s is ~10% and still ahead of the 10 Hz
#: refresh.
READ_INTERVAL_PER_STREAM_S = 25e-6
READ_INTERVAL_MAX_S = 0.1
#: Entries one read may bring back over all its streams (read_count): COUNT per stream is this
#: share, between READ_COUNT_MIN and READ_COUNT. A console that fell behind 4,096 streams
#: asked for 250 of each: replies of up to a million entries (hundreds of MiB at once, the
#: process's peak RSS). 8 per stream every 0.1 s is still 4x what an agent writes
#: (``LOG_LINGER``). The events stream gets its own reads when one read's share was not enough.
READ_BUDGET = 32_768
READ_COUNT_MIN = 8
BACKOFF_START, BACKOFF_MAX = 0.05, 1.0
#: Names read from a job's set of log streams, and log streams followed at once. A job has one
#: stream per node, and a node's id is new each time its agent starts: 4,096 nodes twice over
#: (this start of each and one before) fit. Anyone who may write the job can add names
#: (docs/SECURITY.md): 200,000 forged ones took ``logs`` 10 s and ``logs --attempt`` 20 s
#: when the set was read whole. Past the bound the last round's nodes' streams are read
#: first, the rest left out (``JobClient.streams_note`` says how many), and of those read,
#: names of no key cost no stream read.
LOG_STREAM_NAMES_MAX = 8_192
#: SSCAN's COUNT when reading that set: a 4,096-node job's names in a few round trips.
STREAM_NAMES_PAGE = 2_048

_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, socket.timeout, OSError)
# Events after which a new node's log stream may exist (its SADD precedes workers_started
# on the same ordered publisher); the timed refresh catches the rest.
_NEW_STREAM_EVENTS = frozenset({EventType.NODE_JOINED, EventType.RENDEZVOUS_COMPLETE,
                                EventType.WORKERS_STARTED})


def read_interval(streams: int) -> float:
    """Seconds from one XREAD to the next over ``streams`` streams (see READ_INTERVAL_S)."""
    return min(READ_INTERVAL_MAX_S, max(READ_INTERVAL_S, streams * READ_INTERVAL_PER_STREAM_S))


def read_count(streams: int) -> int:
    """The COUNT of one XREAD over ``streams`` streams (see READ_BUDGET)."""
    return max(READ_COUNT_MIN, min(READ_COUNT, READ_BUDGET // max(1, streams)))


class Following:
    """The follow half of JobClient (a mixin: JobClient sets every attribute below and gives
    ``_explain``, ``_read_history``, ``_stream_members``, ``_log_stream_names`` and
    ``_refused``)."""

    keys: JobKeys
    skipped: int
    _client: aioredis.Redis
    _reader: aioredis.Redis
    _last_ids: dict[str, str]
    _bad_keys: set[str]
    _reported_skips: int
    _refresh_due: bool
    _cluster: bool
    _reads: dict[int, asyncio.Future[Any]]
    _slots: dict[str, int]
    streams_note: str | None
    _parked: dict[str, str]
    #: The nodes whose metrics entries are decoded (None: every node's). A big job's console
    #: names rank 0's and the chosen ranks' nodes: decoding every node's entry at 32,768
    #: ranks (2,048 entries a second) would take more than a core.
    metrics_nodes: set[str] | None

    async def _start_at_present(self) -> None:
        """Cursor at the newest entry of every stream (explicit ids, never ``$``)."""
        await self._read_history(max_events=1, max_log_entries_per_stream=0)

    async def _refresh_streams(self) -> None:
        if self._bad_keys:
            await self._recheck_bad_keys()
        names = self._log_stream_names(await self._stream_members())
        if self.streams_note is not None:
            self._let_go(set(names))
        for s in names:
            # A stream found now may already hold entries written before we saw it.
            self._last_ids.setdefault(s, self._parked.pop(s, "0-0"))

    def _let_go(self, keep: set[str]) -> None:
        """The set of log streams held more names than are read: follow only ``keep`` (the
        last round's nodes' streams first), so the cursor stays within the bound however the
        set changes. A stream let go keeps its cursor, parked (as many as the bound), so
        following it again resumes where it was instead of printing it all again."""
        kept = (self.keys.events, self.keys.metrics)
        for key in [x for x in self._last_ids if x not in kept and x not in keep]:
            self._parked[key] = self._last_ids.pop(key)
            self._slots.pop(key, None)
        while len(self._parked) > LOG_STREAM_NAMES_MAX:
            del self._parked[next(iter(self._parked))]  # the longest parked

    async def _recheck_bad_keys(self) -> None:
        # A repaired key (deleted, or a stream again) is read again; a foreign name stays out.
        candidates = [k for k in self._bad_keys
                      if k in (self.keys.events, self.keys.metrics) or self.keys.is_log_stream(k)]
        if not candidates:
            return
        pipe = self._client.pipeline(transaction=False)
        for key in candidates:
            pipe.type(key)
        for key, kind in zip(candidates, await pipe.execute()):
            if _s(kind) in ("stream", "none"):
                self._bad_keys.discard(key)

    async def _drop_wrong_types(self, keys: list[str]) -> None:
        """After a WRONGTYPE from one XREAD over many keys: find the keys that are not streams
        and leave them out, so the others are read again at once."""
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.type(key)
        found = False
        for key, kind in zip(keys, await pipe.execute()):
            if _s(kind) not in ("stream", "none"):
                found = True
                self._refused(key, redis.ResponseError("WRONGTYPE not a stream"))
        if not found:  # the key changed type between the two calls: try again shortly
            await asyncio.sleep(READ_INTERVAL_S)

    async def follow(self, logs: bool = True) -> AsyncIterator[Record]:
        """Yield the job's events and log batches as they are written, forever.

        Starts after :meth:`history` (or, without it, at the present). One ``XREAD BLOCK``
        covers the event stream and every log stream; the set of log streams is re-read
        after events that announce a node and at least every few seconds. ``logs=False``
        reads the event stream only.

        Reads at most every ``READ_INTERVAL_S``: a record is yielded at most that much later
        than an XREAD per entry would.

        On a Redis outage yields ``ConnectionChange(False, why)`` once, reconnects with
        backoff (50 ms doubling to 1 s), yields ``ConnectionChange(True, "")`` and continues
        from the same ids. A refusal that is not an outage (e.g. ``NOPERM``) raises
        :class:`RedisUnavailableError`.

        The cursor moves one entry at a time: a consumer that stops after an entry's records
        resumes right after it.
        """
        async for piece in self._pieces(logs, 1):
            for rec in piece:
                yield rec

    async def follow_many(self, logs: bool = True) -> AsyncIterator[list[Record]]:
        """:meth:`follow`, many records per list: the same records in the same order, at a
        fraction of the cost per log batch (:class:`LogEntryDecoder`; the console's reader
        takes tens of thousands a second). A list holds at most ``DECODE_SLICE`` entries'
        records, so a consumer gets control back (and can let keys through) every few
        milliseconds, however big a read was; the cursor moves a list at a time."""
        async for piece in self._pieces(logs, DECODE_SLICE):
            yield piece

    async def _pieces(self, logs: bool, size: int) -> AsyncIterator[list[Record]]:
        """The records of :meth:`_replies`, decoded ``size`` entries at a time, the cursor
        moved past those entries before their records are yielded; a :class:`Skipped` alone
        after a read that skipped any, a ConnectionChange alone.

        The log entries of several streams go into one list: at 4,096 nodes a read brings
        one or two entries of each of hundreds of streams, and a list (and a decode, and a
        fold by the consumer) per stream cost more than the entries in it."""
        k = self.keys
        metrics_key = k.metrics
        decoder = LogEntryDecoder()
        last_ids = self._last_ids
        async for reply in self._replies(logs):
            if isinstance(reply, ConnectionChange):
                yield [reply]
                continue
            skipped_before = self.skipped
            chunk: list[Any] = []  # log entries to decode together, of one or more streams
            ends: dict[str, Any] = {}  # stream -> the id of its last entry in chunk
            for key, entries in reply:
                stream = _s(key)
                if stream == k.events:
                    if chunk:  # the order of the reply is kept
                        out = self._decode_chunk(decoder, chunk, ends)
                        chunk, ends = [], {}
                        if out:
                            yield out
                    for i in range(0, len(entries), size):
                        part = entries[i:i + size]
                        events = [ev for ev in (self._event(_s(e[0]), e[1]) for e in part)
                                  if ev is not None]
                        # Advance before yielding: a consumer that stops here resumes after it.
                        last_ids[stream] = _s(part[-1][0])
                        if events:
                            yield events  # type: ignore[misc]
                    continue
                if stream == metrics_key:
                    if chunk:  # the order of the reply is kept
                        out = self._decode_chunk(decoder, chunk, ends)
                        chunk, ends = [], {}
                        if out:
                            yield out
                    step = min(size, METRICS_SLICE)
                    for i in range(0, len(entries), step):
                        part = entries[i:i + step]
                        points = [m for m in (self._metrics(_s(e[0]), e[1]) for e in part)
                                  if m is not None]
                        last_ids[stream] = _s(part[-1][0])
                        if points:
                            yield points  # type: ignore[misc]
                    continue
                i, n = 0, len(entries)
                while i < n:
                    room = size - len(chunk)
                    part = entries if i == 0 and n <= room else entries[i:i + room]
                    chunk += part
                    ends[stream] = part[-1][0]
                    i += len(part)
                    if len(chunk) >= size:
                        out = self._decode_chunk(decoder, chunk, ends)
                        chunk, ends = [], {}
                        if out:
                            yield out
            if chunk:
                out = self._decode_chunk(decoder, chunk, ends)
                if out:
                    yield out
            if self.skipped != skipped_before or self._reported_skips != self.skipped:
                self._reported_skips = self.skipped
                yield [Skipped(self.skipped)]

    def _decode_chunk(self, decoder: LogEntryDecoder, chunk: list[Any],
                      ends: dict[str, Any]) -> list[Record]:
        """Decode log entries and move the cursor of each stream past its last one."""
        batches, refused = decoder.decode(chunk)
        self.skipped += refused
        last_ids = self._last_ids
        for stream, entry_id in ends.items():
            last_ids[stream] = _s(entry_id)
        return batches  # type: ignore[return-value]

    def _event(self, eid: str, fields: Any) -> Event | None:
        """A followed event, or None (counted as skipped); one that may announce a new log
        stream has the next read refresh the set of streams first."""
        ev = decode_event(eid, _entry_fields(fields))
        if ev is None:
            self.skipped += 1
            return None
        if ev.type in _NEW_STREAM_EVENTS:
            self._refresh_due = True
        return ev

    def _metrics(self, eid: str, fields: Any) -> MetricsEntry | None:
        """A followed metrics entry, or None: one of a node not in ``metrics_nodes`` (left
        undecoded), or a malformed one (counted as skipped)."""
        f = _entry_fields(fields)
        if not self._metrics_wanted(f):
            return None
        entry = decode_metrics_entry(eid, f)
        if entry is None:
            self.skipped += 1
        return entry

    def _metrics_wanted(self, fields: Any) -> bool:
        wanted = self.metrics_nodes
        if wanted is None:
            return True
        node = fields.get(b"node", fields.get("node"))
        return (node.decode("utf-8", "replace") if isinstance(node, bytes) else node) in wanted

    async def _replies(self, logs: bool) -> AsyncIterator[Any]:
        """The raw XREAD replies of :meth:`follow` (non-empty lists of ``[key, entries]``),
        and a :class:`ConnectionChange` when Redis goes away or comes back. Reads after the
        cursor, which the caller moves."""
        try:
            async for reply in self._replies_of(logs):
                yield reply
        finally:
            self._cancel_reads()

    async def _replies_of(self, logs: bool) -> AsyncIterator[Any]:
        k = self.keys
        connected = True
        backoff = BACKOFF_START
        next_refresh = 0.0
        last_read = 0.0
        events_behind = False  # the last read brought as many events as it asked for
        while True:
            raise_if_cancelled()
            reply: Any = None
            failure: BaseException | None = None
            try:
                if not connected:
                    await self._reader.ping()
            except _CONNECTION_ERRORS as exc:
                failure = exc
            except redis.RedisError as exc:
                raise self._explain(exc) from None
            else:
                if not connected:
                    connected, backoff, next_refresh = True, BACKOFF_START, 0.0
                    yield ConnectionChange(True, "")
                ids: dict[str, str] = {}
                try:
                    if k.events not in self._last_ids and k.events not in self._bad_keys:
                        await self._start_at_present()
                    if logs and (self._refresh_due or time.monotonic() >= next_refresh):
                        self._refresh_due = False
                        await self._refresh_streams()
                        next_refresh = time.monotonic() + STREAMS_REFRESH_S
                    events_last = self._last_ids.get(k.events)
                    if events_behind and events_last is not None:
                        # A burst of events (a restart of 32,768 ranks is as many): they are
                        # read alone, READ_COUNT at a time and at once, not a share per read.
                        ids = {k.events: events_last}
                        count = READ_COUNT
                        reply = await self._reader.xread(ids, count=count)
                    else:
                        ids = {key: last for key, last in self._last_ids.items()
                               if key not in self._bad_keys and (logs or key == k.events)}
                        wait = last_read + read_interval(len(ids)) - time.monotonic()
                        if wait > 0:
                            await asyncio.sleep(wait)  # let entries gather (read_interval)
                        last_read = time.monotonic()
                        count = read_count(len(ids))
                        if ids:
                            reply = await self._xread(ids, count)
                    events_behind = False
                    if not ids:  # every key refused: wait for a refresh to find a readable one
                        await asyncio.sleep(STREAMS_REFRESH_S)
                        next_refresh = 0.0
                except _CONNECTION_ERRORS as exc:
                    failure = exc
                except redis.ResponseError as exc:
                    if not _is_wrongtype(exc):  # NOPERM...: waiting will not help
                        raise self._explain(exc) from None
                    await self._drop_wrong_types(list(ids))
                except redis.RedisError as exc:
                    raise self._explain(exc) from None
            if failure is not None:
                self._cancel_reads()
                if connected:
                    connected = False
                    yield ConnectionChange(False, str(self._explain(failure)))
                await asyncio.sleep(backoff)  # reconnection backoff
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            if reply:
                events_behind = any(len(entries) >= count and _s(key) == k.events
                                    for key, entries in reply)
                yield reply

    async def _xread(self, ids: dict[str, str], count: int = READ_COUNT) -> list[Any]:
        """One ``XREAD BLOCK`` over ``ids``; on a cluster, one per hash slot the keys are in
        (Redis refuses a multi-key command across slots, even on one node): the job's slot
        (events, old-shape log streams) and each tag of its log streams (at most
        ``LOG_SHARDS`` + 1 reads, each on its own connection to the slot's master). Returns
        when any of them has entries; the others stay pending, with their ids, for the next
        call (no other read names their keys, so their cursors cannot move meanwhile)."""
        if not self._cluster:
            reply = await self._reader.xread(ids, count=count, block=BLOCK_MS)
            return reply or []
        # Concurrent first commands of an uninitialized cluster client raced its set-up
        # (a connection closed under another's handshake): set it up before they start.
        await self._reader.initialize()
        groups: dict[int, dict[str, str]] = {}
        slots = self._slots
        for key, last in ids.items():
            slot = slots.get(key)
            if slot is None:  # a CRC16 per key and read adds up at 4,096 streams and 50 Hz
                slot = slots[key] = key_slot(key.encode())
            groups.setdefault(slot, {})[key] = last
        for slot, group in groups.items():
            if slot not in self._reads:
                self._reads[slot] = asyncio.ensure_future(
                    self._reader.xread(group, count=count, block=BLOCK_MS))
        done, _ = await asyncio.wait(self._reads.values(), return_when=asyncio.FIRST_COMPLETED)
        out: list[Any] = []
        failure: BaseException | None = None
        for slot, task in list(self._reads.items()):
            if task in done:
                del self._reads[slot]
                if task.exception() is not None:
                    failure = failure or task.exception()
                else:
                    out += task.result() or []
        if failure is not None:
            self._cancel_reads()  # an outage: every read starts again from its ids
            raise failure
        return out

    def _cancel_reads(self) -> None:
        """Abandon the pending per-slot reads of :meth:`_xread` (their entries were not
        yielded: the cursors did not move, the next read asks for them again)."""
        for task in self._reads.values():
            task.cancel()
        self._reads.clear()


# -- helpers ------------------------------------------------------------------------------

def _s(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _entry_fields(fields: Any) -> Any:
    """An entry's fields as a mapping, from the flat list a raw XREAD reply holds."""
    if isinstance(fields, list):
        it = iter(fields)
        return dict(zip(it, it))
    return fields


def _is_wrongtype(exc: BaseException) -> bool:
    return isinstance(exc, redis.ResponseError) and str(exc).startswith("WRONGTYPE")
