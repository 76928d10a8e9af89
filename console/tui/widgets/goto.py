"""The ``:`` prompt (k9s's command line): where the rank table should go.

A rank's number, or a host or node id (or the start of one). ``enter`` goes, ``esc`` cancels.
A digit typed in the rank table opens it with that digit already typed. What the text means is
the rank table's business (:meth:`~.rank_table.RankTable.goto`); this screen only asks.
"""

from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType

from .prompt import LinePrompt

__all__ = ["GotoScreen"]

#: Longest text taken: a rank has at most 8 digits, a host name 253 characters.
MAX_CHARS = 256


class GotoScreen(LinePrompt):
    """Ask for a rank or a host; dismissed with the text (``enter``) or None (``esc``)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", id="goto.cancel"),
    ]
    DEFAULT_CSS = "GotoScreen > #goto { width: 60; }"
    BOX_ID = "goto"
    INPUT_ID = "goto-input"
    TITLE = "Go to"
    PLACEHOLDER = "rank, host or node"
    HINT = "enter: go · esc: cancel · a number is a rank"
    MAX_LENGTH = MAX_CHARS
