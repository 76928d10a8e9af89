"""RankTable: one row per global rank, kept current cheaply even with 1,024 ranks.

Every cell is a Rich ``Text`` (a plain string cell would be parsed as markup by DataTable).
:meth:`RankTable.sync` is called a few times a second by the app:

* rows are added and removed as ranks appear and disappear (world size changes);
* only the rows on screen are recomputed, and only cells whose text changed are passed to
  ``update_cell`` (never ``update_width``: the columns have fixed widths), so a tick costs
  a few dozen comparisons whatever the number of ranks. Rows scrolled into view are brought
  up to date at once (``watch_scroll_y``);
* the row order comes from the JobView (not from cell text), recomputed with ``full=True``
  (about once a second) and applied with ``DataTable.sort`` only when it changed; the cursor
  stays on the same rank.

``o`` cycles the sort column, ``O`` reverses it; clicking a header sorts by that column.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ClassVar

from rich.style import Style
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.coordinate import Coordinate
from textual.message import Message
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist, RowDoesNotExist

from ..state import JobView, RankState
from .common import RANK_STATE_STYLES, fmt_age, fmt_bytes, safe_text

__all__ = ["COLUMNS", "RankTable"]

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
_RIGHT = {c[0] for c in COLUMNS if c[3]}
_STATE_ORDER = {"failed": 0, "restarting": 1, "stopped": 2, "running": 3, "exited": 4}
_EXIT_BAD = Style(color="red")
_DIM = Style(dim=True)


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
    """The plain text of each cell of rank ``r`` (what the diff compares)."""
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


def _cell(key: str, value: str) -> Text:
    style: Style | str = ""
    if key == "state":
        style = RANK_STATE_STYLES.get(value, "")
    elif key == "exit" and value not in ("-", "0"):
        style = _EXIT_BAD
    elif value == "-":
        style = _DIM
    text = safe_text(value, style, no_wrap=True)  # host names come from the job
    text.overflow = "ellipsis"
    if key in _RIGHT:
        text.justify = "right"
    return text


class RankTable(DataTable[Text]):
    """The ranks of the job (see the module docstring)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("j", "cursor_down", "Down", show=False, id="ranks.down"),
        Binding("k", "cursor_up", "Up", show=False, id="ranks.up"),
        Binding("g", "scroll_top", "First rank", show=False, id="ranks.first"),
        Binding("G", "scroll_bottom", "Last rank", show=False, id="ranks.last"),
    ]

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=False)
        self.sort_column = "rank"
        self.sort_reverse = False
        self._shown: dict[int, tuple[str, ...]] = {}  # rank -> cell texts on screen
        self._order: list[int] = []  # ranks in row order
        self._view: JobView | None = None
        self._now_ms = 0

    def on_mount(self) -> None:
        for key, label, width, right in COLUMNS:
            self.add_column(Text(label, justify="right" if right else "left"), width=width, key=key)

    # -- queries -----------------------------------------------------------------------------
    @property
    def selected_rank(self) -> int | None:
        """The rank under the cursor, or None when the table is empty."""
        if not self.row_count:
            return None
        try:
            key = self.coordinate_to_cell_key(Coordinate(self.cursor_row, 0)).row_key
        except CellDoesNotExist:
            return None
        return int(key.value) if key.value is not None else None

    def order(self) -> list[int]:
        """Ranks in row order (top to bottom)."""
        return list(self._order)

    def shown_row(self, rank: int) -> tuple[str, ...] | None:
        """The cell texts last put on screen for ``rank`` (None if never drawn)."""
        return self._shown.get(rank)

    # -- updates -----------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every row (another job)."""
        self.clear()
        self._shown.clear()
        self._order = []
        self._view = None

    def sync(self, view: JobView, now_ms: int, *, full: bool) -> None:
        """Bring the table up to date with ``view`` (see the module docstring)."""
        self._view, self._now_ms = view, now_ms
        ranks = view.ranks
        added = [r for r in ranks if r not in self._shown]
        removed = [r for r in self._shown if r not in ranks]
        for rank in removed:
            del self._shown[rank]
            with contextlib.suppress(RowDoesNotExist):
                self.remove_row(str(rank))
        for rank in sorted(added):
            values = row_values(ranks[rank], now_ms)
            self._shown[rank] = values
            self.add_row(*(_cell(k, v) for k, v in zip(_KEYS, values)), key=str(rank))
        if added or removed:
            self._order = [r for r in self._order if r in ranks] + sorted(added)
            full = True
        if full:
            self._apply_order(view)
        self._sync_visible()

    def cycle_sort(self, reverse: bool = False) -> str:
        """``o``: next sort column; ``O``: reverse the order. Returns a description."""
        if reverse:
            self.sort_reverse = not self.sort_reverse
        else:
            i = _KEYS.index(self.sort_column)
            self.sort_column = _KEYS[(i + 1) % len(_KEYS)]
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

    def sort_description(self) -> str:
        label = dict((k, h) for k, h, _, _ in COLUMNS)[self.sort_column]
        return f"sorted by {label.lower()}{' (reversed)' if self.sort_reverse else ''}"

    def _resort(self) -> None:
        if self._view is not None:
            self._apply_order(self._view)
            self._sync_visible()

    def _apply_order(self, view: JobView) -> None:
        keyfn = SORT_KEYS[self.sort_column]
        ranks = view.ranks
        order = sorted((r for r in self._shown if r in ranks), key=lambda r: keyfn(ranks[r]),
                       reverse=self.sort_reverse)
        if order == self._order and len(order) == self.row_count:
            return
        selected = self.selected_rank
        position = {rank: i for i, rank in enumerate(order)}
        # The rank cell's text is the rank: map it to its position in the wanted order.
        self.sort("rank", key=lambda cell: position.get(int(cell.plain), len(position)))
        self._order = order
        if selected is not None and selected in position:
            self.move_cursor(row=position[selected], animate=False)

    def _visible_rows(self) -> range:
        top = max(0, int(self.scroll_y))
        height = max(1, self.scrollable_content_region.height - 1)  # minus the header row
        return range(top, min(self.row_count, top + height + 1))

    def _sync_visible(self) -> None:
        view = self._view
        if view is None:
            return
        ranks = view.ranks
        for i in self._visible_rows():
            if i >= len(self._order):
                break
            rank = self._order[i]
            rs = ranks.get(rank)
            if rs is None:
                continue
            values = row_values(rs, self._now_ms)
            old = self._shown.get(rank)
            if values == old:
                continue
            self._shown[rank] = values
            row_key = str(rank)
            for j, key in enumerate(_KEYS):
                if old is None or old[j] != values[j]:
                    self.update_cell(row_key, key, _cell(key, values[j]))

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if int(old_value) != int(new_value):
            self._sync_visible()  # rows scrolled into view were not kept current off screen

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        key = event.column_key.value
        if key in SORT_KEYS:
            self.sort_by(key)
            self.post_message(self.SortChanged(self.sort_description()))

    class SortChanged(Message):
        """The sort order changed by a header click (the app tells the user)."""

        def __init__(self, description: str) -> None:
            super().__init__()
            self.description = description
