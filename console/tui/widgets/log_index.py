"""The LogView's visible index: which lines of the ring pass the filters, and on which rows they
sit. No Textual.

An ``array('q')`` of the absolute ``seq`` of every line that passes the filters (rank, stderr,
pattern), with a moving start offset (``_off``: the entries before it fell off the ring). Lines
are selected in C-level ``map``/``compress`` passes, appended after the newest (new lines) or
put before the oldest (the backward rescan), and dropped from the front by a bisect. With wrap
on, each line's cell width (``_cells``) and a running sum of rows (``_cum``) make ``row ->
(line, sub-row)`` a bisect, and a new width recomputes the heights from the stored widths
without touching the text again. When and how the widget rescans, scrolls and draws is
:mod:`.log_view`'s business (its module docstring has the whole design).

A mixin of :class:`~.log_view.LogView` (the widget is ``self``): it keeps ``_seqs``, ``_off``,
``_cells``, ``_cum``, ``_max_cells`` (no wrap: the widest text indexed) and ``_digits`` (the
rank column's width), and reads ``_source``, ``_text_width`` (the cells a wrapped row has for
text; 0 when not wrapping) and the filters ``rank_filter``, ``stderr_only`` and ``pattern``.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from itertools import accumulate, compress, repeat
from operator import eq, itemgetter

from elastic_console.job.logbuffer import LogLine

from .log_lines import MAX_LINE_CELLS, cells_of, visible_text

__all__ = ["LINE_RANK", "LINE_STREAM", "LINE_TEXT", "VisibleIndex"]

#: A LogLine's rank, stream and text, for ``map`` over many lines at C speed.
LINE_RANK = itemgetter(1)
LINE_STREAM = itemgetter(2)
LINE_TEXT = itemgetter(3)


class VisibleIndex:
    """The lines that pass the filters and their rows (see the module docstring)."""

    @property
    def line_count(self) -> int:
        """Lines that pass the filters and are still in the buffer."""
        return len(self._seqs) - self._off

    @property
    def row_count(self) -> int:
        """Rows those lines take (== line_count unless wrapping)."""
        if self._text_width:
            return self._cum[-1] - self._cum[self._off]
        return len(self._seqs) - self._off

    def visible_seqs(self) -> list[int]:
        """Absolute ``seq`` of every line that passes the filters, oldest first."""
        return self._seqs[self._off:].tolist()

    def visible_lines(self) -> Iterator[LogLine]:
        """Every line that passes the filters, oldest first."""
        src = self._source
        if src is None:
            return
        first = src.first_seq
        for seq in self._seqs[self._off:]:
            if seq >= first:  # (lines dropped since the last on_new_lines are skipped)
                yield src.get(seq)

    def line_at_row(self, row: int) -> tuple[int, int] | None:
        """``(seq, sub_row)`` of the line at virtual row ``row``, or None past the end."""
        off = self._off
        n = len(self._seqs)
        if row < 0 or off >= n:
            return None
        if self._text_width:
            cum = self._cum
            target = cum[off] + row
            if target >= cum[-1]:
                return None
            i = bisect_right(cum, target, off, n + 1) - 1
            return self._seqs[i], target - cum[i]
        i = off + row
        if i >= n:
            return None
        return self._seqs[i], 0

    def _select(self, a: int, b: int) -> tuple[range | list[int], list[LogLine]]:
        """Seqs and lines in ``[a, b)`` that pass the filters."""
        assert self._source is not None
        lines = self._source.lines_between(a, b)
        a = max(a, self._source.first_seq)
        seqs: range | list[int] = range(a, a + len(lines))
        rank = self.rank_filter
        if rank is not None and lines:
            mask = list(map(eq, map(LINE_RANK, lines), repeat(rank)))
            seqs, lines = list(compress(seqs, mask)), list(compress(lines, mask))
        if self.stderr_only and lines:
            mask = list(map(eq, map(LINE_STREAM, lines), repeat("err")))
            seqs, lines = list(compress(seqs, mask)), list(compress(lines, mask))
        pattern = self.pattern
        if pattern is not None and lines:
            # A printable line is shown as it is (sanitize and strip_sgr would not change it).
            shown = [t if t.isprintable() else visible_text(t) for t in map(LINE_TEXT, lines)]
            matches = list(map(pattern.search, shown))  # compress() keeps the truthy matches
            seqs, lines = list(compress(seqs, matches)), list(compress(lines, matches))
        return seqs, lines

    def _measure(self, lines: list[LogLine]) -> tuple[bool, list[int] | None]:
        """Widen the rank column and the scroll width for ``lines`` about to be indexed.
        Returns whether the rank column grew, and the lines' cell widths when wrapping."""
        grew = False
        try:  # (kept up to date while the tags are hidden too, for when they are shown)
            widest = max(len(str(r)) for r in (max(map(LINE_RANK, lines)), min(map(LINE_RANK, lines))))
        except TypeError:  # a malformed rank that does not compare; it shows as text
            widest = self._digits
        if widest > self._digits:
            self._digits = widest
            grew = True
        if self._text_width:
            return grew, cells_of(list(map(LINE_TEXT, lines)))
        # The scroll width from character counts (C speed): exact for plain ASCII, a little
        # generous for coloured lines; wide characters, tabs and escapes can make a line
        # wider than its length, which render_line corrects when such a line is shown.
        widest = max(map(len, map(LINE_TEXT, lines)))
        if widest > self._max_cells:
            self._max_cells = min(widest, MAX_LINE_CELLS + 1)
        return grew, None

    def _append(self, a: int, b: int) -> bool:
        """Index the lines ``[a, b)`` after those indexed. True if the rank column grew."""
        seqs, lines = self._select(a, b)
        if not lines:
            return False
        grew, cells = self._measure(lines)
        self._seqs.extend(seqs)
        if cells is not None:
            self._cells.extend(cells)
            self._extend_cum(cells)
        return grew

    def _prepend(self, a: int, b: int) -> tuple[int, bool]:
        """Index the lines ``[a, b)``, all older than those indexed (the backward rescan).
        Returns the rows they take and whether the rank column grew."""
        seqs, lines = self._select(a, b)
        if not lines:
            return 0, False
        grew, cells = self._measure(lines)
        off = self._off
        if off:  # dead entries sit in front: drop them so the new ones go right before the live
            del self._seqs[:off]
            if self._text_width:
                del self._cells[:off]
                del self._cum[:off]
            self._off = 0
        self._seqs[0:0] = array("q", seqs)
        if cells is None:
            return len(seqs), grew
        tw = self._text_width
        heights = [(c + tw - 1) // tw or 1 for c in cells]
        rows = sum(heights)
        # cum is absolute only up to a constant: count down from the current first entry
        head = array("q", accumulate(heights, initial=self._cum[0] - rows))
        head.pop()  # == the current cum[0]
        self._cum[0:0] = head
        self._cells[0:0] = array("q", cells)
        return rows, grew

    def _extend_cum(self, cells: list[int] | array) -> None:
        if not cells:
            return
        tw = self._text_width
        cum = self._cum
        last = cum[-1]
        if max(cells) <= tw:  # every line fits on one row
            cum.extend(range(last + 1, last + 1 + len(cells)))
            return
        tw1 = tw - 1
        rows = accumulate([(c + tw1) // tw or 1 for c in cells], initial=last)
        next(rows)
        cum.extend(rows)

    def _drop_front(self, first_seq: int) -> int:
        """Forget indexed lines that fell off the buffer. Returns the rows they took."""
        seqs, off = self._seqs, self._off
        if off >= len(seqs) or seqs[off] >= first_seq:
            return 0
        new_off = bisect_left(seqs, first_seq, off)
        rows = self._cum[new_off] - self._cum[off] if self._text_width else new_off - off
        self._off = new_off
        if new_off > 4096 and new_off * 2 > len(seqs):  # compact: amortized O(1) per line
            del seqs[:new_off]
            if self._text_width:
                del self._cells[:new_off]
                del self._cum[:new_off]
            self._off = 0
        return rows

    def _recompute_cum(self) -> None:
        # Heights of dead entries (< _off) are harmless: rows are relative to cum[_off].
        self._cum = array("q", [0])
        self._extend_cum(self._cells)
