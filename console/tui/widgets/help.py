"""The ``?`` screen: every key of the console, by area, with the disabled ones marked and why.

Two columns (:func:`help_table`): the keys, as wide as the widest, and what they do, wrapped in
its own column; at 80 columns a description never runs back under the keys (issue 15).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rich.cells import cell_len
from rich.style import Style
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from .common import safe_text

__all__ = ["HelpScreen", "KeyHelp", "help_table", "help_text"]

_KEY = Style(bold=True, color="cyan")
_SECTION = Style(bold=True, underline=True)
_DISABLED = Style(dim=True, strike=True)
_WHY = Style(color="yellow")


@dataclass(frozen=True)
class KeyHelp:
    """One line of the help: the keys as shown, what they do, and why they are off (if)."""

    section: str
    keys: str
    description: str
    disabled: str = ""


#: Cells before the keys of a line (under their section's title).
INDENT = 2
#: Cells between the keys and their description.
GAP = 2


def help_table(rows: list[KeyHelp]) -> Table:
    """The help as shown: a grid whose second column (the descriptions) wraps within itself."""
    keys_width = INDENT + max((cell_len(row.keys) for row in rows), default=0)
    grid = Table.grid(padding=(0, GAP, 0, 0))
    grid.add_column(width=keys_width, no_wrap=True)
    grid.add_column(ratio=1, overflow="fold")  # fold: a long word is cut, never spilled
    section = None
    for row in rows:
        if row.section != section:
            if section is not None:
                grid.add_row("", "")
            section = row.section
            # Styles as spans, not the Text's own: the grid pads a cell in the Text's style
            # (an underline or a strike-through would run to the end of the column).
            grid.add_row(Text.assemble((section, _SECTION), end=""), "")
        style = _DISABLED if row.disabled else _KEY
        grid.add_row(Text.assemble(" " * INDENT, (row.keys, style), end=""),
                     Text.assemble((row.description, _DISABLED if row.disabled else Style()),
                                   end=""))
        if row.disabled:
            grid.add_row("", safe_text(f"disabled: {row.disabled}", _WHY))
    return grid


def help_text(rows: list[KeyHelp]) -> Text:
    """The same help as plain lines, one per key and never wrapped (to search it whole)."""
    out = Text(end="")
    section = None
    for row in rows:
        if row.section != section:
            if section is not None:
                out.append("\n")
            section = row.section
            out.append(f"{section}\n", _SECTION)
        out.append(f"  {row.keys:<25}", _DISABLED if row.disabled else _KEY)
        out.append(row.description, _DISABLED if row.disabled else Style())
        if row.disabled:
            out.append("\n  " + " " * 25)
            out.append_text(safe_text(f"disabled: {row.disabled}", _WHY))
        out.append("\n")
    return out


class HelpScreen(ModalScreen[None]):
    """Every key, by area (``esc``, ``?`` or ``q`` closes)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,question_mark,q", "close", "Close", id="help.close"),
        Binding("j", "scroll('down')", "Down", show=False),
        Binding("k", "scroll('up')", "Up", show=False),
    ]

    def __init__(self, rows: list[KeyHelp]) -> None:
        super().__init__(classes="dialog-screen")
        self.rows = rows

    def compose(self) -> ComposeResult:
        with Vertical(id="help", classes="dialog help-dialog"):
            yield Static(Text("Keys", style="bold", end=""), markup=False, classes="dialog-title")
            with VerticalScroll(id="help-scroll"):
                yield Static(help_table(self.rows), markup=False, id="help-body")
            yield Static(Text("esc closes · ctrl+p finds any command by name", style="dim",
                              end=""), markup=False, classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one("#help-scroll").focus()

    def action_close(self) -> None:
        self.dismiss(None)

    def action_scroll(self, direction: str) -> None:
        scroll = self.query_one("#help-scroll", VerticalScroll)
        if direction == "down":
            scroll.scroll_down(animate=False)
        else:
            scroll.scroll_up(animate=False)
