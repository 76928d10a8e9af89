"""Shared by the console's widgets: untrusted text to Rich ``Text``, formatting, colours.

Everything shown that came from Redis or the job goes through :func:`safe_text`: it sanitizes
(again: idempotent and cheap) and decodes the only escapes sanitize lets through, SGR colours,
into styles. A Rich ``Text`` is never parsed as markup, so ``[bold]`` stays four brackets and
letters; a raw ``ESC`` never reaches the terminal (``Text("\\x1b[31m")`` would send it as is).
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.reactive import var
from textual.scroll_view import ScrollView
from textual.strip import Strip

from elastic_agent.coordination.wire.text import sanitize
from elastic_console.job.formatting import fmt_age, fmt_bytes, fmt_clock

__all__ = [
    "JOB_STATE_STYLES",
    "RANK_STATE_STYLES",
    "fit_row",
    "fmt_age",
    "fmt_bytes",
    "fmt_clock",
    "safe_text",
]

#: Job states (header). Final states are bold: the job will not change any more.
JOB_STATE_STYLES: dict[str, Style] = {
    "waiting": Style(color="bright_black"),
    "running": Style(color="green", bold=True),
    "restarting": Style(color="blue", bold=True),
    "failed": Style(color="red", bold=True, reverse=True),
    "succeeded": Style(color="green", bold=True, reverse=True),
    "stopped": Style(color="yellow", bold=True, reverse=True),
    "lost": Style(color="magenta", bold=True, reverse=True),
}

#: Rank states (rank table).
RANK_STATE_STYLES: dict[str, Style] = {
    "running": Style(color="green"),
    "restarting": Style(color="blue"),
    "failed": Style(color="red", bold=True),
    "exited": Style(dim=True),
    "stopped": Style(color="yellow"),
    "stalled": Style(color="magenta", bold=True),  # the odd ranks of a stall
    "waiting": Style(color="magenta"),  # the ranks of a stall waiting for them
    "slow": Style(color="yellow", bold=True),  # a straggler (issue 22)
}


def safe_text(value: object, style: Style | str = "", *, no_wrap: bool = False,
              multiline: bool = False) -> Text:
    """``value`` as Rich ``Text`` that shows exactly what it says (see the module doc).

    ``multiline``: a newline breaks the line (a traceback); otherwise it shows as ``\\x0a``.
    """
    raw = str(value)
    s = "\n".join(map(sanitize, raw.split("\n"))) if multiline else sanitize(raw)
    if "\x1b" in s:  # only SGR sequences are left: make them styles
        text = Text.from_ansi(s, end="", no_wrap=no_wrap)
        if style:
            text.stylize_before(style)  # the text's own colours win
        return text
    return Text(s, style=style, end="", no_wrap=no_wrap)




def fit_row(segments: list[Segment], cells: int, start: int, width: int, style: Style) -> Strip:
    """One row of a ScrollView: ``cells`` wide ``segments`` from column ``start``, padded or
    cut to ``width``. The common case (from column 0, no wider than the view) makes one Strip
    and appends the padding to ``segments`` (a list made for this row)."""
    if start == 0 and cells <= width:
        if cells < width:
            segments.append(Segment(" " * (width - cells), style))
        return Strip(segments, width)
    return Strip(segments, cells).crop_extend(start, start + width, style)


class RowCursor(ScrollView, can_focus=True):
    """A scrolling table of rows with a cursor kept in view: the rank table and the job list.
    Subclasses say how many rows there are (:meth:`_row_count`) and bind the actions."""

    cursor_row: var[int] = var(0, init=False)

    def _row_count(self) -> int:
        raise NotImplementedError

    def validate_cursor_row(self, row: int) -> int:
        return max(0, min(row, self._row_count() - 1))

    def watch_cursor_row(self, old: int, new: int) -> None:
        self._scroll_to_cursor()
        self.refresh()

    def _page(self) -> int:
        return max(1, self.scrollable_content_region.height - 1)

    def _scroll_to_cursor(self) -> None:
        height = self._page()
        top = round(self.scroll_y)
        row = self.cursor_row
        if row < top:
            self.scroll_to(y=row, animate=False, immediate=True)
        elif row >= top + height:
            self.scroll_to(y=row - height + 1, animate=False, immediate=True)

    def action_cursor_up(self) -> None:
        self.cursor_row -= 1

    def action_cursor_down(self) -> None:
        self.cursor_row += 1

    def action_page_up(self) -> None:
        self.cursor_row -= self._page()

    def action_page_down(self) -> None:
        self.cursor_row += self._page()

    def action_first(self) -> None:
        self.cursor_row = 0

    def action_last(self) -> None:
        self.cursor_row = self._row_count() - 1
