"""LogBuffer: a bounded, append-only ring of log lines with O(1) random access. No Textual.

Every line ever appended gets an absolute sequence number (``seq``): the first line is 0, the
next 1, and so on, for the life of the buffer. Only the newest ``capacity`` lines are kept:

    first_seq = total_appended - len(buffer)     # the oldest line still held
    buffer.get(seq)                              # O(1), for first_seq <= seq < total_appended
    buffer[i]                                    # O(1), i relative to the oldest line held

A view remembers the ``total_appended`` it has seen: lines ``[seen, total_appended)`` are new,
and lines below ``first_seq`` fell off the front. A line redrawn in place (a progress bar) is
changed with :meth:`~LogBuffer.replace`: a view also remembers ``edits`` and asks
:meth:`~LogBuffer.edited_since` which lines changed. Storage is a plain list used as a ring
(``seq % capacity``), grown lazily up to ``capacity``: unlike ``collections.deque``, indexing
the middle is O(1), and ``extend`` is a couple of slice assignments (C speed).

:class:`LogRing` is the contract (counters, edits, reads); :class:`LogBuffer` keeps every line
as its tuple, :class:`~elastic_console.job.packed_buffer.PackedLogBuffer` packs older lines.

Not thread-safe: one writer, on the thread that also reads it (the console's event loop).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple, overload

__all__ = ["LogBuffer", "LogLine", "LogRing"]

#: Replacements remembered for views; a view that missed more redraws everything.
EDITS_KEPT = 1024


class LogLine(NamedTuple):
    """One line of a worker's output.

    The view only reads the four positions, so any such 4-tuple may be stored.
    """

    server_ms: int
    rank: int
    stream: str  # 'out' | 'err'
    text: str


class LogRing(Sequence[LogLine]):
    """The newest ``capacity`` lines appended, oldest first, and a count of all ever appended.

    The counters, the edit log and the reads built on :meth:`get` and :meth:`lines_between`
    live here; a subclass stores the lines (:meth:`append`, :meth:`_extend`, :meth:`_put`,
    :meth:`get`, :meth:`lines_between`, :meth:`_forget`).
    """

    __slots__ = ("_cap", "_edited", "_edits", "_start", "_total")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._cap = int(capacity)
        self._total = 0  # lines ever appended
        self._start = 0  # seq of the oldest line held (moves on overflow and on clear())
        self._edits = 0  # lines ever replaced
        self._edited: deque[int] = deque(maxlen=EDITS_KEPT)  # their seqs, newest last

    # -- sizes and counters -------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def total_appended(self) -> int:
        """Lines ever appended (monotonic; not reset by :meth:`clear`). Also the next ``seq``."""
        return self._total

    @property
    def first_seq(self) -> int:
        """``seq`` of the oldest line held (== ``total_appended`` when empty)."""
        return self._start

    @property
    def dropped(self) -> int:
        """Lines that fell off the front (or were cleared)."""
        return self._start

    def __len__(self) -> int:
        return self._total - self._start

    def __bool__(self) -> bool:
        return self._total > self._start

    # -- writing --------------------------------------------------------------------------------

    def append(self, line: LogLine) -> None:
        self.extend([line])

    def extend(self, lines: Iterable[LogLine]) -> int:
        """Append many lines. Returns how many."""
        if type(lines) is not list:
            lines = list(lines)
        if lines:
            self._extend(lines)
        return len(lines)

    def extend_list(self, lines: list[LogLine]) -> None:
        """:meth:`extend` for a non-empty list the caller hands over (kept as it is, not
        copied): the reader's hot path, a call less per batch."""
        self._extend(lines)

    def _extend(self, lines: list[LogLine]) -> None:  # pragma: no cover - abstract
        """Store ``lines`` (at least one) after the last, counting them in the counters."""
        raise NotImplementedError

    def _put(self, seq: int, line: LogLine) -> None:  # pragma: no cover - abstract
        """Store ``line`` at ``seq`` (held: ``first_seq <= seq < total_appended``)."""
        raise NotImplementedError

    def _forget(self) -> None:
        """Drop the storage of every line below ``first_seq`` (after :meth:`clear`)."""

    def replace(self, seq: int, line: LogLine) -> bool:
        """Put ``line`` where the line ``seq`` is (a newer state of a line redrawn in place).
        False if that line is not held any more. Counted in :attr:`edits`."""
        if not self._start <= seq < self._total:
            return False
        self._put(seq, line)
        self._edits += 1
        self._edited.append(seq)
        return True

    @property
    def edits(self) -> int:
        """Replacements ever made (monotonic)."""
        return self._edits

    def edited_since(self, edits: int) -> list[int] | None:
        """The seqs replaced since :attr:`edits` was ``edits``, oldest first (a seq may repeat);
        None if that is more than the buffer remembers (:data:`EDITS_KEPT`)."""
        n = self._edits - edits
        if n <= 0:
            return []
        if n > len(self._edited):
            return None
        return list(self._edited)[-n:]

    def clear(self) -> None:
        """Forget every line held; ``total_appended`` keeps counting (views see a front drop)."""
        self._start = self._total
        self._forget()

    # -- reading --------------------------------------------------------------------------------

    def get(self, seq: int) -> LogLine:  # pragma: no cover - abstract
        """The line with absolute sequence number ``seq`` (IndexError if dropped or not yet)."""
        raise NotImplementedError

    def lines_between(self, start_seq: int, end_seq: int) -> list[LogLine]:  # pragma: no cover
        """Lines with ``start_seq <= seq < end_seq`` that are still held, oldest first.

        The range is clamped to what is held: the first returned line has
        ``seq == max(start_seq, first_seq)``.
        """
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> LogLine: ...
    @overload
    def __getitem__(self, index: slice) -> list[LogLine]: ...

    def __getitem__(self, index: int | slice) -> LogLine | list[LogLine]:
        size = self._total - self._start
        if isinstance(index, slice):
            lo, hi, step = index.indices(size)
            if step == 1:
                return self.lines_between(self._start + lo, self._start + max(lo, hi))
            return [self.get(self._start + i) for i in range(lo, hi, step)]
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError("LogBuffer index out of range")
        return self.get(self._start + index)

    def __iter__(self) -> Iterator[LogLine]:
        return iter(self.lines_between(self._start, self._total))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(capacity={self._cap}, len={len(self)}, "
                f"total_appended={self._total})")


class LogBuffer(LogRing):
    """A :class:`LogRing` that keeps every line as its tuple in a plain list used as a ring."""

    __slots__ = ("_buf",)

    def __init__(self, capacity: int = 200_000) -> None:
        super().__init__(capacity)
        self._buf: list[LogLine] = []  # grows to _cap, then is a ring indexed by seq % _cap

    def append(self, line: LogLine) -> None:
        buf, cap = self._buf, self._cap
        if len(buf) < cap:  # still growing: position == seq
            buf.append(line)
        else:
            buf[self._total % cap] = line
        self._total += 1
        if self._total - self._start > cap:
            self._start = self._total - cap

    def _extend(self, lines: list[LogLine]) -> None:
        """At most three slice operations, whatever the number of lines."""
        n = len(lines)
        buf, cap, total = self._buf, self._cap, self._total
        if n >= cap:
            # Only the last `cap` survive; lay them out so that seq s sits at s % cap.
            tail = lines[n - cap:] if n > cap else lines
            pos = (total + n - cap) % cap
            self._buf = tail[cap - pos:] + tail[:cap - pos]
        else:
            fill = cap - len(buf)  # > 0 only while growing; then len(buf) == total
            if fill > 0:
                if n <= fill:
                    buf.extend(lines)
                    rest: list[LogLine] = []
                else:
                    buf.extend(lines[:fill])
                    rest = lines[fill:]
                pos = 0  # after filling, the ring wraps to position 0
            else:
                rest = lines
                pos = total % cap
            k = len(rest)
            if k:
                first = min(k, cap - pos)
                buf[pos:pos + first] = rest[:first] if first < k else rest
                if first < k:
                    buf[:k - first] = rest[first:]
        self._total = total + n
        if self._total - self._start > cap:
            self._start = self._total - cap

    extend_list = _extend

    def _put(self, seq: int, line: LogLine) -> None:
        self._buf[seq % self._cap] = line

    def get(self, seq: int) -> LogLine:
        """The line with absolute sequence number ``seq`` (IndexError if dropped or not yet)."""
        if not self._start <= seq < self._total:
            raise IndexError(f"seq {seq} not in [{self._start}, {self._total})")
        return self._buf[seq % self._cap]

    def lines_between(self, start_seq: int, end_seq: int) -> list[LogLine]:
        """Lines with ``start_seq <= seq < end_seq`` that are still held, oldest first.

        The range is clamped to what is held: the first returned line has
        ``seq == max(start_seq, first_seq)``.
        """
        a = max(start_seq, self._start)
        b = min(end_seq, self._total)
        n = b - a
        if n <= 0:
            return []
        buf, cap = self._buf, self._cap
        pa = a % cap
        if pa + n <= cap:
            return buf[pa:pa + n]
        return buf[pa:] + buf[:pa + n - cap]
