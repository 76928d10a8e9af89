"""Worker output to Redis: each worker stream cut into lines, the node's lines batched.

Lines go to the node's log stream in Redis through a
:class:`~elastic_agent.supervision.records.publisher.StreamPublisher`: one
:class:`~elastic_agent.coordination.wire.log_records.LogBatch` per worker stream and flush, the
batches of all the node's workers in one entry (:class:`NodeBatcher`), which waits up to
:data:`LOG_LINGER` for more lines (fewer, fuller XADDs; an event sends it at once).

Redis gets what a terminal shows, not the bytes: a line redrawn with ``\\r`` (a progress bar)
is shipped as its last frame (``\\r\\n`` is an ordinary line end). While a line is unfinished
(redrawn, or waiting for its newline), its latest frame is shipped at most every
:data:`LIVE_INTERVAL` seconds (the first :data:`LIVE_DELAY` after it started) as the stream's
*live block*, the last line of an entry; the line's next state (newer frame or final) is the
first line of the stream's next entry, which replaces it. Output that moves the cursor is
rendered by a terminal emulator (screen.py) and handed here as finished lines and a live block
of several rows, replaced the same way (:meth:`Shipper.rendered`). A bar redrawn 1,000 times
a second costs at most ``1 / LIVE_INTERVAL`` entries a second; one finished within
``LIVE_DELAY`` costs nothing but its final line. Frames are whole writes: the text after the
last ``\\r`` of what was read is taken as the frame, so a frame split across reads (a writer
that does not flush per frame) can show half-drawn for one update. A bar's frame followed by
a write that starts with neither ``\\r`` nor ``\\n`` (a log line written under a tqdm bar) is
ended first: two lines, not one glued.

Every batch carries the ages of the first bytes of its first line and of its live block,
taken when the entry is built (just before its XADD): readers stamp a line with the time it
started, not the time it was finished (LogBatch).

A line longer than ``max_line_bytes`` is shipped as its head, cut on a UTF-8 boundary, and a
marker; only that head is ever kept, whatever a worker prints without a newline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from elastic_agent.coordination.wire import event_records, log_records
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.log_records import LogBatch
from elastic_agent.supervision.records.log_config import LogConfig
from elastic_agent.supervision.records.publisher import DropMarkerFactory, Record, StreamPublisher

#: A line redrawn with ``\r`` is shipped to Redis (``live``) this long after it started to be
#: redrawn (a bar finished sooner costs only its final line) ...
LIVE_DELAY = 0.1
#: ... and then at most this often while it changes.
LIVE_INTERVAL = 0.25
#: A node's log entry waits this long for more lines before it is sent (an event, e.g. a
#: worker's exit, sends it at once): one XADD per node and 50 ms, not per worker and line.
LOG_LINGER = 0.05


def make_logs_drop_marker(job_id: str, node_id: str) -> DropMarkerFactory:
    """The publisher's drop marker for log lines: a ``logs_dropped`` event with the count."""
    events_key = JobKeys(job_id).events

    def marker(count: int) -> tuple[str, dict[str, str]]:
        return events_key, event_records.encode_event(event_records.EventType.LOGS_DROPPED,
                                                      node_id, {"count": count})

    return marker


class _Batch:
    """Lines of one worker stream waiting in the publisher: its part of a node's entry.

    ``segments`` are blocks of lines already joined by newlines: joining them with newlines
    again gives exactly the stream's lines, without a per-line split. ``live`` is the
    stream's live block, not sent yet (sent after the segments; a newer state replaces it).
    ``first_at`` and ``live_at`` are the monotonic times of the first bytes of the first line
    and of the live block: their ages are taken when the entry is built, just before its
    XADD.
    """

    __slots__ = ("first_at", "lines", "live", "live_at", "segments", "shipper")

    def __init__(self, shipper: Shipper) -> None:
        self.shipper = shipper
        self.segments: list[str] = []
        self.lines = 0
        self.live: list[str] | None = None
        self.first_at: float | None = None
        self.live_at = 0.0

    def batch(self) -> LogBatch:
        """The stream's next batch (numbered now: batches are numbered as they are sent)."""
        s = self.shipper
        s.seq += 1
        now = time.monotonic()
        live = self.live or []
        s.held = len(live)
        first = self.first_at if self.first_at is not None else now
        return LogBatch(node=s.node, rank=s.rank, local_rank=s.local_rank, attempt=s.attempt,
                        stream=s.stream, seq=s.seq, lines=[*self.segments, *live],
                        live=len(live), age=_ms(now - first),
                        live_age=_ms(now - self.live_at) if live else 0)


def _ms(seconds: float) -> int:
    return min(max(0, round(seconds * 1000)), log_records.MAX_AGE_MS)


class _NodeEntry:
    """The node's next log entry (a ``DeferredPayload``): the lines every worker stream of the
    node printed while it waited in the publisher, one :class:`_Batch` per stream, in the
    order they first printed."""

    __slots__ = ("nbytes", "node", "parts")

    def __init__(self, node: str) -> None:
        self.node = node
        self.parts: dict[Shipper, _Batch] = {}
        self.nbytes = 0

    @property
    def weight(self) -> int:
        return sum(p.lines + len(p.live or ()) for p in self.parts.values())

    def build(self) -> dict[str, str]:
        return log_records.encode_node_log_entry(
            self.node, [p.batch() for p in self.parts.values() if p.segments or p.live])


class NodeBatcher:
    """Gathers the lines of all the node's worker streams into one entry per flush.

    At 4,096 ranks printing ~12 lines/s each, one entry per worker stream and flush was
    ~50k one-line XADDs a second for Redis and every console to handle; one entry per node
    and flush, waiting up to :data:`LOG_LINGER` for more lines, is a few thousand.
    """

    def __init__(self, publisher: StreamPublisher, key: str, cfg: LogConfig,
                 node: str) -> None:
        self.publisher = publisher
        self.key = key
        self.maxlen = cfg.maxlen
        self.max_entry_bytes = cfg.max_entry_bytes
        self.node = node
        self._entry: _NodeEntry | None = None
        self._handle: Record | None = None

    def part(self, shipper: Shipper) -> _Batch:
        """``shipper``'s part of the entry still waiting in the publisher, or of a new one
        once it was sent, sealed or full. What is added to it is reported with :meth:`grow`
        before anything else is published."""
        entry, handle = self._entry, self._handle
        if (entry is None or handle is None or not handle.open
                or entry.nbytes >= self.max_entry_bytes):
            entry = _NodeEntry(self.node)
            handle = self.publisher.publish_deferred(self.key, entry, self.maxlen,
                                                     linger=LOG_LINGER)
            self._entry, self._handle = entry, handle
        batch = entry.parts.get(shipper)
        if batch is None:
            batch = entry.parts[shipper] = _Batch(shipper)
        return batch

    def open_part(self, shipper: Shipper) -> _Batch | None:
        """``shipper``'s part of the entry waiting in the publisher, if it has one there."""
        entry, handle = self._entry, self._handle
        if entry is None or handle is None or not handle.open:
            return None
        return entry.parts.get(shipper)

    def grow(self, nbytes: int) -> None:
        """``nbytes`` more in the entry :meth:`part` just gave a part of."""
        assert self._entry is not None and self._handle is not None
        self._entry.nbytes += nbytes
        self.publisher.grow(self._handle, nbytes)


#: Where a stream rendered by a terminal emulator gets its live block from, when a timer ships
#: it: ``() -> (rows, first byte's monotonic time)``.
LiveSource = Callable[[], tuple[list[str], float]]


class Shipper:
    """Cuts one worker stream into lines and hands them to the publisher in batches.

    Plain output is cut here (:meth:`feed`, bytes); output that moves the cursor is rendered
    by a terminal emulator (records/screen.py) and handed over as finished lines and a live
    block (:meth:`rendered`). Either way, what a reader holds as the stream's live block is
    replaced by the first lines of its next batch.
    """

    def __init__(self, batcher: NodeBatcher, cfg: LogConfig, rank: int, local_rank: int,
                 attempt: int, stream: str) -> None:
        self.batcher = batcher
        self.cap = cfg.max_line_bytes
        self.node = batcher.node
        self.rank = rank
        self.local_rank = local_rank
        self.attempt = attempt
        self.stream = stream
        self.seq = 0
        #: live lines of the last batch built (what readers hold as this stream's block)
        self.held = 0
        # The unterminated line: the head of its current frame (cap + 4 bytes max; the whole
        # line if it was never redrawn), what the frame has beyond that head, whether a \r
        # ended it (the next byte starts a new frame, unless it is the \n of \r\n), whether
        # it was redrawn (a bar's frame) and when its first byte came.
        self._partial = bytearray()
        self._partial_extra = 0
        self._cr = False
        self._redrawn = False
        self._partial_at = 0.0
        self._live_timer: asyncio.TimerHandle | None = None
        self._live_dirty = False  # the live block changed since it was last shipped
        self._live_at = -LIVE_INTERVAL  # loop time of the last live block shipped
        self._source: LiveSource | None = None  # rendered: where the live block comes from

    def feed(self, data: bytes, now: float | None = None) -> None:
        """Plain output (no cursor movement), read at ``now`` (``time.monotonic()``)."""
        if now is None:
            now = time.monotonic()
        if self._redrawn and not self._cr and data[:1] not in (b"\r", b"\n", b""):
            # A bar's frame followed by other output (a log line written under the bar): a
            # terminal would show them glued on one row; they are two lines.
            self._ship([self._take_partial()], 1, 0, self._partial_at)
        nl = data.rfind(b"\n")
        if nl < 0:
            self._add_partial(data, now)
            if self._partial or self._partial_extra:
                self._live_changed()
            return
        texts: list[str] = []
        nlines = 0
        first_at = now
        if self._partial or self._partial_extra or self._cr:
            first = data.find(b"\n")
            self._add_partial(data[:first], now)
            first_at = self._partial_at
            texts.append(self._take_partial())
            nlines += 1
            body = data[first + 1: nl] if first < nl else None
        else:
            body = data[:nl]
        if body is not None:
            texts.append(self._decode_block(body))
            nlines += body.count(b"\n") + 1
        if nl != len(data) - 1:
            self._add_partial(data[nl + 1:], now)
        self._ship(texts, nlines, nl + 1, first_at)
        if self._partial or self._partial_extra:
            self._live_changed()

    def eof(self) -> None:
        if self._live_timer is not None:
            self._live_timer.cancel()
            self._live_timer = None
        if self._partial or self._partial_extra or self._cr:
            nbytes = len(self._partial) + self._partial_extra
            self._ship([self._take_partial()], 1, nbytes, self._partial_at)

    def _ship(self, texts: list[str], nlines: int, nbytes: int, first_at: float) -> None:
        batch = self.batcher.part(self)
        if batch.live is not None:
            # The first of these lines finishes the line whose frame waits here unsent:
            # the frame would only be replaced by it.
            batch.live = None
        if batch.first_at is None:
            batch.first_at = first_at
        batch.segments.extend(texts)
        batch.lines += nlines
        self.batcher.grow(nbytes)

    # -- output rendered by a terminal emulator -------------------------------------------

    def take_over(self) -> tuple[bytes, float] | None:
        """The stream goes to a terminal emulator: the current frame of its unterminated
        line (to draw first) and its first byte's time; forgotten here, unshipped (the
        emulator's live block replaces what readers hold of it)."""
        if not (self._partial or self._cr):
            return None
        frame, at = bytes(self._partial), self._partial_at
        self._partial.clear()
        self._partial_extra = 0
        self._cr = self._redrawn = False
        return frame, at

    def rendered(self, finished: list[tuple[str, float]], source: LiveSource | None,
                 changed: bool) -> None:
        """Lines the emulator finished (text, first byte's time), and whether its live
        block (read from ``source``; None: the stream is plain again) ``changed``.

        Finished lines go now, with the current live block behind them (readers replace
        their block with the batch's first lines: the rest must follow, not wait). A live
        block that only changed goes at most every :data:`LIVE_INTERVAL`, or at once with
        an entry this stream already has waiting in the publisher, or when the stream is
        plain again (its block is then empty).
        """
        self._source = source
        if source is None and not finished and changed and self.held:
            self._put_live(self.batcher.part(self))  # the block readers hold is gone
            return
        if finished:
            texts = [self._cap_text(t) for t, _ in finished]
            batch = self.batcher.part(self)
            batch.live = None
            if batch.first_at is None:
                batch.first_at = finished[0][1]
            batch.segments.extend(texts)
            batch.lines += len(texts)
            self.batcher.grow(sum(len(t) + 1 for t in texts))
            self._put_live(batch)
            return
        if not changed:
            return
        batch = self.batcher.open_part(self)
        if batch is not None:
            self._put_live(batch)
        else:
            self._live_changed()

    def _put_live(self, batch: _Batch) -> None:
        """Put the emulator's live block in ``batch`` (an empty block is shipped as one empty
        row when readers hold one: the cursor's row)."""
        self._live_dirty = False
        if self._live_timer is not None:
            self._live_timer.cancel()
            self._live_timer = None
        rows, at = self._source() if self._source is not None else ([], 0.0)
        if not rows:
            if batch.segments or not self.held:
                batch.live = None  # finished lines take the rows readers hold, or none held
                return
            rows = [""]  # readers hold a block that is gone: one empty row, the cursor's
        rows = [self._cap_text(t) for t in rows]
        old = sum(map(len, batch.live)) if batch.live else 0
        batch.live = rows
        batch.live_at = at
        if batch.first_at is None:
            batch.first_at = at
        self.batcher.grow(max(0, sum(map(len, rows)) - old))

    def _cap_text(self, text: str) -> str:
        if len(text) <= self.cap // 4:  # (a character is at most 4 bytes)
            return text
        raw = text.encode("utf-8", "replace")
        return self._frame_text(raw, 0) if len(raw) > self.cap else text

    # -- lines redrawn in place -----------------------------------------------------------

    def _live_changed(self) -> None:
        """The live block changed: ship it when the pace allows (one timer at most, armed by
        a change, so an idle or finished line costs nothing)."""
        self._live_dirty = True
        if self._live_timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # fed outside a loop (a unit test): the final line only
            return
        delay = max(LIVE_DELAY, self._live_at + LIVE_INTERVAL - loop.time())
        self._live_timer = loop.call_later(delay, self._ship_live)

    def _ship_live(self) -> None:
        self._live_timer = None
        if not self._live_dirty:
            return  # finished meanwhile: its final line was shipped instead
        self._live_at = asyncio.get_running_loop().time()
        if self._source is not None:
            self._put_live(self.batcher.part(self))
            return
        if not (self._partial or self._partial_extra):
            self._live_dirty = False
            return
        self._live_dirty = False
        text = self._frame_text(bytes(self._partial), self._partial_extra)
        batch = self.batcher.part(self)
        old = sum(map(len, batch.live)) if batch.live else 0
        batch.live = [text]  # a frame not sent yet is replaced: frames coalesce in an outage
        batch.live_at = self._partial_at
        if batch.first_at is None:
            batch.first_at = self._partial_at
        self.batcher.grow(max(0, len(text) - old))

    # -- lines ----------------------------------------------------------------------------

    def _decode_block(self, block: bytes) -> str:
        """Complete lines joined by newlines -> text, long lines capped, each line as a
        terminal shows it (see :func:`_last_frames`)."""
        if b"\r" in block:
            block = _last_frames(block)
        if len(block) > self.cap:
            lines = block.split(b"\n")
            if max(map(len, lines)) > self.cap:
                block = b"\n".join([self._cap(line) if len(line) > self.cap else line
                                    for line in lines])
        return block.decode("utf-8", "replace")

    def _cap(self, line: bytes) -> bytes:
        """The head of a too-long line (cut on a UTF-8 boundary) and a visible marker."""
        cut = _utf8_cut(line, self.cap)
        return line[:cut] + _marker(len(line) - cut)

    def _add_partial(self, data: bytes, now: float) -> None:
        if not (self._partial or self._partial_extra or self._cr) and data:
            self._partial_at = now  # the line's first byte
        if self._cr or b"\r" in data:
            data = self._new_frame(data)
            if not data:
                return
        room = self.cap + 4 - len(self._partial)
        if len(data) <= room:
            self._partial += data
        else:
            # Only the head of a giant line is ever kept: memory stays bounded whatever
            # a worker prints without a newline.
            if room > 0:
                self._partial += data[:room]
            self._partial_extra += len(data) - max(room, 0)

    def _new_frame(self, data: bytes) -> bytes:
        """Follow the ``\\r`` in ``data``: return what continues the current frame, after
        forgetting the frames that ``data`` overwrites (a ``\\r`` followed by anything but a
        newline starts a new frame; trailing ones are remembered for the next chunk)."""
        body = data.rstrip(b"\r")
        if not body:
            self._cr = True
            return b""
        cut = body.rfind(b"\r")
        if cut >= 0 or self._cr:
            self._partial.clear()
            self._partial_extra = 0
            self._redrawn = True
            body = body[cut + 1:]
        self._cr = len(body) < len(data) - cut - 1
        return body

    def _take_partial(self) -> str:
        text = self._frame_text(bytes(self._partial), self._partial_extra)
        self._partial.clear()
        self._partial_extra = 0
        self._cr = self._redrawn = self._live_dirty = False
        return text

    def _frame_text(self, raw: bytes, extra: int) -> str:
        if extra or len(raw) > self.cap:
            cut = _utf8_cut(raw, self.cap)
            return (raw[:cut] + _marker(len(raw) - cut + extra)).decode("utf-8", "replace")
        return raw.decode("utf-8", "replace")


def _last_frames(block: bytes) -> bytes:
    """Complete lines joined by ``\\n`` (the last one's ``\\n`` not included), each as a
    terminal shows it: ``\\r\\n`` ends a line like ``\\n``, and a line redrawn with ``\\r`` is
    its last frame (the text after its last ``\\r`` that is followed by something)."""
    block = block.replace(b"\r\n", b"\n").rstrip(b"\r")
    if b"\r" not in block:
        return block
    return b"\n".join([line.rstrip(b"\r").rpartition(b"\r")[2] if b"\r" in line else line
                       for line in block.split(b"\n")])


def _utf8_cut(data: bytes, limit: int) -> int:
    """The largest cut <= ``limit`` that does not split a UTF-8 sequence (``len(data) > limit``)."""
    i = limit
    # A continuation byte (10xxxxxx) at the cut belongs to a character started before it.
    while i > limit - 3 and i > 0 and (data[i] & 0xC0) == 0x80:
        i -= 1
    return i


def _marker(dropped: int) -> bytes:
    return f" …[truncated {dropped} bytes]".encode()
