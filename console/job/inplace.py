"""Lines redrawn in place (progress bars): where each worker stream's unfinished line is shown.

An agent ships a line that a worker redraws with ``\\r`` as the ``live`` last line of a log
batch, and the first line of the same stream's next batch (``seq + 1``) is that line again,
newer or final (see :class:`~elastic_agent.coordination.wire.log_records.LogBatch`). A reader that
keeps lines remembers, per stream, where it put the unfinished one, and puts the next batch's
first line there instead of after the others: one row that updates, as on a terminal.

A batch that does not follow (a gap: entries trimmed or dropped, a new attempt) leaves the
row as it was last drawn. Pure, no I/O; memory is bounded by ``limit`` streams.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from elastic_agent.coordination.wire.log_records import LogBatch

__all__ = ["InPlaceRows"]

Row = TypeVar("Row")


class InPlaceRows(Generic[Row]):
    """Stream ``(node, rank, stream, attempt)`` -> the row of its unfinished line (any handle
    the caller chooses: an index, a pair of ring positions) and the ``seq`` that shipped it."""

    __slots__ = ("_rows", "limit")

    def __init__(self, limit: int = 4096) -> None:
        self._rows: dict[tuple[str, int, str, int], tuple[int, Row]] = {}
        self.limit = limit

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, stream: object) -> bool:
        """Whether ``(node, rank, stream, attempt)`` has an unfinished line held."""
        return stream in self._rows

    def take(self, batch: LogBatch) -> Row | None:
        """The row ``batch``'s first line replaces: its stream's unfinished line, if ``batch``
        is the next batch of that stream. Forgotten either way (it is no longer unfinished,
        or it never will be finished)."""
        if not self._rows:  # the common case: nothing is being redrawn
            return None
        held = self._rows.pop((batch.node, batch.rank, batch.stream, batch.attempt), None)
        if held is None or held[0] + 1 != batch.seq:
            return None
        return held[1]

    def hold(self, batch: LogBatch, row: Row) -> None:
        """``batch`` is ``live``: its last line, its stream's unfinished one, is at ``row``.
        A batch without a sequence number cannot be followed and is not held."""
        if batch.seq <= 0:
            return
        rows = self._rows
        rows[(batch.node, batch.rank, batch.stream, batch.attempt)] = (batch.seq, row)
        if len(rows) > self.limit:
            for key in list(rows)[: max(1, self.limit // 2)]:  # the oldest (insertion order)
                del rows[key]
