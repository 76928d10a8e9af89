"""RankTable: one row per global rank, drawn from the JobView, only the rows on screen.

A ScrollView (like :class:`~elastic_console.tui.widgets.log_view.LogView`), not a
DataTable: with 1,024 ranks and a few cells changing every second, DataTable's per-cell
Text objects, its render caches and its whole-table sort cost tens of milliseconds in the
middle of key presses. Here a row is a tuple of plain strings
(:func:`~.rank_rows.row_values`) turned into a handful of Segments when it is drawn; nothing
else is kept per rank. The rows as data (the columns, the sort keys, the cell texts, a row's
Segments) are :mod:`.rank_rows`'s; this module is the widget: the order, the cursor, the
columns that fit, the drawing.

:meth:`RankTable.sync` is called a few times a second by the app:

* the row order (a list of ranks) comes from the JobView's facts, never from cell text. It is
  recomputed when ranks appear or disappear and with ``full=True`` (about once a second),
  except in rank order, which only the ranks themselves change (sorting 32,768 ranks by a
  key was 15-30 ms of a tick); the cursor stays on the same rank;
* only the rows on screen are recomputed and compared with what was drawn; the widget is
  repainted only when one of them changed, so a tick costs a few dozen comparisons whatever
  the number of ranks. Rows scrolled into view are computed when they are drawn.

Row 0 of the widget is the header (it does not scroll). ``o`` cycles the sort column, ``O``
reverses it (app keys); clicking a header sorts by that column, clicking a row selects it.
Moving the cursor posts :class:`RankTable.RankHighlighted` when the selected rank changes.

Narrow terminals (issue 15): the columns shown depend on the widget's width. When the row does
not fit, columns are dropped in :data:`~.rank_rows.DROP_ORDER` (LOCAL, PID, RSS, CPU%, HOST) until it does,
so RANK, STATE, RESTARTS, EXIT and QUIET are the last ones standing (at 80 columns: all but
LOCAL and PID). The shown ones keep their order. This is worked out when the widget is resized
or the number of ranks changes (a vertical scrollbar takes width), never per frame. ``o`` steps
through the shown columns only; a sort by a column that a resize hid is kept (the title still
says what the rows are sorted by: shuffling them because the window shrank would lose the
user's place). :meth:`RankTable.wanted_height` is the height that shows every rank; the table
posts :class:`RankTable.HeightWanted` when it changes (the app fits the layout to it).

By node (issue 21: 32,768 ranks are 4,096 screens of rows): ``n`` toggles a view with one row
per node (:data:`~.rank_rows.NODE_COLUMNS`): its host, its ranks, its worst rank's state and the count of
its ranks in each state (worst first), the most restarts, the worst exit, the mean CPU%, the
RSS of all its ranks and the longest QUIET. Nodes are ordered worst state first, then by their
first rank, so a failed or stalled node is the top row whatever the job's size. The rank a node
row stands for (:attr:`RankTable.selected_rank`: the resources panel, one rank's log, ``K``) is
its worst rank. ``enter`` or ``n`` on a node goes back to the ranks, the cursor on that rank.
The grouping is made with the order (about once a second, O(ranks)); a node row's cells are
computed only while it is on screen, from its few ranks. :meth:`RankTable.goto` jumps to a rank
(its number) or a host or node id (exact, else the first that starts with it, else the first
that contains it, case-insensitive); the app asks for it with ``:`` or a digit typed here
(:class:`RankTable.GotoRequested`).

Training (issue 32's metrics): once any rank printed a step (``JobView.metrics.any_step``) the
table shows STEP and STEPS/S after the other columns (:data:`~.rank_rows.STEP_COLUMNS`; at 80
columns RSS and CPU% give way to them), the slowest rank's STEP highlighted (the fold's summary,
worked out at most once a second at scale); ``o`` sorts by them too.

Untrusted text: host names come from the job. Every cell is sanitized and drawn as plain
Segments (never markup); SGR colours in a host name are decoded like any other job text.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any, ClassVar

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.strip import Strip

from elastic_agent.coordination.wire.text import sanitize
from elastic_console.job.state import JobView

from .common import RowCursor, fit_row, safe_text
from .rank_rows import (
    ALL_COLUMNS,
    COLUMN_KEYS,
    COLUMNS,
    DROP_ORDER,
    METRIC_SORT_KEYS,
    NODE_COLUMNS,
    NODE_DROP_ORDER,
    NODE_STEP_COLUMNS,
    PAD,
    ROW_WIDTH,
    SORT_KEYS,
    STATE_ORDER,
    STEP_COLUMNS,
    fit_columns,
    header_segments,
    node_key,
    node_step_values,
    node_values,
    row_segments,
    row_values,
    step_values,
    worst_first,
)

__all__ = ["RankTable"]


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
        Binding("enter", "open_node", "Its ranks", show=False, id="ranks.open_node"),
        # A digit starts typing a rank to go to (the app's prompt, as ``:`` opens it).
        *(Binding(str(d), f"goto('{d}')", show=False) for d in range(10)),
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
        """The sort order changed by a header click, or the view by ``enter`` on a node (the
        app tells the user)."""

        def __init__(self, description: str) -> None:
            super().__init__()
            self.description = description

    class GotoRequested(Message):
        """A digit was typed here: the app asks where to go, starting with ``text``."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.sort_column = "rank"
        self.sort_reverse = False
        #: One row per node (see the module docstring) rather than per rank.
        self.by_node = False
        #: The training columns (STEP, STEPS/S) are shown: some rank has a step.
        self.steps = False
        self._slowest: int | None = None  # the rank whose STEP stands out
        self._spec = COLUMNS
        # Rows in order: ranks, or node keys (node_key) by node.
        self._order: list[Any] = []
        self._order_set: set[Any] = set()  # the same rows, to compare with the view's ranks
        self._shown: dict[Any, tuple[str, ...]] = {}  # row key -> cell texts last drawn
        self._rows: dict[Any, list[Segment]] = {}  # row key -> its drawn row (not the cursor's)
        self._groups: dict[str, list[int]] = {}  # by node: node key -> its ranks, sorted
        self._grouped = 0  # by node: how many ranks the groups were made from
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
    def selected_key(self) -> Any:
        """The row under the cursor: a rank, or by node a node key; None when empty."""
        if not self._order:
            return None
        return self._order[min(self.cursor_row, len(self._order) - 1)]

    @property
    def selected_rank(self) -> int | None:
        """The rank under the cursor (by node: the worst rank of the node under it), or None
        when the table is empty."""
        key = self.selected_key
        if key is None or not self.by_node:
            return key
        return self._worst_rank(key)

    def _worst_rank(self, node: str) -> int | None:
        view = self._view
        ranks = self._groups.get(node, ())
        states = [view.ranks[r] for r in ranks if r in view.ranks] if view is not None else []
        return min(states, key=worst_first).rank if states else None

    def order(self) -> list[Any]:
        """Rows in order (top to bottom): ranks, or by node node keys."""
        return list(self._order)

    def shown_row(self, key: Any) -> tuple[str, ...] | None:
        """The cell texts last drawn (or compared on screen) for the row of ``key`` (a rank,
        or by node a node key); None if never."""
        return self._shown.get(key)

    @property
    def columns(self) -> tuple[str, ...]:
        """The keys of the columns shown, left to right."""
        return tuple(self._spec[i][0] for i in self._columns)

    def wanted_height(self) -> int:
        """The outer height that shows the header and every rank (and the horizontal
        scrollbar when even the fewest columns are wider than the table), as last announced
        by :class:`HeightWanted` (0: not yet). Worked out when the columns are fitted: in
        between, the width may have changed before the columns followed."""
        return self._wanted_height

    def sort_description(self) -> str:
        if self.by_node:
            return "worst state first (n: by rank)"
        label = dict((k, h) for k, h, _, _ in STEP_COLUMNS)[self.sort_column]
        return f"sorted by {label.lower()}{' (reversed)' if self.sort_reverse else ''}"

    # -- updates -----------------------------------------------------------------------------
    def _forget_rows(self) -> None:
        self._order = []
        self._order_set = set()
        self._shown.clear()
        self._rows.clear()
        self._groups = {}
        self._grouped = 0

    def reset(self) -> None:
        """Forget every row (another job)."""
        self._forget_rows()
        self._view = None
        self.set_reactive(RankTable.cursor_row, 0)
        self._resize()
        self._announce()

    def sync(self, view: JobView, now_ms: int, *, full: bool) -> None:
        """Bring the table up to date with ``view`` (see the module docstring)."""
        self._view, self._now_ms = view, now_ms
        ranks = view.ranks
        metrics = view.metrics
        if metrics.any_step != self.steps:
            self._show_steps(metrics.any_step)
            full = True
        if self.steps:
            slowest = metrics.summary().slowest
            if slowest != self._slowest:
                self._slowest = slowest
                full = True
        if self.by_node:
            # Ranks came or went (a node joined, an elastic shrink): group them again. A rank
            # that moves to another node comes with a new start, i.e. within a second.
            if len(ranks) != self._grouped:
                self._shown.clear()
                self._rows.clear()
                full = True
        # The same ranks? A set comparison in C: 4 times a second over 32,768 ranks, a
        # generator was 1-5 ms of every tick.
        elif len(ranks) != len(self._order) or ranks.keys() != self._order_set:
            gone = [r for r in self._shown if r not in ranks]
            for rank in gone:
                self._shown.pop(rank, None)
                self._rows.pop(rank, None)
            full = True
        elif self.sort_column == "rank":
            full = False  # the same ranks in rank order: nothing to sort again
        if full:
            self._apply_order(view)
        self._sync_visible()

    def cycle_sort(self, reverse: bool = False) -> str:
        """``o``: next sort column; ``O``: reverse the order. Returns a description. By node
        the order is fixed (worst first): nothing changes."""
        if self.by_node:
            return self.sort_description()
        if reverse:
            self.sort_reverse = not self.sort_reverse
        else:
            # The next column shown (RANK is always shown): the user sees what sorts.
            i = COLUMN_KEYS.index(self.sort_column)
            shown = self.columns
            self.sort_column = next((k for k in COLUMN_KEYS[i + 1:] + COLUMN_KEYS[:i + 1] if k in shown),
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

    def _apply_order(self, view: JobView, target: Any = None) -> None:
        """Order the rows from the view's facts; the cursor stays on the row it was on (or
        goes to ``target``'s)."""
        ranks = view.ranks
        if self.by_node:
            order = self._group(view)
        elif self.sort_column in METRIC_SORT_KEYS:
            metric_key, latest = METRIC_SORT_KEYS[self.sort_column], view.metrics.latest
            order = sorted(ranks, key=lambda r: metric_key(latest.get(r), r),
                           reverse=self.sort_reverse)
        else:
            keyfn = SORT_KEYS[self.sort_column]
            order = (sorted(ranks, reverse=self.sort_reverse) if self.sort_column == "rank"
                     else sorted(ranks, key=lambda r: keyfn(ranks[r]), reverse=self.sort_reverse))
        if order == self._order and target is None:
            return
        selected = self.selected_key if target is None else target
        resized = len(order) != len(self._order)
        self._order = order
        self._order_set = set(order)
        if resized:
            self._resize()
        known = self._groups if self.by_node else ranks
        if selected is not None and selected in known:
            row = order.index(selected)
        else:
            row = min(self.cursor_row, max(0, len(order) - 1))
        self._move_cursor(row)
        self.refresh()

    def _group(self, view: JobView) -> list[str]:
        """By node: every rank under its node (``_groups``), and the nodes worst first."""
        # Once a second over every rank (32,768: ~10 ms), so inlined: node_key and worst_first as
        # calls took three times as long.
        groups: dict[str, list[int]] = {}
        worst: dict[str, int] = {}
        state_order = STATE_ORDER.get
        for rank, rs in view.ranks.items():
            key = rs.node or rs.host or "?"
            w = state_order(rs.state, 9)
            members = groups.get(key)
            if members is None:
                groups[key] = [rank]
                worst[key] = w
            else:
                members.append(rank)
                if w < worst[key]:
                    worst[key] = w
        for members in groups.values():
            members.sort()  # already in order, as a rule: a pass
        self._groups = groups
        self._grouped = len(view.ranks)
        # Worst state first; then the node of the lowest rank (a stable, readable order).
        return sorted(groups, key=lambda k: (worst[k], groups[k][0]))

    def _values(self, key: Any) -> tuple[str, ...] | None:
        """The cells of the row of ``key`` now (None: it is gone)."""
        view = self._view
        if view is None:
            return None
        if not self.by_node:
            rs = view.ranks.get(key)
            if rs is None:
                return None
            if not self.steps:
                return row_values(rs, self._now_ms)
            return row_values(rs, self._now_ms) + step_values(view.metrics.latest.get(key),
                                                              key == self._slowest)
        ranks = [r for r in self._groups.get(key, ()) if r in view.ranks]
        if not ranks:
            return None
        values = node_values([view.ranks[r] for r in ranks], self._now_ms)
        if not self.steps:
            return values
        latest = view.metrics.latest
        return values + node_step_values([latest[r] for r in ranks if r in latest],
                                         self._slowest in ranks)

    def _spec_now(self) -> tuple[tuple[str, str, int, bool], ...]:
        if self.by_node:
            return NODE_STEP_COLUMNS if self.steps else NODE_COLUMNS
        return STEP_COLUMNS if self.steps else COLUMNS

    def _show_steps(self, on: bool) -> None:
        """Show or hide the training columns (the first step of any rank shows them)."""
        self.steps = on
        self._spec = self._spec_now()
        self._shown.clear()
        self._rows.clear()
        self._columns = ()
        self._set_columns(fit_columns(10_000, self._spec, self._drop_order()))
        self._resize()
        self.refresh()

    # -- by node, and going to a rank or a host -----------------------------------------------
    def set_by_node(self, on: bool, *, rank: int | None = None) -> None:
        """One row per node (``on``) or per rank; the cursor stays on the selected rank (its
        node), or goes to ``rank`` (its node)."""
        rank = self.selected_rank if rank is None else rank
        if on == self.by_node:
            if rank is not None and self._view is not None:
                self._go_to_rank(rank)
            return
        self.by_node = on
        self._spec = self._spec_now()
        self._forget_rows()
        self._columns = ()  # fitted again for the other columns
        self._set_columns(fit_columns(10_000, self._spec, self._drop_order()))
        self._resize()
        self.scroll_to(x=0, animate=False, immediate=True)
        self.refresh()
        view = self._view
        if view is None:
            return
        self._apply_order(view, (node_key(view.ranks[rank]) if on else rank)
                          if rank in view.ranks else None)
        self._sync_visible()

    def _drop_order(self) -> tuple[str, ...]:
        return NODE_DROP_ORDER if self.by_node else DROP_ORDER

    def _go_to_rank(self, rank: int) -> bool:
        view = self._view
        if view is None or rank not in view.ranks:
            return False
        key = node_key(view.ranks[rank]) if self.by_node else rank
        if key not in self._order:
            self._apply_order(view)
        if key not in self._order:
            return False
        self._move_cursor(self._order.index(key))
        return True

    def goto(self, query: str) -> bool:
        """Put the cursor on what ``query`` names (see the module docstring): a rank number
        (by node, the view turns to ranks: a rank was asked for), else a host or node id.
        False when nothing matches (the cursor stays)."""
        text = query.strip()
        view = self._view
        if not text or view is None:
            return False
        if text.isdigit() and text.isascii():
            rank = int(text)
            if rank not in view.ranks:
                return False
            if self.by_node:
                self.set_by_node(False, rank=rank)
                self.post_message(self.SortChanged(self.sort_description()))
                return True
            return self._go_to_rank(rank)
        wanted = text.casefold()
        # The names of each row, in row order: its host and its node id.
        names: list[tuple[str, ...]] = []
        for key in self._order:
            rs = view.ranks.get(self._groups[key][0] if self.by_node else key)
            names.append(() if rs is None else
                         tuple(sanitize(n).casefold() for n in (rs.host, rs.node) if n))
        for matches in (wanted.__eq__, lambda name: name.startswith(wanted),
                        lambda name: wanted in name):
            for row, row_names in enumerate(names):
                if any(matches(name) for name in row_names):
                    self._move_cursor(row)
                    return True
        return False

    def action_goto(self, text: str) -> None:
        self.post_message(self.GotoRequested(text))

    def action_open_node(self) -> None:
        """``enter`` on a node: its ranks (the cursor on its worst one)."""
        if self.by_node and self._order:
            self.set_by_node(False)
            self.post_message(self.SortChanged(self.sort_description()))

    def _visible_rows(self) -> range:
        top = max(0, round(self.scroll_y))
        height = max(1, self.scrollable_content_region.height - 1)  # minus the header row
        return range(top, min(len(self._order), top + height))

    def _sync_visible(self) -> None:
        view = self._view
        if view is None:
            return
        changed = False
        for i in self._visible_rows():
            key = self._order[i]
            values = self._values(key)
            if values is None:
                continue
            if values != self._shown.get(key):
                self._shown[key] = values
                self._rows.pop(key, None)
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
        columns = fit_columns(self._fit_width(), self._spec, self._drop_order())
        if columns != self._columns:
            self._set_columns(columns)
            self._rows.clear()
            self.refresh()

    def _set_columns(self, columns: tuple[int, ...]) -> None:
        self._columns = columns
        self._starts = (0, *accumulate(self._spec[i][2] + 2 * PAD for i in columns))
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
            if self.by_node:
                return  # by node the order is fixed (worst first)
            x = offset.x + round(self.scroll_x)
            for i, column in enumerate(self._columns):
                if self._starts[i] <= x < self._starts[i + 1]:
                    self.sort_by(COLUMN_KEYS[column])
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
            segments = header_segments(header, "" if self.by_node else self.sort_column,
                                       self.sort_reverse, self._columns, self._spec)
            return fit_row(segments, self._row_width, scroll_x, width, header)
        i = scroll_y + y - 1
        if i >= len(self._order) or self._view is None:
            return Strip.blank(width, base)
        key = self._order[i]
        values = self._shown.get(key)
        if values is None:  # never drawn (scrolled into view between two syncs)
            values = self._values(key)
            if values is None:
                return Strip.blank(width, base)
            self._shown[key] = values
        if i == self.cursor_row:
            segments = row_segments(values, cursor, self._render_ansi, self._columns,
                                    self._spec)
            return fit_row(segments, self._row_width, scroll_x, width, cursor)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = row_segments(values, base, self._render_ansi,
                                                 self._columns, self._spec)
        return fit_row(list(row), self._row_width, scroll_x, width, base)
