"""Modal dialogs: confirming a command (and watching its acks), and an entry in full.

:class:`CommandDialog` asks before anything destructive. The focused default is *Cancel*:
``enter`` on an untouched dialog sends nothing. ``y`` confirms, ``n``/``esc`` cancel. Once
confirmed the dialog stays open and becomes the command's progress report: the command id,
each agent's ack as it arrives, and at the end who did not answer within the timeout.
Closing it early does not stop anything; the app still reports the outcome (notification,
timeline).

:class:`DetailScreen` shows one timeline entry in full (a traceback can be long: it scrolls).

All text is untrusted and built with :func:`~.common.safe_text`: never markup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from elastic_console.job.client import Ack
from elastic_console.job.model import TimelineEntry

from .common import fmt_clock, safe_text

__all__ = ["CommandDialog", "DetailScreen"]

_OK = Style(color="green")
_BAD = Style(color="red", bold=True)
_DIM = Style(dim=True)


class CommandDialog(ModalScreen[None]):
    """Confirm a command, then report its acks (see the module docstring)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "confirm", "Confirm", id="dialog.confirm"),
        Binding("n,escape", "close", "Cancel", id="dialog.cancel"),
        Binding("left,h", "app.focus_previous", "Previous", show=False),
        Binding("right,l", "app.focus_next", "Next", show=False),
    ]

    def __init__(self, title: str, body: str, confirm_label: str,
                 on_confirm: Callable[[CommandDialog], None]) -> None:
        super().__init__(classes="dialog-screen")
        self.title_text = title
        self.body = body
        self.confirm_label = confirm_label
        self._on_confirm = on_confirm
        self.phase = "asking"  # asking -> sending -> waiting -> done
        self.command_id = ""
        self.lines: list[Text] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog command-dialog"):
            yield Static(Text(self.title_text, style="bold", end=""), markup=False,
                         classes="dialog-title")
            yield Static(safe_text(self.body), markup=False, id="dialog-body")
            yield Static("", markup=False, id="dialog-progress")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Cancel", id="cancel", variant="primary")
                yield Button(f"{self.confirm_label} (y)", id="confirm", variant="error")

    def on_mount(self) -> None:
        self.query_one("#dialog-progress", Static).display = False
        self.query_one("#cancel", Button).focus()  # the safe default

    # -- actions -----------------------------------------------------------------------------
    def action_confirm(self) -> None:
        if self.phase != "asking":
            return  # y once sends once
        self.phase = "sending"
        self.query_one("#confirm", Button).display = False
        cancel = self.query_one("#cancel", Button)
        cancel.label = "Close"
        cancel.focus()
        self._say(Text("sending…", style=_DIM))
        self._on_confirm(self)

    def action_close(self) -> None:
        self.dismiss(None)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "confirm":
            self.action_confirm()
        else:
            self.action_close()

    # -- progress (called by the app as its worker reports) --------------------------------
    def sent(self, command_id: str, kind: str, expected: dict[str, str], timeout: float) -> None:
        self.phase = "waiting"
        self.command_id = command_id
        n = len(expected)
        self.lines = []
        self._say(safe_text(f"{kind} command {command_id} sent; waiting for {n} agent"
                            f"{'' if n == 1 else 's'} to answer (up to {timeout:g} s)"))

    def add_ack(self, ack: Ack) -> None:
        line = Text(end="")
        ok = ack.status == "accepted"
        line.append("  ✓ " if ok else "  ✖ ", _OK if ok else _BAD)
        line.append_text(safe_text(f"{ack.status} by {ack.host} ({ack.node})"))
        if ack.reason:
            line.append_text(safe_text(f": {ack.reason}", _DIM))
        self._say(line)

    def finish(self, summary: str, ok: bool) -> None:
        self.phase = "done"
        self._say(safe_text(summary, _OK if ok else _BAD))

    def _say(self, line: Text) -> None:
        if self.lines and self.lines[-1].plain == "sending…":
            self.lines.pop()  # the placeholder gives way to what happened
        self.lines.append(line)
        progress = self.query_one("#dialog-progress", Static)
        progress.update(Text("\n", end="").join(self.lines))
        progress.display = True

    @property
    def progress_text(self) -> str:
        """What the progress area says (plain), for tests and screen readers."""
        return "\n".join(t.plain for t in self.lines)


class DetailScreen(ModalScreen[None]):
    """One timeline entry in full: its line, and its detail (e.g. a traceback), scrollable."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,enter", "close", "Close", id="detail.close"),
        Binding("j", "scroll('down')", "Down", show=False),
        Binding("k", "scroll('up')", "Up", show=False),
    ]

    def __init__(self, entry: TimelineEntry, utc: bool = False) -> None:
        super().__init__(classes="dialog-screen")
        self.entry = entry
        self.utc = utc

    def compose(self) -> ComposeResult:
        e = self.entry
        head = Text(end="")
        head.append(f"{fmt_clock(e.server_ms, self.utc)}  {e.kind}  ", _DIM)
        head.append_text(safe_text(e.text, "bold"))
        with Vertical(id="detail", classes="dialog detail-dialog"):
            yield Static(head, markup=False, classes="dialog-title")
            with VerticalScroll(id="detail-scroll"):
                yield Static(safe_text(e.detail or "(no more detail)", multiline=True),
                             markup=False, id="detail-body")
            yield Static(Text("esc closes · ↑↓ scroll", style=_DIM, end=""), markup=False,
                         classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one("#detail-scroll").focus()

    def action_close(self) -> None:
        self.dismiss(None)

    def action_scroll(self, direction: str) -> None:
        scroll = self.query_one("#detail-scroll", VerticalScroll)
        if direction == "down":
            scroll.scroll_down(animate=False)
        else:
            scroll.scroll_up(animate=False)

    @property
    def body_text(self) -> str:
        return safe_text(self.entry.detail or "(no more detail)", multiline=True).plain
