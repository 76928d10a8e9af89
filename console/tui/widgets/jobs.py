"""JobTable: the home screen's list of jobs, drawing only the rows on screen.

A ScrollView like :class:`~.rank_table.RankTable`, not a DataTable: DataTable measures and
keeps a Text per cell, ~0.2 ms a row, so 1,000 jobs held the loop for a fifth of a second on
every change of the list and the first frame came after all of them. Here a row is a tuple
of plain strings made into a few Segments when it is drawn.

Row 0 is the header (it does not scroll). ``enter`` (or a click on the cursor's row) posts
:class:`JobTable.Chosen`. Cells are job data: sanitized, SGR removed, cut to their column,
drawn as plain Segments (never markup).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from rich.cells import set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.strip import Strip

from elastic_agent.coordination.wire.text import sanitize, strip_sgr

from .common import JOB_STATE_STYLES, RowCursor, fit_row

__all__ = ["COLUMNS", "JobTable"]

#: (key, header, width); the JOB column's width is the longest id's, within what the
#: screen leaves (JOB_MIN..JOB_MAX): at 80 columns every column stays visible.
COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("job", "JOB", 0), ("state", "STATE", 12), ("nodes", "NODES", 5), ("world", "WORLD", 5),
    ("restarts", "RESTARTS", 8), ("age", "AGE", 6), ("expires", "EXPIRES", 7),
)
_GAP = 2
JOB_MIN, JOB_MAX = 12, 64
_REST = sum(w for _, _, w in COLUMNS) + _GAP * (len(COLUMNS) - 1)


def _cell(value: str, width: int) -> str:
    text = strip_sgr(sanitize(value))
    return set_cell_size(text, width) if len(text) != width or not text.isascii() else text


class JobTable(RowCursor):
    """Rows of ``(job id, state, cells...)`` (see :meth:`set_rows`), one cursor."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"job-table--header", "job-table--cursor"}

    DEFAULT_CSS = """
    JobTable {
        background: $surface;
        color: $foreground;
        overflow-y: auto;
        overflow-x: auto;
        &:focus {
            & > .job-table--cursor {
                background: $block-cursor-background;
                color: $block-cursor-foreground;
                text-style: $block-cursor-text-style;
            }
        }
        & > .job-table--header { text-style: bold; background: $panel; color: $foreground; }
        & > .job-table--cursor {
            background: $block-cursor-blurred-background;
            color: $block-cursor-blurred-foreground;
            text-style: $block-cursor-blurred-text-style;
        }
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "cursor_up", "Up", show=False, id="jobs.up"),
        Binding("down", "cursor_down", "Down", show=False, id="jobs.down"),
        Binding("pageup", "page_up", "Page up", show=False, id="jobs.page_up"),
        Binding("pagedown", "page_down", "Page down", show=False, id="jobs.page_down"),
        Binding("home,g", "first", "First", show=False, id="jobs.first"),
        Binding("end,G", "last", "Last", show=False, id="jobs.last"),
        Binding("enter", "choose", "Attach", id="jobs.attach"),
    ]


    class Chosen(Message):
        """Enter (or a click) on a job's row."""

        def __init__(self, job_id: str) -> None:
            super().__init__()
            self.job_id = job_id

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.job_ids: list[str] = []
        self._rows: list[tuple[str, Sequence[str]]] = []  # (job state, cells)
        self._bold: str | None = None
        self._styles: tuple[Style, Style, Style] | None = None
        self._job_width = JOB_MIN

    # -- data ------------------------------------------------------------------------------
    def set_rows(self, rows: Sequence[tuple[str, str, Sequence[str]]],
                 keep: str | None = None, bold: str | None = None) -> None:
        """``(job id, state, cells)`` per row; the cursor stays on ``keep`` (else on the job
        it was on, else on the same row number). ``bold``: a job id to show in bold."""
        current = keep if keep is not None else self.selected
        self.job_ids = [r[0] for r in rows]
        self._rows = [(r[1], r[2]) for r in rows]
        self._bold = bold
        self._fit()
        if current is not None and current in self.job_ids:
            row = self.job_ids.index(current)
        else:
            row = self.cursor_row
        self.set_reactive(JobTable.cursor_row, self.validate_cursor_row(row))
        self._scroll_to_cursor()
        self.refresh()

    def _fit(self) -> None:
        longest = max((len(j) for j in self.job_ids), default=JOB_MIN)
        room = self.scrollable_content_region.width - _REST - _GAP
        self._job_width = max(JOB_MIN, min(JOB_MAX, longest, room))
        self.virtual_size = Size(self.row_width, len(self._rows) + 1)

    @property
    def row_width(self) -> int:
        return self._job_width + _GAP + _REST

    def on_resize(self, event: events.Resize) -> None:
        self._fit()

    def row_cells(self, job_id: str) -> list[str]:
        return list(self._rows[self.job_ids.index(job_id)][1])

    @property
    def row_count(self) -> int:
        return len(self.job_ids)

    @property
    def selected(self) -> str | None:
        if not self.job_ids:
            return None
        return self.job_ids[min(self.cursor_row, len(self.job_ids) - 1)]

    def move_cursor(self, row: int) -> None:
        self.cursor_row = row

    # -- the cursor ----------------------------------------------------------------------------
    def _row_count(self) -> int:
        return len(self.job_ids)

    def action_choose(self) -> None:
        job = self.selected
        if job is not None:
            self.post_message(self.Chosen(job))

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or offset.y == 0:
            return
        event.stop()
        row = round(self.scroll_y) + offset.y - 1
        if row >= len(self.job_ids):
            return
        if row == self.cursor_row:
            self.action_choose()
        else:
            self.cursor_row = row

    # -- rendering -------------------------------------------------------------------------------
    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._styles = None

    def _get_styles(self) -> tuple[Style, Style, Style]:
        if self._styles is None:
            base = self.rich_style
            self._styles = (
                base,
                base + self.get_component_rich_style("job-table--header", partial=True),
                base + self.get_component_rich_style("job-table--cursor", partial=True))
        return self._styles

    def _segments(self, cells: Sequence[str], style: Style, state: str | None,
                  bold: bool) -> list[Segment]:
        out: list[Segment] = []
        gap = Segment(" " * _GAP, style)
        for i, ((key, _, width), value) in enumerate(zip(COLUMNS, cells)):
            if i:
                out.append(gap)
            cell_style = style
            if key == "state" and state is not None:
                cell_style = style + JOB_STATE_STYLES.get(state, Style())
            elif key == "job" and bold:
                cell_style = style + Style(bold=True)
            out.append(Segment(_cell(value, width or self._job_width), cell_style))
        return out

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.scrollable_content_region.width
        base, header, cursor = self._get_styles()
        if y == 0:
            segments = self._segments([h for _, h, _ in COLUMNS], header, None, False)
            return fit_row(segments, self.row_width, scroll_x, width, header)
        i = scroll_y + y - 1
        if i >= len(self._rows):
            return Strip.blank(width, base)
        state, cells = self._rows[i]
        style = cursor if i == self.cursor_row else base
        segments = self._segments(cells, style, state, self.job_ids[i] == self._bold)
        return fit_row(segments, self.row_width, scroll_x, width, style)
