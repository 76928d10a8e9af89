"""Identical output of many ranks, shown once: ``×512 ranks [0-511] Traceback (most ...``.

When every rank of a big job prints the same traceback (pytorch/pytorch#60910: 512 copies
of it), the interleaved log is unreadable. Here a line is *identical* to an earlier one when
it has the same stream and the same text (the rank is a field of its own, never part of the
text) and was printed by a rank that has not printed it yet, within ``window_ms`` of server
time after the first copy. Such lines join the first copy's *group*: one row, kept where the
first copy came (order of first appearance), whose count and rank ranges grow as more ranks
print it. The same rank printing the same text again starts a new group (it is a new thing
happening, e.g. the next epoch's banner), and so does a copy that comes after the window.
Each line of a 30-line traceback is its own group, so 512 identical tracebacks become one
block of 30 rows, each ``×512 ranks [0-511]``.

Memory is bounded: at most ``open_limit`` groups are open (accept more ranks) and at most
``member_limit`` ranks are remembered over all of them; past either, the oldest groups close
(their rows stay as they were last drawn).

:class:`UniqueLogs` keeps a :class:`~elastic_console.job.logbuffer.LogBuffer` of such rows next
to the console's interleaved ring (it pulls from it: nothing costs anything while the
toggle is off); :class:`Collapser` is the pure rule, also used by ``elastic-console logs
--dedupe``. No Textual, no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from elastic_agent.coordination.wire.stack_dumps import format_ranks

from .logbuffer import LogBuffer, LogRing

__all__ = ["Collapser", "Group", "UniqueLogs", "collapsed_label", "format_ranks"]

#: A copy printed later than this after the first one (server time) starts a new group.
WINDOW_MS = 10_000
OPEN_LIMIT = 4_096
MEMBER_LIMIT = 262_144
#: Lines of the source remembered for a redraw in place (a progress bar) to find its row.
_RECENT = 8_192
_LIVE_LIMIT = 4_096
_DIM, _RESET = "\x1b[2m", "\x1b[0m"
#: Rows relabelled per sync (see UniqueLogs._flush); below logbuffer.EDITS_KEPT.
RELABEL_LIMIT = 256


def collapsed_label(ranks: Iterable[int]) -> str:
    """``×512 ranks [0-511]``."""
    members = set(ranks)
    return f"×{len(members)} ranks [{format_ranks(members)}]"


class Group:
    """One row: a line and the ranks that printed it (``ranks``, first one ``rank``)."""

    __slots__ = ("first_ms", "handle", "key", "rank", "ranks", "stamp", "stream", "text")

    def __init__(self, ms: int, rank: int, stream: str, text: str, handle: int = -1) -> None:
        self.first_ms = ms
        self.rank = rank
        self.stream = stream
        self.text = text
        self.key = (stream, text)
        self.ranks = {rank}
        self.handle = handle  # where the caller put the row (UniqueLogs: its seq)
        self.stamp = 0.0  # the caller's own time of the first copy (logs -f: when to print)

    @property
    def count(self) -> int:
        return len(self.ranks)

    def label(self) -> str:
        return collapsed_label(self.ranks)


class Collapser:
    """The rule of the module docstring: :meth:`add` each line in order of arrival.

    Open groups live in two generations of dicts: when the young one holds ``open_limit``
    groups (or the ranks remembered pass ``member_limit``), the old one is dropped and the
    young one becomes old. Eviction is then O(1) amortized, with no per-line bookkeeping, and
    between ``open_limit`` and twice that many of the newest groups are open. A line no
    other rank printed (yet) is held as a plain tuple, not a :class:`Group`: most lines of a
    job are such lines, and the console takes in a full 200k-line ring when the toggle is
    pressed.
    """

    def __init__(self, window_ms: int = WINDOW_MS, open_limit: int = OPEN_LIMIT,
                 member_limit: int = MEMBER_LIMIT) -> None:
        self.window_ms = window_ms
        self.open_limit = max(1, open_limit)
        self.member_limit = max(1, member_limit)
        # (stream, text) -> Group, or (first_ms, rank, handle) while one rank printed it
        self._young: dict[tuple[str, str], Any] = {}
        self._old: dict[tuple[str, str], Any] = {}
        self._members = 0  # ranks of the groups in both generations

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def add(self, ms: int, rank: int, stream: str, text: str, handle: int = -1
            ) -> tuple[int, Group | None]:
        """Where the line goes: ``(handle, None)`` for a new row (``handle`` is the caller's
        name for it), ``(row's handle, its group)`` when it joins an earlier row."""
        key = (stream, text)
        held = self._young.get(key)
        if held is None:
            held = self._old.pop(key, None)
            if held is not None:
                self._young[key] = held
        if held is not None:
            if type(held) is tuple:
                first_ms, first_rank, row = held
                if rank != first_rank and -self.window_ms <= ms - first_ms <= self.window_ms:
                    g = self._young[key] = Group(first_ms, first_rank, stream, text, row)
                    g.ranks.add(rank)
                    self._grew(2)
                    return row, g
            # Node streams interleave by server time only roughly: either side of the window.
            elif rank not in held.ranks and -self.window_ms <= ms - held.first_ms <= self.window_ms:
                held.ranks.add(rank)
                self._grew(1)
                return held.handle, held
        self._young[key] = (ms, rank, handle)  # (closes the group it replaces, if any)
        if len(self._young) >= self.open_limit:
            self._rotate()
        return handle, None

    def close(self, stream: str, text: str, handle: int) -> None:
        """The row ``handle`` of that line takes no more ranks (a no-op if it is closed)."""
        key = (stream, text)
        for gen in (self._young, self._old):
            held = gen.get(key)
            if held is not None and (held[2] if type(held) is tuple else held.handle) == handle:
                del gen[key]
                if type(held) is not tuple:
                    self._members -= len(held.ranks)

    def _grew(self, n: int) -> None:
        self._members += n
        if self._members > self.member_limit:
            self._rotate()

    def _rotate(self) -> None:
        self._old = self._young
        self._young = {}
        self._members = sum(len(g.ranks) for g in self._old.values() if type(g) is not tuple)
        if self._members > self.member_limit:
            self._old = {}
            self._members = 0


class UniqueLogs:
    """The rows of :class:`Collapser` over a source ring (the console's all-ranks ring), as a
    :class:`LogBuffer` a LogView can show. Call :meth:`sync` before the view's
    ``on_new_lines``: it takes in the lines appended (and redrawn in place) since the last
    call and redraws the rows whose rank count changed, once per call (the label of a
    group that grows by 500 ranks in one refresh is formatted once, not 500 times).

    A row is ``(first_ms, first_rank, stream, text)``; a group's row starts with a dim
    ``×N ranks [ranges]`` label (an SGR sequence, which the view renders and its filter does
    not see as text). A line a worker redraws in place replaces its row if no other rank
    shares it; a rank whose shared line changes leaves the group, and its new state is a
    row of its own, at the end.
    """

    def __init__(self, source: LogRing, capacity: int | None = None,
                 collapser: Collapser | None = None) -> None:
        self.source = source
        self.buffer = LogBuffer(capacity or source.capacity)
        self.collapser = collapser or Collapser()
        self._seen = source.first_seq  # lines of the source already taken in
        self._edits = source.edits
        self._dirty: dict[int, Group] = {}  # row handle -> group whose label is stale
        self._groups: dict[int, Group] = {}  # row handle -> its group (rows of 2+ ranks)
        self._recent: list[tuple[int, int] | None] = [None] * _RECENT  # seq -> (seq, row)
        self._live: dict[int, int] = {}  # source seq -> row, for lines redrawn in place

    @property
    def pending(self) -> int:
        """Lines of the source not taken in yet (a :meth:`sync` with a ``limit`` leaves some)."""
        return max(0, self.source.total_appended - max(self._seen, self.source.first_seq))

    def sync(self, limit: int | None = None) -> int:
        """Take in what the source got since the last call (at most ``limit`` lines, oldest
        first: rows go in order of first appearance). Returns lines taken in."""
        src = self.source
        if src.edits != self._edits:
            self._take_edits(src)
        start = max(self._seen, src.first_seq)
        end = src.total_appended if limit is None else min(src.total_appended, start + limit)
        lines = src.lines_between(start, end)
        self._seen = end
        if lines:
            self._feed(start, lines)
        self._flush()
        return len(lines)

    def _feed(self, start: int, lines: list[Any]) -> None:
        c = self.collapser
        add, recent, dirty = c.add, self._recent, self._dirty
        young, old, limit = c._young, c._old, c.open_limit
        rows: list[Any] = []
        base = self.buffer.total_appended
        seq = start
        for line in lines:
            try:
                ms, rank, stream, text = line
            except (TypeError, ValueError):
                seq += 1
                continue
            key = (stream, text)
            row = base + len(rows)
            if key not in young and key not in old:  # the common case, inlined: a new row
                young[key] = (ms, rank, row)
                rows.append(line)  # the source's own tuple: shared, not copied
                if len(young) >= limit:
                    c._rotate()
                    young, old = c._young, c._old
            else:
                row, g = add(ms, rank, stream, text, row)
                young, old = c._young, c._old  # (add may have rotated them)
                if g is None:
                    rows.append(line)
                else:
                    dirty[row] = g
            recent[seq % _RECENT] = (seq, row)
            seq += 1
        self.buffer.extend(rows)

    def _flush(self) -> None:
        buf, groups, dirty = self.buffer, self._groups, self._dirty
        # At most RELABEL_LIMIT rows per call, the longest waiting first: a label costs a
        # sort of its ranks, and a view takes in at most EDITS_KEPT replaced rows without
        # a rescan. The rest are relabelled by the next calls.
        for row in list(itertools.islice(dirty, RELABEL_LIMIT)):
            g = groups[row] = dirty.pop(row)
            buf.replace(row, (g.first_ms, g.rank, g.stream, _row_text(g)))  # type: ignore[arg-type]
        if len(groups) > 2 * _LIVE_LIMIT:  # forget the groups whose rows fell off
            first = buf.first_seq
            self._groups = {r: g for r, g in groups.items() if r >= first}
            if len(self._groups) > _LIVE_LIMIT:
                self._groups = dict(list(self._groups.items())[-_LIVE_LIMIT:])

    def _take_edits(self, src: LogRing) -> None:
        seqs = src.edited_since(self._edits)
        self._edits = src.edits
        for seq in dict.fromkeys(seqs or ()):  # (None: too many to know which; rows stay)
            if seq >= self._seen or seq < src.first_seq:
                continue  # not taken in yet (it will be, as it is now), or gone
            row = self._live.get(seq)
            if row is None:
                held = self._recent[seq % _RECENT]
                if held is None or held[0] != seq:
                    continue  # too old to find its row: it stays as it was drawn
                row = held[1]
            try:
                ms, rank, stream, text = src.get(seq)
                _, _, old_stream, old_text = self.buffer.get(row)
            except (TypeError, ValueError, IndexError):
                continue
            g = self._dirty.get(row) or self._groups.get(row)
            if g is None:  # its own row: the row is the line, redrawn
                self.collapser.close(old_stream, old_text, row)  # a changing line collects no ranks
                self.buffer.replace(row, (ms, rank, stream, text))  # type: ignore[arg-type]
            else:
                self.collapser.close(g.stream, g.text, row)
                g.ranks.discard(rank)
                self._dirty[row] = g
                row = self.buffer.total_appended
                self.buffer.append((ms, rank, stream, text))  # type: ignore[arg-type]
            self._live[seq] = row
            if len(self._live) > _LIVE_LIMIT:
                for old in list(self._live)[: _LIVE_LIMIT // 2]:
                    del self._live[old]


def _row_text(g: Group) -> str:
    if len(g.ranks) == 1:
        return g.text
    return f"{_DIM}{g.label()}{_RESET} {g.text}"
