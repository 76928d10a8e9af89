"""Lines redrawn in place (progress bars, live displays): where each worker stream's live block
is shown.

An agent ships what a worker still redraws as the stream's *live block*: the last ``live``
lines of a log batch (one for a bar redrawn with ``\\r``, several for a display that moves
the cursor up, such as Rich's). The first lines of the same stream's next batch (``seq + 1``)
are those rows again, newer or final (see
:class:`~elastic_agent.coordination.wire.log_records.LogBatch`). A reader that keeps lines
remembers, per stream, the rows where it put the block, and puts the next batch's first lines
there instead of after the others: rows that update, as on a terminal. Rows the next batch has
no line for are blanked; while the stream is still live they stay its block's (below its live
lines: a terminal's rows under the cursor, which the next lines fill first).

A batch that does not follow (a gap: entries trimmed or dropped, a new attempt) leaves the
rows as they were last drawn. Pure, no I/O; memory is bounded by ``limit`` streams and
``MAX_ROWS`` rows a stream.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from elastic_agent.coordination.wire.log_records import LogBatch

__all__ = ["MAX_ROWS", "InPlaceRows", "latest_rows", "live_count"]

Row = TypeVar("Row")

#: Rows of one stream's block a reader holds (a worker's terminal is rarely taller).
MAX_ROWS = 200


class InPlaceRows(Generic[Row]):
    """Stream ``(node, rank, stream, attempt)`` -> the rows of its live block (any handles the
    caller chooses: indexes, pairs of ring positions) and the ``seq`` that shipped it."""

    __slots__ = ("_rows", "limit")

    def __init__(self, limit: int = 4096) -> None:
        self._rows: dict[tuple[str, int, str, int], tuple[int, list[Row]]] = {}
        self.limit = limit

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, stream: object) -> bool:
        """Whether ``(node, rank, stream, attempt)`` has a live block held."""
        return stream in self._rows

    def take(self, batch: LogBatch) -> list[Row] | None:
        """The rows ``batch``'s first lines replace, in order: its stream's live block, if
        ``batch`` is the next batch of that stream. Forgotten either way (the caller holds
        them again if they are still live, :meth:`hold`)."""
        if not self._rows:  # the common case: nothing is being redrawn
            return None
        held = self._rows.pop((batch.node, batch.rank, batch.stream, batch.attempt), None)
        if held is None or held[0] + 1 != batch.seq:
            return None
        return held[1]

    def hold(self, batch: LogBatch, rows: list[Row]) -> None:
        """``batch`` is ``live``: its stream's live block is at ``rows`` (its live lines', then
        any blank rows below them). A batch without a sequence number cannot be followed and
        is not held."""
        if batch.seq <= 0 or not rows:
            return
        rows_by_stream = self._rows
        rows_by_stream[(batch.node, batch.rank, batch.stream, batch.attempt)] = (
            batch.seq, rows[:MAX_ROWS])
        if len(rows_by_stream) > self.limit:
            for key in list(rows_by_stream)[: max(1, self.limit // 2)]:  # the oldest
                del rows_by_stream[key]


def live_count(b: LogBatch) -> int:
    """How many of ``b``'s last lines are its live block (0 for a malformed count)."""
    k = int(b.live) if isinstance(b.live, int) else 0
    return k if 0 <= k <= len(b.lines) else 0


def latest_rows(batches: list[LogBatch]) -> tuple[list[tuple[int, str] | None],
                                                 dict[tuple[str, int, str, int], list[int]]]:
    """Every line of ``batches`` (in order) in its latest state, where it first appeared, as
    ``(rank, text)``, for a reader that prints a history (``logs``, an attempt's lines):
    the rows of a stream's live block take the first lines of its next batch (a row left
    over is dropped). Returns the rows (None: dropped) and, per stream whose last batch was
    live, the indexes of its live block's rows."""
    rows: list[tuple[int, str] | None] = []
    held: dict[tuple[str, int, str, int], tuple[int, list[int]]] = {}
    for b in batches:
        key = (b.node, b.rank, b.stream, b.attempt)
        at = held.pop(key, None)
        lines = b.lines
        places: list[int] = []
        if at is not None and at[0] + 1 == b.seq:
            for i, line in zip(at[1], lines):
                rows[i] = (b.rank, line)
            places = at[1][:len(lines)]
            for i in at[1][len(lines):]:
                rows[i] = None
            lines = lines[len(at[1]):]
        start = len(rows)
        rows.extend((b.rank, line) for line in lines)
        places += range(start, len(rows))
        k = live_count(b)
        if k and b.seq > 0:
            held[key] = (b.seq, places[len(places) - k:])
    return rows, {key: at for key, (_, at) in held.items()}
