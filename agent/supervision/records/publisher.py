"""An ordered, bounded, outage-proof publisher of stream entries.

The agent must never stall, fail or restart a worker because Redis is slow or gone (see the
invariants in DESIGN.md). So publishing is split in two:

* :meth:`StreamPublisher.publish` (and its siblings) only append to an in-memory queue. They
  are synchronous, never block and never raise because of Redis.
* One background task, the flusher, drains the queue with non-transactional pipelines of
  ``XADD key MAXLEN ~ n * ...``. It is woken by an :class:`asyncio.Event` when something is
  published (no tick while idle), and sends whatever accumulated while the previous pipeline
  was in flight as the next batch. When Redis is unreachable it keeps the batch, backs off
  (50 ms doubling to 1 s) and re-sends it, so records arrive in the order they were published.
  Redis at ``maxmemory`` refusing writes (OOM) is the same outage: the batch is re-sent from
  its first refused record on, and ``pressure.OOM`` reports the episode once for the process.

The queue is bounded (records and bytes). On overflow the oldest *droppable* records go
first; the gap they leave is reported by exactly one marker record per overflow episode,
built by the caller's ``make_drop_marker(count)`` and sent where the gap is. Non-droppable
records (lifecycle events) are only dropped when nothing droppable is left.

A record whose XADD reply was lost may be written twice when the batch is re-sent (Redis 7
has no idempotent XADD): records carry sequence numbers so readers can drop duplicates.

Everything here runs on one event loop; the methods are not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import redis
import redis.asyncio as aioredis

from elastic_agent.coordination.transport.connection import make_async_client, raise_if_cancelled, wait_set
from elastic_agent.coordination.transport.endpoints import Endpoint, redact
from elastic_agent.coordination.transport.pressure import OOM, is_oom

log = logging.getLogger(__name__)

#: A factory for the drop marker: ``count`` (sum of the dropped records' weights) ->
#: ``(stream_key, fields)``.
DropMarkerFactory = Callable[[int], tuple[str, dict[str, str]]]

ClientFactory = Callable[[], aioredis.Redis]

_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, socket.timeout, OSError)

# A record's fixed cost in the byte budget (the Python objects around its strings).
_RECORD_OVERHEAD = 200


class _OutOfMemory(Exception):
    """Redis refused part of a batch for lack of memory: ``_inflight`` holds what is left."""


class DeferredPayload(Protocol):
    """A record whose content is still growing while it waits in the queue.

    The log pipeline uses it to coalesce every line a worker prints while a pipeline is in
    flight into one entry (one XADD for many lines, without a timer).
    """

    def build(self) -> dict[str, str]:
        """The entry's fields. Called once, when the record is taken for sending."""
        ...

    @property
    def weight(self) -> int:
        """How much dropping this record loses, in the marker's unit (e.g. lines)."""
        ...


class Record:
    """One queued record. :meth:`StreamPublisher.publish_deferred` returns it as a handle.

    ``open`` is True while a deferred record may still grow: the owner appends to its
    payload and calls :meth:`StreamPublisher.grow` only while it is open, and starts a new
    record once it is not (taken for sending, dropped, or sealed by a later ``publish``).
    """

    __slots__ = (
        "args",
        "droppable",
        "due",
        "fields",
        "key",
        "marker",
        "maxlen",
        "open",
        "payload",
        "seq",
        "size",
        "weight",
    )

    def __init__(self, seq: int, key: str, maxlen: int, droppable: bool, size: int,
                 weight: int, fields: Mapping[str, str] | None = None,
                 payload: DeferredPayload | None = None,
                 args: tuple[Any, ...] | None = None) -> None:
        self.seq = seq
        self.key = key
        self.maxlen = maxlen
        self.droppable = droppable
        self.size = size
        self.weight = weight
        self.fields = fields
        self.payload = payload
        self.args = args
        self.open = payload is not None
        self.marker = False
        self.due = 0.0  # loop time until which it may wait for more content (0: none)

    def __repr__(self) -> str:
        return f"Record(seq={self.seq}, key={self.key!r})"


@dataclass(frozen=True)
class PublisherStats:
    """Counters of a publisher (records, except ``dropped_weight`` and ``buffered_bytes``).

    ``errors``: records Redis refused (not retried); ``retries``: failed send attempts.
    """

    published: int
    sent: int
    dropped: int
    dropped_weight: int
    errors: int
    retries: int
    buffered: int
    buffered_bytes: int
    connected: bool


class StreamPublisher:
    """Publishes stream entries to Redis in order, surviving outages with a bounded buffer.

    Args:
        target: an endpoint (``host:port`` or URL) or a zero-argument factory returning an
            asyncio client. From an endpoint the publisher builds a client that does not
            retry by itself (retries=0): the publisher owns the retry policy, so a dead
            server costs one failed round trip, not redis-py's whole backoff schedule.
        make_drop_marker: builds the record that reports an overflow; ``None``: no marker
            (the ``dropped`` counters still count).
        max_records / max_bytes: the buffer bound. Records waiting to be sent (not the batch
            in flight, itself at most ``max_batch`` records) never exceed either.
        max_batch: at most this many records per pipeline.
        max_batch_bytes: and about this many bytes (one record may be bigger): on a client
            shared with the agent's heartbeats, a pipeline is what they may have to wait for.
        close_client: close the client at ``close()``; False for a client the caller shares
            (the agent's writer, issue 21) and closes itself.

    Lifecycle: ``await start()``, any number of ``publish*`` calls (they may also come before
    ``start``), ``await close()``. ``flush()`` waits until everything published so far is sent.
    """

    def __init__(
        self,
        target: Endpoint | str | ClientFactory | None,
        *,
        make_drop_marker: DropMarkerFactory | None = None,
        max_records: int = 100_000,
        max_bytes: int = 64 * 1024 * 1024,
        max_batch: int = 1_000,
        max_batch_bytes: int = 256 * 1024,
        close_client: bool = True,
        retry_base: float = 0.05,
        retry_cap: float = 1.0,
    ) -> None:
        if max_records < 1 or max_bytes < 1 or max_batch < 1 or max_batch_bytes < 1:
            raise ValueError("max_records, max_bytes, max_batch and max_batch_bytes must be "
                             "positive")
        if callable(target):
            self._factory: ClientFactory = target
        else:
            endpoint = target

            def _default_factory() -> aioredis.Redis:
                return make_async_client(endpoint, retries=0, connect_timeout=2.0,
                                         socket_timeout=5.0)

            self._factory = _default_factory
        self._make_drop_marker = make_drop_marker
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.max_batch = max_batch
        self.max_batch_bytes = max_batch_bytes
        self._close_client = close_client
        self._retry_base = retry_base
        self._retry_cap = retry_cap

        # Two queues, each in publication order, merged by ``seq`` when sending: dropping
        # the oldest droppable record is then a popleft, never a search.
        self._drop_q: deque[Record] = deque()
        self._keep_q: deque[Record] = deque()
        self._open: set[Record] = set()  # deferred records that may still grow
        self._bytes = 0
        self._seq = 0
        self._inflight: list[Record] = []
        # Lingering deferred records (publish_deferred's linger): the earliest time one of
        # them is due, and whether a record that must not wait is queued.
        self._linger_due = math.inf
        self._urgent = False
        # The overflow episode in progress: weight dropped so far and where the gap ends.
        self._episode_weight = 0
        self._episode_records = 0
        self._marker_seq = 0

        self._published = 0
        self._sent = 0
        self._sent_weight = 0
        self._dropped = 0
        self._dropped_weight = 0
        self._errors = 0
        self._retries = 0
        self.connected = False

        self._wake = asyncio.Event()
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._client: aioredis.Redis | None = None
        self._closed = False
        self._last_error = ""
        self._overflow_warned = False  # the current overflow was reported (see _enforce_bounds)

    # -- publishing (synchronous, never blocks) -------------------------------------------

    def publish(self, stream_key: str, fields: Mapping[str, str], maxlen: int, *,
                droppable: bool = True, weight: int = 1) -> None:
        """Queue ``XADD stream_key MAXLEN ~ maxlen * fields``.

        Never blocks and never raises because Redis is down. ``droppable=False`` for records
        that must survive an overflow (lifecycle events). ``weight`` is what dropping the
        record loses, in the drop marker's unit. It seals every open deferred record, so a
        line published before this record is never sent after it.
        """
        self._seal_open()
        fields = dict(fields)  # the caller may reuse its dict; what was published is kept
        size = len(stream_key) + _RECORD_OVERHEAD
        for k, v in fields.items():
            size += len(k) + (len(v) if isinstance(v, (str, bytes)) else 16)
        self._enqueue(Record(self._next_seq(), stream_key, maxlen, droppable, size, weight,
                             fields=fields))

    def publish_deferred(self, stream_key: str, payload: DeferredPayload, maxlen: int, *,
                         size: int = 0, droppable: bool = True, linger: float = 0.0) -> Record:
        """Queue a record built later by ``payload.build()``; return its handle.

        While ``handle.open``, the owner may add to the payload and must report the added
        bytes with :meth:`grow`. Lines added that way join the record where it was first
        published: they may be sent ahead of records of other keys published in between
        (never behind them); ``publish`` seals open records to keep events in strict order.

        ``linger``: the record may wait up to this many seconds for more content before it
        is sent (fewer, fuller entries). Anything published without it, a :meth:`flush`, an
        outage's replay or a buffer a quarter full sends everything waiting at once.
        """
        rec = Record(self._next_seq(), stream_key, maxlen, droppable,
                     size + len(stream_key) + _RECORD_OVERHEAD, 0, payload=payload)
        if linger > 0:
            rec.due = time.monotonic() + linger
        self._open.add(rec)
        self._enqueue(rec)
        return rec

    def grow(self, handle: Record, nbytes: int) -> None:
        """Account ``nbytes`` added to an open deferred record (may trigger an overflow)."""
        if not handle.open:
            return
        handle.size += nbytes
        self._bytes += nbytes
        self._enforce_bounds()
        if not handle.due:  # a lingering record's flush is already timed
            self._wake.set()

    def publish_command(self, *args: Any, droppable: bool = False) -> None:
        """Queue an arbitrary command (e.g. ``SADD``) in order with the stream records."""
        self._seal_open()
        size = sum(len(str(a)) for a in args) + _RECORD_OVERHEAD
        self._enqueue(Record(self._next_seq(), str(args[0]) if args else "", 0, droppable,
                             size, 1, args=tuple(args)))

    # -- state ----------------------------------------------------------------------------

    @property
    def sent(self) -> int:
        """Records acknowledged by Redis (a re-sent duplicate counts once)."""
        return self._sent

    @property
    def sent_weight(self) -> int:
        """The weight of the droppable records acknowledged by Redis (worker log lines)."""
        return self._sent_weight

    @property
    def dropped(self) -> int:
        """Records dropped by overflows (their weight is ``stats().dropped_weight``)."""
        return self._dropped

    @property
    def buffered(self) -> int:
        """Records not yet acknowledged: queued, in flight, and a pending drop marker."""
        return (len(self._drop_q) + len(self._keep_q) + len(self._inflight)
                + (1 if self._episode_records else 0))

    @property
    def buffered_bytes(self) -> int:
        """Approximate bytes held by queued records (the bound ``max_bytes`` applies to)."""
        return self._bytes

    def stats(self) -> PublisherStats:
        return PublisherStats(self._published, self._sent, self._dropped, self._dropped_weight,
                              self._errors, self._retries, self.buffered, self._bytes,
                              self.connected)

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the flusher. Records published before are sent now."""
        if self._task is not None:
            return
        self._client = self._factory()
        self._task = asyncio.get_running_loop().create_task(self._run(),
                                                            name="stream-publisher")
        self._wake.set()

    async def flush(self) -> None:
        """Return once every record published so far is sent or dropped.

        Waits through an outage as long as it lasts: wrap it in ``asyncio.wait_for`` for a
        deadline. Raises RuntimeError if the publisher is not running.
        """
        target = self._seq
        if self._min_pending_seq() > target:
            return
        if self._task is None or self._task.done():
            raise RuntimeError("the publisher is not running: call start() first")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, fut))
        self._wake.set()
        await fut

    async def close(self, flush_timeout: float = 5.0) -> int:
        """Send what is buffered (for at most ``flush_timeout`` s), stop, close the client.

        Returns how many records were left unsent. Idempotent.
        """
        if self._closed:
            return self.buffered
        self._closed = True
        if self._task is not None and not self._task.done():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.flush(), flush_timeout)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            if self._close_client:
                with contextlib.suppress(Exception):
                    await self._client.aclose()
            self._client = None
        left = self.buffered
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(RuntimeError("the publisher was closed before the flush"))
        self._waiters.clear()
        if left:
            log.warning("stream publisher closed with %d records unsent", left)
        return left

    # -- queue internals ------------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq += 1
        self._published += 1
        return self._seq

    def _seal_open(self) -> None:
        if self._open:
            for rec in self._open:
                rec.open = False
            self._open.clear()

    def _enqueue(self, rec: Record) -> None:
        if rec.due:
            self._linger_due = min(self._linger_due, rec.due)
        else:
            self._urgent = True
        (self._drop_q if rec.droppable else self._keep_q).append(rec)
        self._bytes += rec.size
        self._enforce_bounds()
        self._wake.set()

    def _enforce_bounds(self) -> None:
        while (len(self._drop_q) + len(self._keep_q) > self.max_records
               or self._bytes > self.max_bytes):
            # The oldest droppable record goes first; a non-droppable one only when nothing
            # droppable is left, because memory stays bounded whatever the callers do.
            q = self._drop_q if self._drop_q else self._keep_q
            if not q:
                break
            rec = q.popleft()
            if not self._episode_records and not self._overflow_warned and not OOM.active:
                # Once per overflow, not per retry of its marker (an outage re-takes it);
                # out of memory, the OOM report gives the count when it ends.
                self._overflow_warned = True
                log.warning("publish buffer full (%d records, %d bytes): dropping the oldest",
                            len(self._drop_q) + len(self._keep_q) + 1, self._bytes)
            self._bytes -= rec.size
            weight = rec.payload.weight if rec.payload is not None else rec.weight
            rec.open = False
            self._open.discard(rec)
            self._dropped += 1
            self._dropped_weight += weight
            self._episode_weight += weight
            self._episode_records += 1
            # The gap ends at the newest record dropped: the marker goes there.
            self._marker_seq = max(self._marker_seq, rec.seq)
        self._notify_waiters()

    def _min_pending_seq(self) -> float:
        m = math.inf
        if self._inflight:
            m = self._inflight[0].seq
        if self._drop_q:
            m = min(m, self._drop_q[0].seq)
        if self._keep_q:
            m = min(m, self._keep_q[0].seq)
        if self._episode_records:
            m = min(m, self._marker_seq)
        return m

    def _has_pending(self) -> bool:
        return bool(self._drop_q or self._keep_q or self._episode_records)

    def _linger_s(self) -> float:
        """How long the records waiting may still wait for more content (0: send now)."""
        if (self._urgent or self._waiters or self._closed or self._episode_records
                or 4 * self._bytes >= self.max_bytes
                or 4 * (len(self._drop_q) + len(self._keep_q)) >= self.max_records):
            return 0.0
        return self._linger_due - time.monotonic()

    def _take(self) -> list[Record]:
        """Take up to ``max_batch`` records (and about ``max_batch_bytes``) in ``seq`` order,
        the drop marker in its place."""
        self._linger_due = math.inf
        self._urgent = False
        batch: list[Record] = []
        dq, kq = self._drop_q, self._keep_q
        size = 0
        while len(batch) < self.max_batch and size < self.max_batch_bytes:
            d = dq[0].seq if dq else math.inf
            k = kq[0].seq if kq else math.inf
            m = self._marker_seq if self._episode_records else math.inf
            if m < d and m < k:
                batch.append(self._take_marker())
                continue
            if d == math.inf and k == math.inf:
                break
            rec = dq.popleft() if d < k else kq.popleft()
            self._bytes -= rec.size
            size += rec.size
            if rec.payload is not None:
                rec.open = False
                self._open.discard(rec)
                try:
                    rec.weight = rec.payload.weight
                    rec.fields = rec.payload.build()
                except Exception:  # a broken payload must not stop the flusher
                    log.exception("building a deferred record for %s failed", rec.key)
                    self._errors += 1
                    rec.args = ()
                rec.payload = None
            batch.append(rec)
        if self._has_pending():  # more than max_batch: the rest goes next, without waiting
            self._urgent = True
        return batch

    def _take_marker(self) -> Record:
        weight = self._episode_weight
        seq = self._marker_seq
        self._episode_weight = 0
        self._episode_records = 0
        key, fields = ("", {})
        if self._make_drop_marker is not None:
            try:
                key, fields = self._make_drop_marker(weight)
            except Exception:  # a broken callback must not stop the flusher
                log.exception("make_drop_marker(%d) failed", weight)
        # A marker without a key (no factory) still occupies its place so flush() works.
        rec = Record(seq, key, 0, False, 0, weight, fields=fields if key else None,
                     args=None if key else ())
        rec.marker = True
        return rec

    def _requeue(self, batch: list[Record]) -> None:
        """Put a batch that could not be sent back at the head of the queue.

        So an outage keeps one overflow episode (the marker is rebuilt with the final count
        when it is finally sent) and the bound covers every waiting record, including the
        oldest, which an overflow drops first. It is re-sent without lingering.
        """
        self._urgent = True
        for rec in reversed(batch):
            if rec.marker:
                self._episode_weight += rec.weight
                self._episode_records += 1
                self._marker_seq = max(self._marker_seq, rec.seq)
                continue
            (self._drop_q if rec.droppable else self._keep_q).appendleft(rec)
            self._bytes += rec.size
        self._enforce_bounds()

    def _notify_waiters(self) -> None:
        if not self._waiters:
            return
        low = self._min_pending_seq()
        still = []
        for target, fut in self._waiters:
            if fut.done():
                continue
            if low > target:
                fut.set_result(None)
            else:
                still.append((target, fut))
        self._waiters = still

    # -- the flusher ----------------------------------------------------------------------

    async def _run(self) -> None:
        assert self._client is not None
        try:
            # Only so that `connected` tells the truth before there is anything to send.
            await self._client.ping()
            self.connected = True
        except (*_CONNECTION_ERRORS, redis.RedisError) as exc:
            self._on_send_error(exc)
        delay = self._retry_base
        while True:
            raise_if_cancelled()
            if not self._has_pending():
                # Cleared only when nothing is pending: a publish between the check and the
                # wait sets it again (single-threaded, no await in between).
                self._wake.clear()
                await self._wake.wait()
                continue
            linger = self._linger_s()
            if linger > 0:
                # Lines gather for up to the linger; a record that must not wait, a flush()
                # or close() sets the event and ends the wait early.
                self._wake.clear()
                await wait_set(self._wake, linger)
                continue
            self._inflight = self._take()
            try:
                await self._send(self._inflight)
            except asyncio.CancelledError:
                self._requeue(self._inflight)
                self._inflight = []
                raise
            except _OutOfMemory:
                # An outage like any other, reported once per episode by OOM (not per batch).
                self._retries += 1
                self._requeue(self._inflight)
                self._inflight = []
                await asyncio.sleep(delay)  # the backoff itself: nothing signals free memory
                delay = min(delay * 2, self._retry_cap)
                continue
            except (*_CONNECTION_ERRORS, redis.RedisError) as exc:
                self._retries += 1
                self._on_send_error(exc)
                self._requeue(self._inflight)
                self._inflight = []
                # A timed sleep is the backoff itself, not a poll: nothing signals that
                # Redis is back. Whatever is published meanwhile joins the next batch.
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._retry_cap)
                continue
            if not self.connected:
                log.info("stream publisher connected; %d records to send", self.buffered)
            self.connected = True
            self._last_error = ""
            delay = self._retry_base
            self._inflight = []
            if not self._episode_records:
                self._overflow_warned = False
            self._notify_waiters()

    def _on_send_error(self, exc: BaseException) -> None:
        msg = redact(str(exc)) or type(exc).__name__
        if self.connected or msg != self._last_error:
            log.warning("cannot publish to Redis (%s); buffering %d records", msg,
                        self.buffered)
        self.connected = False
        self._last_error = msg

    async def _send(self, batch: list[Record]) -> None:
        assert self._client is not None
        pipe = self._client.pipeline(transaction=False)
        sendable = []
        where = []  # the batch index of each sendable record
        for i, rec in enumerate(batch):
            if rec.fields is not None:
                pipe.xadd(rec.key, rec.fields, maxlen=rec.maxlen or None,
                          approximate=True)
            elif rec.args:
                pipe.execute_command(*rec.args)
            else:
                continue  # a marker with no factory: nothing to write
            sendable.append(rec)
            where.append(i)
        results = await pipe.execute(raise_on_error=False) if sendable else []
        refused = weight = 0
        oom_at = next((i for i, res in zip(where, results)
                       if isinstance(res, Exception) and is_oom(res)), None)
        if oom_at is not None:
            # Everything from the first refusal on is sent again, in order (records after it
            # that went through are written twice; readers drop them by seq).
            OOM.refused()
            results = results[:where.index(oom_at)]
            sendable = sendable[:len(results)]
        elif sendable:
            OOM.accepted()
        for rec, res in zip(sendable, results):
            if isinstance(res, Exception):
                if isinstance(res, _CONNECTION_ERRORS):
                    raise res
                # A refused command (wrong type, ACL, OOM) would fail again on every retry:
                # count it, report it, and go on with the rest.
                refused += 1
                log.warning("Redis refused a record for %s: %s", rec.key, redact(str(res)))
            elif rec.droppable:
                weight += rec.weight
        self._errors += refused
        self._sent += len(sendable) - refused
        self._sent_weight += weight
        if oom_at is not None:
            self._inflight = batch[oom_at:]
            raise _OutOfMemory
