"""The ``?`` screen: every key of the console, by area, with the disabled ones marked and why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from .common import safe_text

__all__ = ["HelpScreen", "KeyHelp"]

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


def help_text(rows: list[KeyHelp]) -> Text:
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
                yield Static(help_text(self.rows), markup=False, id="help-body")
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
