"""RankTable: one row per global rank, drawn from the JobView, only the rows on screen.

A ScrollView (like :class:`~elastic_console.widgets.log_view.LogView`), not a
DataTable: with 1,024 ranks and a few cells changing every second, DataTable's per-cell
Text objects, its render caches and its whole-table sort cost tens of milliseconds in the
middle of key presses. Here a row is a tuple of plain strings (:func:`row_values`) turned into
a handful of Segments when it is drawn; nothing else is kept per rank.

:meth:`RankTable.sync` is called a few times a second by the app:

* the row order (a list of ranks) comes from the JobView's facts, never from cell text. It is
  recomputed when ranks appear or disappear and with ``full=True`` (about once a second);
  the cursor stays on the same rank;
* only the rows on screen are recomputed and compared with what was drawn; the widget is
  repainted only when one of them changed, so a tick costs a few dozen comparisons whatever
  the number of ranks. Rows scrolled into view are computed when they are drawn.

Row 0 of the widget is the header (it does not scroll). ``o`` cycles the sort column, ``O``
reverses it (app keys); clicking a header sorts by that column, clicking a row selects it.
Moving the cursor posts :class:`RankTable.RankHighlighted` when the selected rank changes.

Narrow terminals (issue 15): the columns shown depend on the widget's width. When the row does
not fit, columns are dropped in :data:`DROP_ORDER` (LOCAL, PID, RSS, CPU%, HOST) until it does,
so RANK, STATE, RESTARTS, EXIT and QUIET are the last ones standing (at 80 columns: all but
LOCAL and PID). The shown ones keep their order. This is worked out when the widget is resized
or the number of ranks changes (a vertical scrollbar takes width), never per frame. ``o`` steps
through the shown columns only; a sort by a column that a resize hid is kept (the title still
says what the rows are sorted by: shuffling them because the window shrank would lose the
user's place). :meth:`RankTable.wanted_height` is the height that shows every rank; the table
posts :class:`RankTable.HeightWanted` when it changes (the app fits the layout to it).

Untrusted text: host names come from the job. Every cell is sanitized and drawn as plain
Segments (never markup); SGR colours in a host name are decoded like any other job text.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate
from typing import Any, ClassVar

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.strip import Strip

from elastic_agent.coordination.text import sanitize

from ..state import JobView, RankState
from .common import RANK_STATE_STYLES, RowCursor, fit_row, fmt_age, fmt_bytes, safe_text

__all__ = ["COLUMNS", "DROP_ORDER", "RankTable", "fit_columns", "row_values"]

#: (key, header, width, right-aligned)
COLUMNS: tuple[tuple[str, str, int, bool], ...] = (
    ("rank", "RANK", 4, True),
    ("host", "HOST", 10, False),
    ("local", "LOCAL", 5, True),
    ("pid", "PID", 7, True),
    ("state", "STATE", 10, False),
    ("restarts", "RESTARTS", 8, True),
    ("exit", "EXIT", 7, True),
    ("cpu", "CPU%", 4, True),
    ("rss", "RSS", 9, True),
    ("line", "QUIET", 6, True),  # seconds since the rank's last log line
)
_KEYS = tuple(c[0] for c in COLUMNS)
#: Cells of padding on each side of a column's text.
PAD = 1
#: The columns given up, first to last, when the row is wider than the table (see the module
#: docstring): the ones that are not in this list are always shown.
DROP_ORDER = ("local", "pid", "rss", "cpu", "host")
ALL_COLUMNS = tuple(range(len(COLUMNS)))


def row_width(columns: tuple[int, ...]) -> int:
    """Cells of a row made of ``columns`` (indices into :data:`COLUMNS`)."""
    return sum(COLUMNS[i][2] + 2 * PAD for i in columns)


def fit_columns(width: int) -> tuple[int, ...]:
    """The columns shown in ``width`` cells (indices into :data:`COLUMNS`, in display order):
    every column, less the first ones of :data:`DROP_ORDER` as long as the row is too wide."""
    shown = list(ALL_COLUMNS)
    for key in DROP_ORDER:
        if row_width(tuple(shown)) <= width:
            break
        shown.remove(_KEYS.index(key))
    return tuple(shown)


ROW_WIDTH = row_width(ALL_COLUMNS)
_STATE_ORDER = {"failed": 0, "stalled": 1, "restarting": 2, "waiting": 3, "stopped": 4,
                "running": 5, "exited": 6}
_EXIT_BAD = Style(color="red")
_DIM = Style(dim=True)
_NO_STYLE = Style()


def _exit_sort(r: RankState) -> tuple[int, str]:
    e = r.last_exit
    if e is None:
        return (0, "")
    if isinstance(e, int):
        return (1 if e == 0 else 2, f"{abs(e):08d}")
    return (3, str(e))


#: Sort keys from the JobView's facts (never from cell text); ties broken by rank.
SORT_KEYS: dict[str, Callable[[RankState], Any]] = {
    "rank": lambda r: r.rank,
    "host": lambda r: (r.host, r.local_rank if r.local_rank is not None else -1, r.rank),
    "local": lambda r: (r.local_rank if r.local_rank is not None else -1, r.rank),
    "pid": lambda r: (r.pid or 0, r.rank),
    "state": lambda r: (_STATE_ORDER.get(r.state, 9), r.rank),
    "restarts": lambda r: (r.restarts, r.rank),
    "exit": lambda r: (_exit_sort(r), r.rank),
    "cpu": lambda r: (r.cpu if r.cpu is not None else -1.0, r.rank),
    "rss": lambda r: (r.rss if r.rss is not None else -1, r.rank),
    "line": lambda r: (r.last_line_ms, r.rank),
}


def row_values(r: RankState, now_ms: int) -> tuple[str, ...]:
    """The plain text of each cell of rank ``r`` (what is compared and drawn)."""
    since = fmt_age(max(0, now_ms - r.last_line_ms) / 1000) if r.last_line_ms and now_ms else "-"
    return (
        str(r.rank),
        r.host or "-",
        "-" if r.local_rank is None else str(r.local_rank),
        "-" if r.pid is None else str(r.pid),
        r.state,
        str(r.restarts),
        "-" if r.last_exit is None else str(r.last_exit),
        "-" if r.cpu is None else f"{r.cpu:.0f}",
        fmt_bytes(r.rss),
        since,
    )


def _cell_style(key: str, value: str) -> Style:
    if key == "state":
        return RANK_STATE_STYLES.get(value, _NO_STYLE)
    if key == "exit" and value not in ("-", "0"):
        return _EXIT_BAD
    if value == "-":
        return _DIM
    return _NO_STYLE


def _fit(text: str, width: int, right: bool) -> str:
    """``text`` in exactly ``width`` cells: cut with an ellipsis, padded on the left when
    ``right``."""
    cells = cell_len(text)
    if cells > width:
        return set_cell_size(text, width - 1) + "…"
    pad = " " * (width - cells)
    return pad + text if right else text + pad


def row_segments(values: tuple[str, ...], base: Style, render_ansi: Callable[..., list[Segment]],
                 columns: tuple[int, ...] = ALL_COLUMNS) -> list[Segment]:
    """One rank's row of ``columns`` (``row_width(columns)`` cells): padding in ``base``, each
    text in ``base`` plus its column's colour. ``render_ansi(text, style, width)`` draws a cell
    whose (sanitized) text still carries SGR colours."""
    pad = Segment(" " * PAD, base)
    out: list[Segment] = []
    for i in columns:
        key, _, width, right = COLUMNS[i]
        value = values[i]
        text = sanitize(value)
        style = base + _cell_style(key, value)
        out.append(pad)
        if "\x1b" in text:  # only SGR is left after sanitize
            out.extend(render_ansi(text, style, width, right))
        else:
            out.append(Segment(_fit(text, width, right), style))
        out.append(pad)
    return out


def header_segments(style: Style, sorted_by: str, reverse: bool,
                    columns: tuple[int, ...] = ALL_COLUMNS) -> list[Segment]:
    """The header row of ``columns``: each label aligned like its column, the sort column
    marked in its right padding cell (a wider label would be cut)."""
    pad = " " * PAD
    mark = pad[:-1] + ("▼" if reverse else "▲")
    return [Segment(pad + _fit(label, width, right) + (mark if key == sorted_by else pad), style)
            for key, label, width, right in (COLUMNS[i] for i in columns)]


class RankTable(RowCursor):
    """The ranks of the job (see the module docstring)."""

    ALLOW_SELECT = False

    COMPONENT_CLASSES: ClassVar[set[str]] = {"rank-table--header", "rank-table--cursor"}

    DEFAULT_CSS = """
    RankTable {
        background: $surface;
        color: $foreground;
        overflow-y: auto;
        overflow-x: auto;
        &:focus {
            background-tint: $foreground 5%;
            & > .rank-table--cursor {
                background: $block-cursor-background;
                color: $block-cursor-foreground;
                text-style: $block-cursor-text-style;
            }
            & > .rank-table--header { background-tint: $foreground 5%; }
        }
        & > .rank-table--header {
            text-style: bold;
            background: $panel;
            color: $foreground;
        }
        &:ansi > .rank-table--header {
            background: ansi_bright_blue;
            color: ansi_default;
        }
        & > .rank-table--cursor {
            background: $block-cursor-blurred-background;
            color: $block-cursor-blurred-foreground;
            text-style: $block-cursor-blurred-text-style;
        }
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "cursor_up", "Up", show=False, id="ranks.up"),
        Binding("down,j", "cursor_down", "Down", show=False, id="ranks.down"),
        Binding("pageup", "page_up", "Page up", show=False, id="ranks.page_up"),
        Binding("pagedown", "page_down", "Page down", show=False, id="ranks.page_down"),
        Binding("home,g", "first", "First rank", show=False, id="ranks.first"),
        Binding("end,G", "last", "Last rank", show=False, id="ranks.last"),
        Binding("left", "scroll_left", "Left", show=False, id="ranks.left"),
        Binding("right", "scroll_right", "Right", show=False, id="ranks.right"),
    ]

    # ``cursor_row`` (RowCursor): row of the cursor (0 = the first rank, below the header).

    class RankHighlighted(Message):
        """The rank under the cursor changed (None: the table is empty)."""

        def __init__(self, table: RankTable, rank: int | None) -> None:
            super().__init__()
            self.table = table
            self.rank = rank

        @property
        def control(self) -> RankTable:
            return self.table

    class HeightWanted(Message):
        """:meth:`RankTable.wanted_height` changed (ranks came or went, a scrollbar)."""

    class SortChanged(Message):
        """The sort order changed by a header click (the app tells the user)."""

        def __init__(self, description: str) -> None:
            super().__init__()
            self.description = description

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.sort_column = "rank"
        self.sort_reverse = False
        self._order: list[int] = []  # ranks in row order
        self._shown: dict[int, tuple[str, ...]] = {}  # rank -> cell texts last drawn
        self._rows: dict[int, list[Segment]] = {}  # rank -> its drawn row (not the cursor's)
        self._view: JobView | None = None
        self._now_ms = 0
        self._highlighted: int | None = None  # the rank last announced by RankHighlighted
        self._styles: tuple[Style, Style, Style] | None = None  # base, header, cursor
        # The columns shown (indices into COLUMNS), where each starts, the row's width: fitted
        # to the widget's width by _fit_columns.
        self._columns: tuple[int, ...] = ALL_COLUMNS
        self._starts: tuple[int, ...] = ()
        self._row_width = ROW_WIDTH
        self._set_columns(ALL_COLUMNS)
        self._wanted_height = 0  # the height last announced by HeightWanted

    # -- queries -----------------------------------------------------------------------------
    @property
    def row_count(self) -> int:
        return len(self._order)

    @property
    def selected_rank(self) -> int | None:
        """The rank under the cursor, or None when the table is empty."""
        if not self._order:
            return None
        return self._order[min(self.cursor_row, len(self._order) - 1)]

    def order(self) -> list[int]:
        """Ranks in row order (top to bottom)."""
        return list(self._order)

    def shown_row(self, rank: int) -> tuple[str, ...] | None:
        """The cell texts last drawn (or compared on screen) for ``rank``; None if never."""
        return self._shown.get(rank)

    @property
    def columns(self) -> tuple[str, ...]:
        """The keys of the columns shown, left to right."""
        return tuple(_KEYS[i] for i in self._columns)

    def wanted_height(self) -> int:
        """The outer height that shows the header and every rank (and the horizontal
        scrollbar when even the fewest columns are wider than the table), as last announced
        by :class:`HeightWanted` (0: not yet). Worked out when the columns are fitted: in
        between, the width may have changed before the columns followed."""
        return self._wanted_height

    def sort_description(self) -> str:
        label = dict((k, h) for k, h, _, _ in COLUMNS)[self.sort_column]
        return f"sorted by {label.lower()}{' (reversed)' if self.sort_reverse else ''}"

    # -- updates -----------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every row (another job)."""
        self._order = []
        self._shown.clear()
        self._rows.clear()
        self._view = None
        self.set_reactive(RankTable.cursor_row, 0)
        self._resize()
        self._announce()

    def sync(self, view: JobView, now_ms: int, *, full: bool) -> None:
        """Bring the table up to date with ``view`` (see the module docstring)."""
        self._view, self._now_ms = view, now_ms
        ranks = view.ranks
        if len(ranks) != len(self._order) or any(r not in ranks for r in self._order):
            gone = [r for r in self._shown if r not in ranks]
            for rank in gone:
                self._shown.pop(rank, None)
                self._rows.pop(rank, None)
            full = True
        if full:
            self._apply_order(view)
        self._sync_visible()

    def cycle_sort(self, reverse: bool = False) -> str:
        """``o``: next sort column; ``O``: reverse the order. Returns a description."""
        if reverse:
            self.sort_reverse = not self.sort_reverse
        else:
            # The next column shown (RANK is always shown): the user sees what sorts.
            i = _KEYS.index(self.sort_column)
            shown = self.columns
            self.sort_column = next((k for k in _KEYS[i + 1:] + _KEYS[:i + 1] if k in shown),
                                    "rank")
            self.sort_reverse = False
        self._resort()
        return self.sort_description()

    def sort_by(self, column: str) -> None:
        """Sort by ``column``; the same column again reverses the order (header clicks)."""
        if column == self.sort_column:
            self.sort_reverse = not self.sort_reverse
        else:
            self.sort_column, self.sort_reverse = column, False
        self._resort()

    def _resort(self) -> None:
        self.refresh()  # the header's sort mark
        if self._view is not None:
            self._apply_order(self._view)
            self._sync_visible()

    def _apply_order(self, view: JobView) -> None:
        keyfn = SORT_KEYS[self.sort_column]
        ranks = view.ranks
        order = sorted(ranks, key=lambda r: keyfn(ranks[r]), reverse=self.sort_reverse)
        if order == self._order:
            return
        selected = self.selected_rank
        resized = len(order) != len(self._order)
        self._order = order
        if resized:
            self._resize()
        if selected is not None and selected in ranks:
            row = order.index(selected)
        else:
            row = min(self.cursor_row, max(0, len(order) - 1))
        self._move_cursor(row)
        self.refresh()

    def _visible_rows(self) -> range:
        top = max(0, round(self.scroll_y))
        height = max(1, self.scrollable_content_region.height - 1)  # minus the header row
        return range(top, min(len(self._order), top + height))

    def _sync_visible(self) -> None:
        view = self._view
        if view is None:
            return
        ranks = view.ranks
        changed = False
        for i in self._visible_rows():
            rank = self._order[i]
            rs = ranks.get(rank)
            if rs is None:
                continue
            values = row_values(rs, self._now_ms)
            if values != self._shown.get(rank):
                self._shown[rank] = values
                self._rows.pop(rank, None)
                changed = True
        if changed:
            self.refresh()

    def _resize(self) -> None:
        self._fit_columns()  # a vertical scrollbar may come or go with the rows
        self.virtual_size = Size(self._row_width, len(self._order) + 1)
        self._announce_height()

    # -- the columns shown ----------------------------------------------------------------------
    def on_resize(self, event: events.Resize) -> None:
        self._resize()

    def _fit_width(self) -> int:
        """Cells for a row: inside the border, less the vertical scrollbar when the ranks do
        not all fit in the height (the scrollbar takes width before the columns do)."""
        width, height = self.container_size
        if len(self._order) + 1 > height:
            width -= self.styles.scrollbar_size_vertical
        return width

    def _fit_columns(self) -> None:
        if not self.container_size.width:
            return  # not laid out yet: the first Resize fits them
        columns = fit_columns(self._fit_width())
        if columns != self._columns:
            self._set_columns(columns)
            self._rows.clear()
            self.refresh()

    def _set_columns(self, columns: tuple[int, ...]) -> None:
        self._columns = columns
        self._starts = (0, *accumulate(COLUMNS[i][2] + 2 * PAD for i in columns))
        self._row_width = self._starts[-1]

    def _announce_height(self) -> None:
        height = len(self._order) + 1 + self.styles.gutter.height
        if self.container_size.width and self._row_width > self._fit_width():
            height += self.styles.scrollbar_size_horizontal
        if height != self._wanted_height:
            self._wanted_height = height
            self.post_message(self.HeightWanted())

    # -- the cursor ----------------------------------------------------------------------------
    def _row_count(self) -> int:
        return len(self._order)

    def watch_cursor_row(self, old: int, new: int) -> None:
        super().watch_cursor_row(old, new)
        self._announce()

    def _move_cursor(self, row: int) -> None:
        """Put the cursor on ``row`` without announcing a rank that did not change."""
        self.set_reactive(RankTable.cursor_row, self.validate_cursor_row(row))
        self._scroll_to_cursor()
        self._announce()

    def _announce(self) -> None:
        rank = self.selected_rank
        if rank != self._highlighted:
            self._highlighted = rank
            self.post_message(self.RankHighlighted(self, rank))

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if round(old_value) != round(new_value):
            self._sync_visible()  # rows scrolled into view were not kept current off screen

    def action_scroll_left(self) -> None:
        self.scroll_to(x=max(0, self.scroll_x - 8), animate=False, immediate=True)

    def action_scroll_right(self) -> None:
        self.scroll_to(x=self.scroll_x + 8, animate=False, immediate=True)

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        event.stop()
        if offset.y == 0:  # the header: sort by the column clicked
            x = offset.x + round(self.scroll_x)
            for i, column in enumerate(self._columns):
                if self._starts[i] <= x < self._starts[i + 1]:
                    self.sort_by(_KEYS[column])
                    self.post_message(self.SortChanged(self.sort_description()))
                    return
            return
        row = round(self.scroll_y) + offset.y - 1
        if row < len(self._order):
            self.cursor_row = row

    # -- rendering -------------------------------------------------------------------------------
    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._styles = None
        self._rows.clear()

    def _get_styles(self) -> tuple[Style, Style, Style]:
        styles = self._styles
        if styles is None:
            base = self.rich_style
            styles = self._styles = (
                base,
                base + self.get_component_rich_style("rank-table--header", partial=True),
                base + self.get_component_rich_style("rank-table--cursor", partial=True),
            )
        return styles

    def _render_ansi(self, text: str, style: Style, width: int, right: bool) -> list[Segment]:
        rich_text = safe_text(text, style, no_wrap=True)
        rich_text.truncate(width, overflow="ellipsis", pad=False)
        if right:
            rich_text.pad_left(width - rich_text.cell_len)
        else:
            rich_text.pad_right(width - rich_text.cell_len)
        return list(rich_text.render(self.app.console))

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.scrollable_content_region.width
        base, header, cursor = self._get_styles()
        if y == 0:
            segments = header_segments(header, self.sort_column, self.sort_reverse,
                                       self._columns)
            return fit_row(segments, self._row_width, scroll_x, width, header)
        i = scroll_y + y - 1
        if i >= len(self._order) or self._view is None:
            return Strip.blank(width, base)
        rank = self._order[i]
        values = self._shown.get(rank)
        if values is None:  # never drawn (scrolled into view between two syncs)
            rs = self._view.ranks.get(rank)
            if rs is None:
                return Strip.blank(width, base)
            values = self._shown[rank] = row_values(rs, self._now_ms)
        if i == self.cursor_row:
            segments = row_segments(values, cursor, self._render_ansi, self._columns)
            return fit_row(segments, self._row_width, scroll_x, width, cursor)
        row = self._rows.get(rank)
        if row is None:
            row = self._rows[rank] = row_segments(values, base, self._render_ansi,
                                                  self._columns)
        return fit_row(list(row), self._row_width, scroll_x, width, base)
