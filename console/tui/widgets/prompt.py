"""A one-line prompt over the screen: the ``:`` prompt's and the metrics view's ``c``.

Subclasses say what they ask (the box's title, the input's placeholder, its length and the
characters it takes, the hint under it); the prompt is dismissed with the stripped text
(``enter``; None when empty) or None (``esc``). What the text means is the caller's business.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

__all__ = ["LinePrompt"]


class LinePrompt(ModalScreen[str | None]):
    """Ask for one line of text; see the module docstring."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="prompt.cancel"),
    ]

    # Textual matches a type selector against the screen's base classes too: every prompt
    # gets this; a subclass sets its width by the id of its box.
    DEFAULT_CSS = """
    LinePrompt {
        align: left top;
        background: $background 30%;
    }
    LinePrompt > .prompt-box {
        max-width: 100%;
        height: auto;
        margin: 2 0 0 2;
        background: $surface;
        border: round $primary;
        padding: 0 1;
    }
    LinePrompt Input.prompt-input { border: none; height: 1; padding: 0; }
    LinePrompt .dialog-hint { height: 1; margin: 0; }
    """

    #: The box's and the input's ids (tests and stylesheets find them by these).
    BOX_ID: ClassVar[str] = "prompt"
    INPUT_ID: ClassVar[str] = "prompt-input"
    TITLE: ClassVar[str] = ""
    PLACEHOLDER: ClassVar[str] = ""
    HINT: ClassVar[str] = "enter: ok · esc: cancel"
    MAX_LENGTH: ClassVar[int] = 256
    #: A regular expression the whole text must match while typed (Textual's ``restrict``).
    RESTRICT: ClassVar[str | None] = None

    def __init__(self, text: str = "", *, cursor_blink: bool = True) -> None:
        super().__init__()
        self.text = text
        self.cursor_blink = cursor_blink

    def compose(self) -> ComposeResult:
        with Vertical(id=self.BOX_ID, classes="prompt-box"):
            yield Input(self.text, placeholder=self.PLACEHOLDER, max_length=self.MAX_LENGTH,
                        restrict=self.RESTRICT, id=self.INPUT_ID, classes="prompt-input")
            yield Static(Text(self.HINT, style="dim", end="", no_wrap=True, overflow="ellipsis"),
                         markup=False, classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one(f"#{self.BOX_ID}", Vertical).border_title = self.TITLE
        field = self.query_one(Input)
        field.cursor_blink = self.cursor_blink
        field.focus()
        field.cursor_position = len(field.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)
