"""Every stream an agent follows, read by one blocking XREAD on one connection (issue 21).

An agent waits on several streams at once: the job's commands, the rendezvous's notify and
joins streams, the events while it waits at the exit barrier, the store's notify stream, the
stack replies of a stall report. Each blocking XREAD holds a connection for as long as it
blocks, so one reader per stream cost an agent a connection per stream; 4,096 agents ran
Redis out of its default 10,000 clients. :class:`StreamMux` sends one ``XREAD BLOCK`` over all
of them, each stream at its own last-seen id (never ``$``: FIELD-NOTES), and hands what comes
to the readers that asked.

A consumer gets a :class:`MuxReader`, which answers ``xread(streams, count=, block=)`` as
Redis would (the same reply shape, the same ids) from what the multiplexer read, and sends
every other command to the agent's writer client. So code written against a blocking-reader
client (``commands.CommandReader``, ``stack_replies.request_stacks``, the store) works on it
unchanged. A reader's streams are followed while it reads them and for ``IDLE_S`` after.

Changing what is followed must not wait for the BLOCK to run out: a reader that asks for a
stream the XREAD in flight does not cover XADDs one entry to the agent's own wake stream
(``JobKeys.wake(node)``), which that XREAD also follows. Its cost per node: the key exists for
``WAKE_TTL_MS`` after the last wake (one entry, about 1 KB of Redis memory), and a wake is
two writes; wakes come a few times per round (a rendezvous, the exit barrier), never per
interval. Steady state the multiplexer sends one XREAD every ``BLOCK_MS`` (5 s) per node: 820
commands/s for 4,096 nodes, over a handful of keys each.

Every key followed must hash to the job's slot (``elastic:{JOB}:...``): one XREAD reads one
cluster node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Mapping
from typing import Any

import redis
import redis.asyncio as aioredis

from .cluster import is_cluster
from .connection import raise_if_cancelled, wait_set

log = logging.getLogger(__name__)

#: The multiplexer's BLOCK. Short enough that a key replaced under a blocked read (Redis 7.0
#: does not wake it) is noticed within seconds, as the command reader did on its own.
BLOCK_MS = 5_000
#: Entries per stream per XREAD.
COUNT = 1_000
#: A stream no reader asked for this long (after its last read returned) stops being read.
IDLE_S = 10.0
#: Entries a reader may hold unread per stream; older ones are read again from Redis if asked.
BUFFER = 10_000
#: The wake only has to reach the XREAD in flight (delivered as it is written); the TTL is
#: clean-up, short enough that a job's retention (which may be seconds) outlives no wake key.
WAKE_TTL_MS = 5_000

StreamId = tuple[int, int]
_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


def parse_id(value: Any) -> StreamId | None:
    """``b"1700000000000-3"`` -> ``(1700000000000, 3)``; ``"5"`` -> ``(5, 0)``; None if it is
    no explicit stream id."""
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
    ms, dash, seq = text.partition("-")
    try:
        parsed = (int(ms), int(seq) if dash else 0)
    except ValueError:
        return None
    return parsed if parsed[0] >= 0 and parsed[1] >= 0 else None


def format_id(value: StreamId) -> str:
    return f"{value[0]}-{value[1]}"


class _Sub:
    """One reader's interest in one stream."""

    __slots__ = ("buffer", "cursor", "floor", "key", "last_used", "reader", "refused", "waiting")

    def __init__(self, reader: MuxReader, key: str, after: StreamId, now: float) -> None:
        self.reader = reader
        self.key = key
        #: The newest id handed to this subscription (the XREAD goes on from the oldest).
        self.cursor = after
        #: Every entry after this id is in ``buffer`` or not read yet.
        self.floor = after
        self.buffer: deque[tuple[StreamId, Any]] = deque()
        self.refused: redis.ResponseError | None = None
        self.waiting = 0
        self.last_used = now


class StreamMux:
    """One blocking XREAD on ``client``'s connection for every stream the agent's readers
    follow; ``writer`` serves everything else (the ``$`` of a first read, wakes, a read
    from before what was buffered).

    ``client`` must block longer than ``block_ms`` (``make_async_client(blocking_ms=...)``);
    only the multiplexer's task uses it, so its pool holds one connection.
    """

    def __init__(self, client: aioredis.Redis, writer: aioredis.Redis, wake_key: str, *,
                 block_ms: int = BLOCK_MS, count: int = COUNT, idle_s: float = IDLE_S) -> None:
        self.client = client
        self.writer = writer
        self.wake_key = wake_key
        self.block_ms = block_ms
        self.count = count
        self.idle_s = idle_s
        #: Whether the last XREAD got an answer.
        self.connected = False
        self._subs: dict[str, set[_Sub]] = {}
        self._wake_cursor: StreamId = (0, 0)
        self._wake_off = False  # the wake key was refused (ACL, wrong type): BLOCK bounds it
        self._following: dict[str, StreamId] | None = None  # the XREAD in flight
        self._waking: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def reader(self) -> MuxReader:
        """A reader for one consumer (each consumer its own: they read at their own ids)."""
        return MuxReader(self)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="stream-mux")

    async def aclose(self) -> None:
        """Stop reading (the clients are the caller's to close)."""
        for task in (self._task, self._waking):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._task = None

    @property
    def followed(self) -> dict[str, str]:
        """The streams the next XREAD reads, each after its id (for tests and diagnosis)."""
        return {k: format_id(v) for k, v in self._streams().items()}

    # -- subscriptions --------------------------------------------------------------------
    def _add(self, sub: _Sub) -> None:
        self._subs.setdefault(sub.key, set()).add(sub)
        following = self._following
        if following is None:
            return  # not blocked: the next XREAD includes it
        covered = following.get(sub.key)
        if covered is None or covered > sub.cursor:
            self._wake()

    def _remove(self, sub: _Sub) -> None:
        # Nothing to wake for: the XREAD in flight reads a stream too many until it returns.
        subs = self._subs.get(sub.key)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.key]

    def _wake(self) -> None:
        if self._wake_off or (self._waking is not None and not self._waking.done()):
            return
        self._waking = asyncio.get_running_loop().create_task(self._send_wake(), name="mux-wake")

    async def _send_wake(self) -> None:
        try:
            pipe = self.writer.pipeline(transaction=False)
            pipe.xadd(self.wake_key, {"w": "1"}, maxlen=1, approximate=False)
            pipe.pexpire(self.wake_key, WAKE_TTL_MS)
            await pipe.execute()
        except redis.ResponseError as exc:
            log.warning("cannot write the wake stream %s (%s): readers that join a blocked read "
                        "wait up to %d ms", self.wake_key, exc, self.block_ms)
            self._wake_off = True
        except _CONNECTION_ERRORS as exc:  # the XREAD is failing too and goes round again
            log.debug("wake: %s", exc)

    def _streams(self) -> dict[str, StreamId]:
        streams: dict[str, StreamId] = {}
        for key, subs in self._subs.items():
            live = [s.cursor for s in subs if s.refused is None]
            if live:
                streams[key] = min(live)
        return streams

    def _expire(self, now: float) -> None:
        for key in list(self._subs):
            for sub in list(self._subs[key]):
                if sub.waiting == 0 and now - sub.last_used > self.idle_s:
                    self._remove(sub)
                    sub.reader._forget(sub)

    # -- the read -------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = 0.05
        while True:
            raise_if_cancelled()
            self._expire(loop.time())
            streams = self._streams()
            request = {k: format_id(v) for k, v in streams.items()}
            if not self._wake_off:
                request[self.wake_key] = format_id(self._wake_cursor)
            if not request:  # wake stream refused and nothing followed: nothing can block
                await asyncio.sleep(self.block_ms / 1000)
                continue
            self._following = streams
            try:
                reply = await self._xread(request)
            except _CONNECTION_ERRORS as exc:
                if self.connected:
                    log.info("stream reader lost Redis (%s); reading again when it is back", exc)
                self.connected = False
                await asyncio.sleep(backoff)  # backoff between reconnection attempts
                backoff = min(backoff * 2, 1.0)
                continue
            except (redis.exceptions.AskError, redis.exceptions.TryAgainError) as exc:
                log.debug("stream read redirected (%s); reading the slot map again", exc)
                await asyncio.sleep(backoff)  # the cluster moves the job's slot
                backoff = min(backoff * 2, 1.0)
                continue
            except redis.ResponseError as exc:
                self._following = None  # before the probes' awaits
                if not await self._find_refused(request, exc):
                    await asyncio.sleep(1.0)  # refused for no key in particular: try again
                continue
            except Exception as exc:  # this task carries every blocking read
                # (a cluster that is down, a reply redis-py cannot parse): never end it.
                log.warning("stream read failed (%s: %s); retrying", type(exc).__name__, exc)
                await asyncio.sleep(1.0)
                continue
            finally:
                self._following = None
            self.connected = True
            backoff = 0.05
            for key, entries in reply or ():
                self._deliver(key.decode() if isinstance(key, bytes) else str(key), entries)

    async def _xread(self, request: Mapping[str, str]) -> Any:
        if not is_cluster(self.client):
            return await self.client.xread(request, count=self.count, block=self.block_ms)
        # Every key is in the job's slot: name its node, or redis-py asks a random node
        # (COMMAND GETKEYS) before each XREAD, a round trip and a connection to every node.
        # A stale slot map fails this read (MOVED, or the node is gone) and redis-py reads
        # the map again before the next.
        await self.client.initialize()  # the slot map, once (and again after a failure)
        node = self.client.get_node_from_key(next(iter(request)))
        return await self.client.execute_command(
            "XREAD", "COUNT", self.count, "BLOCK", self.block_ms, "STREAMS", *request,
            *request.values(), target_nodes=node)

    def _deliver(self, key: str, entries: list[Any]) -> None:
        parsed = [(parse_id(entry[0]), entry) for entry in entries]
        if key == self.wake_key:
            ids = [p for p, _ in parsed if p is not None]
            if ids:
                self._wake_cursor = max(self._wake_cursor, *ids)
            return
        for sub in self._subs.get(key, ()):
            fresh = [(p, e) for p, e in parsed if p is not None and p > sub.cursor]
            if not fresh:
                continue
            sub.buffer.extend(fresh)
            sub.cursor = fresh[-1][0]
            while len(sub.buffer) > BUFFER:
                sub.floor = sub.buffer.popleft()[0]
            sub.reader._event.set()

    async def _find_refused(self, request: Mapping[str, str], exc: redis.ResponseError) -> bool:
        """One key refused the whole XREAD (a key that is no stream: WRONGTYPE; an ACL): find
        it, so the other streams are read on and only its readers get the error."""
        found = False
        for key, last in request.items():
            try:
                await self.writer.xread({key: last}, count=1)
            except redis.ResponseError as refusal:
                found = True
                if key == self.wake_key:
                    log.warning("the wake stream %s cannot be read (%s)", key, refusal)
                    self._wake_off = True
                for sub in self._subs.get(key, ()):
                    sub.refused = refusal
                    sub.reader._event.set()
            except _CONNECTION_ERRORS:
                return False
        if not found:
            log.debug("stream read refused: %s", exc)
        return found


class MuxReader:
    """A consumer's view of :class:`StreamMux`: a client whose ``xread`` is served by the
    multiplexer and whose other commands go to the agent's writer. It passes for that client
    (``isinstance``), so helpers that look at a client's kind see through it."""

    def __init__(self, mux: StreamMux) -> None:
        self._mux = mux
        self._subs: dict[str, _Sub] = {}
        self._event = asyncio.Event()

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self._mux.writer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mux.writer, name)

    def close(self) -> None:
        """Stop following this reader's streams (the clients stay open)."""
        for sub in self._subs.values():
            self._mux._remove(sub)
        self._subs.clear()

    async def aclose(self) -> None:
        self.close()

    def _forget(self, sub: _Sub) -> None:
        if self._subs.get(sub.key) is sub:
            del self._subs[sub.key]

    def _follow(self, key: str, after: StreamId) -> _Sub:
        sub = self._subs.get(key)
        if sub is None:
            sub = _Sub(self, key, after, asyncio.get_running_loop().time())
            self._subs[key] = sub
            self._mux._add(sub)
        return sub

    async def xread(self, streams: Mapping[Any, Any], count: int | None = None,
                    block: int | None = None, **_: Any) -> list[Any]:
        """XREAD as Redis answers it: ``[[key, [(id, fields), ...]], ...]``, ``[]`` when
        ``block`` ms passed with nothing (``0``: wait as long as it takes; ``None``: do not
        wait). ``$`` is the stream's newest entry when called."""
        writer = self._mux.writer
        wanted: dict[str, StreamId] = {}
        for raw_key, raw_last in streams.items():
            key = raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key)
            if raw_last in ("$", b"$"):
                newest = await writer.xrevrange(key, count=1)
                raw_last = newest[0][0] if newest else "0-0"
            last = parse_id(raw_last)
            if last is None:
                raise redis.ResponseError(f"Invalid stream ID specified as stream command "
                                          f"argument: {raw_last!r}")
            wanted[key] = last
        if block is None:
            return await writer.xread({k: format_id(v) for k, v in wanted.items()}, count=count)
        loop = asyncio.get_running_loop()
        deadline = None if block == 0 else loop.time() + block / 1000
        subs = [self._follow(k, v) for k, v in wanted.items()]
        for sub in subs:
            sub.waiting += 1
        try:
            while True:
                raise_if_cancelled()
                self._event.clear()
                reply = []
                for key, last in wanted.items():
                    entries = await self._take(key, last, count)
                    if entries:
                        reply.append([key.encode(), entries])
                if reply:
                    return reply
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    return []
                await wait_set(self._event, left)
        finally:
            now = loop.time()
            for sub in subs:
                sub.waiting -= 1
                sub.last_used = now

    async def _take(self, key: str, last: StreamId, count: int | None) -> list[Any]:
        sub = self._follow(key, last)
        if sub.refused is not None or last < sub.floor:
            # A stream the XREAD left out because Redis refused it (it raises here again if
            # it still is), or asked from before what this reader holds: read it directly.
            reply = await self._mux.writer.xread({key: format_id(last)}, count=count)
            if sub.refused is not None:
                self._mux._remove(sub)  # readable again: followed afresh from here
                self._forget(sub)
                self._follow(key, last)
            elif not reply:
                sub.floor = last  # nothing after ``last``: what comes is in the buffer
            return list(reply[0][1]) if reply else []
        while sub.buffer and sub.buffer[0][0] <= last:
            sub.buffer.popleft()
        if last > sub.floor:
            sub.floor = last
        if last > sub.cursor:
            sub.cursor = last  # the caller saw further (another reader): read on from there
        entries = [e for _, e in sub.buffer]
        return entries[:count] if count else entries
