"""The fold of a job's log batches into a :class:`~elastic_console.job.state.JobView`: each
rank's ring and the interleaved one, a line redrawn in place kept as one row, and the
reader's fast path (:meth:`LogFold.apply_many`, tens of thousands of batches a second).
:class:`LogFold` is a part of JobView (its base class): its methods run on the view.

Duplicates: a retried XADD can write an entry twice (Redis 7 has no idempotent XADD).
A log batch is a duplicate when its ``seq`` is not above the highest seen for the same
``(node, rank, stream, attempt)``: the agent numbers a worker stream's batches in publish
order and its publisher never reorders them.

Log lines live in :class:`~elastic_console.job.logbuffer.LogRing` rings (O(1) indexing,
``total_appended`` tells a view what is new), one per rank and one for all ranks, so a log view
shows one rank by pointing at that rank's ring: no filtering scan. A line is a *plain* tuple
``(server_ms, rank, stream, text)``, field-compatible with
:class:`~elastic_console.job.logbuffer.LogLine` (``LogLine._make(line)`` names the fields):
CPython stops tracking a plain tuple of atomic values in the cyclic GC, a NamedTuple instance
stays tracked for life, and 200k tracked lines made every full collection ~40 ms longer
(``bench/log_view_bench.py``, "tuned").
"""

from __future__ import annotations

from collections.abc import Iterable

from elastic_agent.coordination.wire.event_records import Event
from elastic_agent.coordination.wire.log_records import LogBatch
from elastic_agent.coordination.wire.protocol import MAX_NAME_CHARS
from elastic_agent.coordination.wire.text import sanitize

from .fields import _int
from .logbuffer import LogBuffer, LogLine, LogRing
from .model import MAX_VIEW_RANKS, RUNNING, STALLED, WAITS, RankState
from .packed_buffer import PackedLogBuffer

__all__ = ["BatchDeduper", "LogFold"]


def _log_lines(ms: int, rank: int, stream: str, lines: list[str],
               first_ms: int) -> list[tuple[int, int, str, str]]:
    """A batch's lines as the rings keep them: plain tuples (see the module docstring:
    untracked by the cyclic GC), text escaped (a printable line, the common case, as is).
    The first line is stamped ``first_ms`` (its first byte's time), the others ``ms``."""
    t = lines[0]
    first = (first_ms, rank, stream, t if t.isprintable() else sanitize(t))
    if len(lines) == 1:  # a batch is often one line (thousands of ranks, ~10 lines/s each)
        return [first]
    made = [(ms, rank, stream, t if t.isprintable() else sanitize(t)) for t in lines]
    made[0] = first
    return made


def _timed_lines(batch: LogBatch, rank: int, stream: str,
                 lines: list[str]) -> list[tuple[int, int, str, str]]:
    """:func:`_log_lines` with each line at its first byte's time (``LogBatch.line_times``)."""
    return [(ms, rank, stream, t if t.isprintable() else sanitize(t))
            for ms, t in zip(batch.line_times(), lines)]


class BatchDeduper:
    """Recognises a log batch already seen (a retried XADD wrote it twice).

    Keeps the highest ``seq`` per ``(node, rank, stream, attempt)``; a batch at or below it is
    a repeat. Batches without a sequence number (``seq <= 0``) are never called repeats.
    Bounded: past ``limit`` keys the oldest half (oldest attempts) is forgotten.
    """

    __slots__ = ("_last", "limit")

    def __init__(self, limit: int = 65_536) -> None:
        self._last: dict[tuple[str, int, str, int], int] = {}
        self.limit = limit

    def seen(self, batch: LogBatch) -> bool:
        """True if ``batch`` repeats one seen before; else remember it and return False."""
        seq = batch.seq
        if seq <= 0:
            return False
        key = (batch.node, batch.rank, batch.stream, batch.attempt)
        last = self._last.get(key, 0)
        if seq <= last:
            return True
        self._last[key] = seq
        self.trim()
        return False

    def trim(self) -> None:
        """Forget the oldest half once more than ``limit`` streams are remembered."""
        if len(self._last) > self.limit:
            for k in list(self._last)[: self.limit // 2]:  # dicts keep insertion order
                del self._last[k]


class LogFold:
    """How log batches change a :class:`~elastic_console.job.state.JobView` (see the module doc).

    A base class of JobView, never used alone: its methods read and write the view's fields
    (``logs``, ``all_logs``, ``ranks``, the deduper and the rows redrawn in place, made by
    ``JobView.__init__``) and use its ``apply``, ``_new_rank`` and ``_host_of``.
    """

    @property
    def lines_total(self) -> int:
        """Lines ever appended to the interleaved view (monotonic)."""
        return self.all_logs.total_appended

    def logs_for(self, rank: int) -> LogRing:
        """The scrollback of one rank, oldest first (an empty ring if it never printed).

        Does not create the rank's ring: use :meth:`buffer_for` to hold on to it.
        """
        buf = self.logs.get(rank)
        return buf if buf is not None else LogBuffer(1)

    def buffer_for(self, rank: int) -> LogRing:
        """The ring of one rank, created empty if it never printed: a view pointed at it sees
        the rank's lines as they arrive."""
        buf = self.logs.get(rank)
        if buf is None:
            if len(self.logs) >= MAX_VIEW_RANKS:
                return LogBuffer(1)  # past the bound: an empty ring nothing will fill
            buf = self.logs[rank] = PackedLogBuffer(self.scrollback)
        return buf

    def tail(self, n: int, rank: int | None = None, stream: str | None = None) -> list[LogLine]:
        """The last ``n`` lines of one rank (or all ranks interleaved), optionally one stream."""
        source = self.all_logs if rank is None else self.logs_for(rank)
        if n <= 0:
            return []
        out: list[LogLine] = []
        for i in range(len(source) - 1, -1, -1):  # O(1) indexing from the newest end
            line = source[i]
            if stream is None or line[2] == stream:
                out.append(line)
                if len(out) >= n:
                    break
        out.reverse()
        return out

    def apply_many(self, records: Iterable[object]) -> int:
        """:meth:`apply` each record in order: the same view at a fraction of the cost per log
        batch (the console's reader folds tens of thousands a second, ~1 line each at 4,096
        ranks). Returns the newest server ms the records carry (0: none).

        The common batch (lines of a rank already shown, not a repeat, nothing redrawn in
        place) is folded here inline, and the lines of a run of them reach the interleaved
        ring in one extend; any other record goes through :meth:`apply`.
        """
        logs, ranks, last_seq = self.logs, self.ranks, self._dedupe._last
        inplace = self._inplace
        redrawn = len(inplace) > 0
        pending: list[LogLine] = []  # lines for the interleaved ring, in arrival order
        newest = 0
        head, ms = "", 0
        last_eid: str | None = None
        folded = False
        for rec in records:
            if type(rec) is LogBatch and not rec.live:
                node, rank, _, attempt, stream, seq, lines, eid, _, age, _ = rec
                buf = logs.get(rank)
                rs = ranks.get(rank)
                key = (node, rank, stream, attempt)
                # Else: a rank's first lines, the next state of a line redrawn in place, or
                # a batch the decoder did not make.
                fast = (buf is not None and rs is not None and type(lines) is list
                        and type(eid) is str and not (redrawn and key in inplace))
            else:
                fast = False
            if not fast:
                if pending:
                    self.all_logs.extend(pending)
                    pending = []
                self.apply(rec)
                if isinstance(rec, (Event, LogBatch)):
                    newest = max(newest, rec.server_ms)
                redrawn = len(inplace) > 0
                continue
            if seq > 0:
                if seq <= last_seq.get(key, 0):
                    continue  # a retried XADD's second copy
                last_seq[key] = seq
            if eid is not last_eid:  # a node's entry: its batches share their id
                last_eid = eid
                h = eid.partition("-")[0]
                if h != head:  # consecutive ids often share their millisecond
                    try:
                        ms = int(h)
                    except ValueError:
                        ms = 0
                    head = h
            made = _log_lines(ms, rank, stream, lines, ms - age if age and ms > age else ms)
            buf.extend_list(made)  # type: ignore[arg-type]  # plain 4-tuples, LogLine-compatible
            pending += made  # type: ignore[arg-type]
            folded = True
            if ms > rs.last_line_ms:
                self._printed(rs, ms)
            if ms > newest:
                newest = ms
        if pending:
            self.all_logs.extend(pending)
        if folded:
            self._dedupe.trim()
            self.version += 1
        return newest

    def apply_logs(self, batch: LogBatch) -> None:
        """Append a batch's lines to its rank and to the interleaved view: O(lines). A live
        block (``batch.live``, :mod:`~elastic_console.job.inplace`) keeps its rows in both,
        replaced by each newer state; each line is stamped with its first byte's time."""
        try:
            rank, lines, stream = batch.rank, batch.lines, batch.stream
            if type(rank) is not int or not isinstance(lines, list) or (
                    rank not in self.logs and len(self.logs) >= MAX_VIEW_RANKS):
                self.ignored += 1
                return
            if self._dedupe.seen(batch):
                return
            ms = batch.server_ms
            made = _timed_lines(batch, rank, stream, lines)
            held = self._inplace.take(batch)
            live = int(batch.live) if isinstance(batch.live, int) else 0
            if not 0 <= live <= len(made):
                live = 0
        except Exception:
            self.ignored += 1
            return
        buf = self.logs.get(rank)
        if buf is None:
            buf = self.logs[rank] = PackedLogBuffer(self.scrollback)
        rows: list[tuple[int, int]] = []  # where each line of the batch is
        if held:
            for row, line in zip(held, made):
                buf.replace(row[0], line)  # type: ignore[arg-type]
                self.all_logs.replace(row[1], line)  # type: ignore[arg-type]
            rows = held[:len(made)]
            spare = held[len(made):]
            if spare:  # the block shrank: its other rows are blank now
                blank = (made[-1][0] if made else ms, rank, stream, "")
                for row in spare:
                    buf.replace(row[0], blank)  # type: ignore[arg-type]
                    self.all_logs.replace(row[1], blank)  # type: ignore[arg-type]
            rest = made[len(held):]
        else:
            spare = []
            rest = made
        if rest:
            b0, a0 = buf.total_appended, self.all_logs.total_appended
            buf.extend(rest)  # type: ignore[arg-type]  # plain 4-tuples, LogLine-compatible
            self.all_logs.extend(rest)  # type: ignore[arg-type]
            if live:
                rows += [(b0 + i, a0 + i) for i in range(len(rest))]
        if live:
            self._inplace.hold(batch, rows[len(made) - live:] + spare)
        rs = self.ranks.get(rank)
        if rs is None:
            # Lines can arrive before the workers_started event (different streams).
            rs = self._new_rank(rank)
            if rs is not None:
                rs.node = sanitize(str(batch.node)[:MAX_NAME_CHARS])
                rs.local_rank = _int(batch.local_rank, None)
                rs.host = self._host_of(rs.node)
        if rs is not None and ms > rs.last_line_ms:
            self._printed(rs, ms)
        self.version += 1

    def _printed(self, rs: RankState, ms: int) -> None:
        """``rs`` printed a line at server ms ``ms``, newer than its last one."""
        rs.last_line_ms = ms
        if rs.state in (STALLED, WAITS) and ms > self._stalled_ms:
            rs.state = RUNNING  # it printed again: it is not stalled any more
