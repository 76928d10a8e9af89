"""The ``:`` prompt (k9s's command line): where the rank table should go.

A rank's number, or a host or node id (or the start of one). ``enter`` goes, ``esc`` cancels.
A digit typed in the rank table opens it with that digit already typed. What the text means is
the rank table's business (:meth:`~.rank_table.RankTable.goto`); this screen only asks.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

__all__ = ["GotoScreen"]

#: Longest text taken: a rank has at most 8 digits, a host name 253 characters.
MAX_CHARS = 256


class GotoScreen(ModalScreen[str | None]):
    """Ask for a rank or a host; dismissed with the text (``enter``) or None (``esc``)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="goto.cancel"),
    ]

    DEFAULT_CSS = """
    GotoScreen {
        align: left top;
        background: $background 30%;
    }
    GotoScreen > #goto {
        width: 60;
        max-width: 100%;
        height: auto;
        margin: 2 0 0 2;
        background: $surface;
        border: round $primary;
        padding: 0 1;
    }
    GotoScreen #goto-input { border: none; height: 1; padding: 0; }
    GotoScreen .dialog-hint { height: 1; margin: 0; }
    """

    def __init__(self, text: str = "", *, cursor_blink: bool = True) -> None:
        super().__init__()
        self.text = text
        self.cursor_blink = cursor_blink

    def compose(self) -> ComposeResult:
        with Vertical(id="goto"):
            yield Input(self.text, placeholder="rank, host or node", max_length=MAX_CHARS,
                        id="goto-input")
            yield Static(Text("enter: go · esc: cancel · a number is a rank", style="dim",
                              end="", no_wrap=True, overflow="ellipsis"),
                         markup=False, classes="dialog-hint")

    def on_mount(self) -> None:
        box = self.query_one("#goto", Vertical)
        box.border_title = "Go to"
        field = self.query_one(Input)
        field.cursor_blink = self.cursor_blink
        field.focus()
        field.cursor_position = len(field.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)
