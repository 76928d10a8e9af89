"""Around the LogView: its title line (what is shown, how) and the ``/`` filter bar.

The filter is a regular expression matched against the text the user reads (colours
stripped). Smart case, as in less and vim: case-insensitive unless the pattern has an
upper-case letter. An invalid pattern never reaches the view: the bar says why in one line
and the previous filter stays in force until the pattern compiles.
"""

from __future__ import annotations

import re

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Input, Static

from .common import safe_text

__all__ = ["FilterBar", "LogTitle", "compile_filter"]

_LABEL = Style(dim=True)
_ON = Style(color="cyan", bold=True)
_PAUSED = Style(color="yellow", bold=True)


def compile_filter(pattern: str) -> re.Pattern[str] | None:
    """``pattern`` compiled with smart case; None for an empty pattern. Raises re.error."""
    if not pattern:
        return None
    flags = 0 if any(c.isupper() for c in pattern) else re.IGNORECASE
    return re.compile(pattern, flags)


class LogTitle(Static):
    """``LOGS  all ranks │ following │ /loss/ │ stderr only │ wrap │ 12,345 lines``."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", markup=False, id=id)
        self._shown: tuple[object, ...] | None = None

    def show(self, *, source: str, follow: bool, pattern: str, stderr_only: bool, wrap: bool,
             timestamps: bool, lines: int, loading: bool) -> None:
        key = (source, follow, pattern, stderr_only, wrap, timestamps, lines, loading)
        if key == self._shown:
            return
        self._shown = key
        t = Text(no_wrap=True, overflow="ellipsis", end="")
        t.append(" LOGS ", Style(bold=True, reverse=True))
        t.append(" ")
        t.append_text(safe_text(source, Style(bold=True)))
        t.append("  │ ", _LABEL)
        t.append("following" if follow else "paused (f follows)", _ON if follow else _PAUSED)
        if pattern:
            t.append("  │ ", _LABEL)
            t.append("/", _LABEL)
            t.append_text(safe_text(pattern, _ON))
            t.append("/", _LABEL)
        if stderr_only:
            t.append("  │ ", _LABEL)
            t.append("stderr only", _ON)
        if wrap:
            t.append("  │ ", _LABEL)
            t.append("wrap", _ON)
        if not timestamps:
            t.append("  │ ", _LABEL)
            t.append("no times", _LABEL)
        t.append("  │ ", _LABEL)
        t.append(f"{lines:,} line{'' if lines == 1 else 's'}"
                 + (" (loading history…)" if loading else ""), _LABEL)
        self.update(t, layout=False)  # one line, fixed height: no relayout (20 times a second)


class FilterBar(Horizontal):
    """``/`` pattern input plus a one-line error. Posts :class:`FilterBar.Changed`."""

    class Changed(Message):
        """A new valid filter (None: no filter); ``text`` is what the user typed."""

        def __init__(self, pattern: re.Pattern[str] | None, text: str) -> None:
            super().__init__()
            self.pattern = pattern
            self.text = text

    class Closed(Message):
        """The bar was closed: ``clear`` when by esc (filter removed), else by enter."""

        def __init__(self, clear: bool) -> None:
            super().__init__()
            self.clear = clear

    def __init__(self, *, cursor_blink: bool = True, id: str | None = None) -> None:
        super().__init__(id=id)
        self.cursor_blink = cursor_blink
        self.error = ""

    def compose(self) -> ComposeResult:
        yield Static(Text("/", style="bold", end=""), markup=False, id="filter-slash")
        field = Input(placeholder="regex (smart case) · enter keeps it · esc clears",
                      id="filter-input", select_on_focus=False)
        field.cursor_blink = self.cursor_blink
        yield field
        yield Static("", markup=False, id="filter-error")

    @property
    def input(self) -> Input:
        return self.query_one("#filter-input", Input)

    def open(self, text: str) -> None:
        self.display = True
        field = self.input
        field.value = text
        field.cursor_position = len(text)
        field.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        try:
            pattern = compile_filter(event.value)
        except (re.error, OverflowError, RecursionError) as exc:
            self.error = f"invalid regex: {exc}"
            self.input.add_class("-invalid")
            self.query_one("#filter-error", Static).update(safe_text(self.error, Style(color="red")))
            return
        self.error = ""
        self.input.remove_class("-invalid")
        self.query_one("#filter-error", Static).update("")
        self.post_message(self.Changed(pattern, event.value))

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if not self.error:
            self.post_message(self.Closed(clear=False))
