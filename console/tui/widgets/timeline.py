"""Timeline: what happened to the job, one line per entry, newest at the bottom.

Rendezvous rounds, nodes joining, leaving and lost, failures with their root cause, restarts
with their reason and, once the workers run again, how long the restart took and in which
phases, commands (sent from here) and who acked them, the job's end. ``enter`` on an
entry opens it in full (:class:`~elastic_console.tui.widgets.dialogs.DetailScreen`: the
traceback of a failure, the members of a round, each phase of a restart).

It is an ``OptionList`` fed incrementally from ``JobView.timeline``: ``timeline_total`` says
how many entries are new; when older entries fell off the bounded deque the list is rebuilt
(rare: the deque holds thousands). While the list is not focused it stays on the newest
entry; once the user moves in it, it stays where the user is.
"""

from __future__ import annotations

from typing import ClassVar

from rich.style import Style
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from elastic_console.job.model import TimelineEntry
from elastic_console.job.state import JobView

from .common import fmt_clock, safe_text

__all__ = ["KIND_STYLES", "Timeline", "entry_text"]

#: kind -> (marker, style of the marker and label)
KIND_STYLES: dict[str, tuple[str, Style]] = {
    "rendezvous": ("◆", Style(color="cyan")),
    "node": ("●", Style(color="bright_black")),
    "failure": ("✖", Style(color="red", bold=True)),
    "group_failed": ("✖", Style(color="red", bold=True)),
    "restart": ("↻", Style(color="blue", bold=True)),
    "restarted": ("↻", Style(color="green")),  # workers running again, and how long it took
    "ack": ("✓", Style(color="green")),
    "command": ("➜", Style(color="magenta", bold=True)),
    "job": ("■", Style(bold=True)),
    "logs": ("!", Style(color="yellow")),
    "stalled": ("‖", Style(color="magenta", bold=True)),
    "straggler": ("»", Style(color="yellow", bold=True)),  # issue 22: a slow rank
    "watchdog": ("◷", Style(color="yellow", bold=True)),  # worker_timer_expired
    "pattern": ("⚠", Style(color="yellow", bold=True)),  # restart storm, suspect, no progress
    "nan": ("✖", Style(color="red", bold=True)),  # a metric became NaN or infinite
}
_LABELS = {"group_failed": "root cause", "rendezvous": "round"}
_TIME = Style(dim=True)


def entry_text(entry: TimelineEntry, utc: bool = False) -> Text:
    """One timeline entry as a line: time, marker, kind, text (the text is untrusted)."""
    marker, style = KIND_STYLES.get(entry.kind, ("·", Style()))
    t = Text(no_wrap=True, overflow="ellipsis", end="")
    t.append(fmt_clock(entry.server_ms, utc), _TIME)
    t.append(f" {marker} ", style)
    t.append(f"{_LABELS.get(entry.kind, entry.kind):<10} ", style)
    t.append_text(safe_text(entry.text))
    if entry.detail:
        t.append(" ⏎", _TIME)  # enter shows more
    return t


class Timeline(OptionList):
    """The job's timeline (see the module docstring)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("j", "cursor_down", "Down", show=False, id="timeline.down"),
        Binding("k", "cursor_up", "Up", show=False, id="timeline.up"),
        Binding("enter", "select", "Details", id="timeline.details"),
    ]

    def __init__(self, *, utc: bool = False, id: str | None = None) -> None:
        super().__init__(id=id, markup=False)
        self.utc = utc
        self.entries: list[TimelineEntry] = []  # option index -> entry
        self._total = 0  # view.timeline_total folded in so far

    def sync(self, view: JobView) -> None:
        """Add the entries ``view`` has that this list does not show yet."""
        new = view.timeline_total - self._total
        if new <= 0:
            return
        held = len(view.timeline)
        # Following: the user is not in the list, or sits on its newest entry.
        following = not self.has_focus or self.highlighted in (None, len(self.entries) - 1)
        if new > held or len(self.entries) + new > held:
            # Older entries fell off the deque: start over from what it holds.
            self.entries = list(view.timeline)
            self.clear_options()
            self.add_options([Option(entry_text(e, self.utc)) for e in self.entries])
        else:
            fresh = [view.timeline[i] for i in range(held - new, held)]
            self.entries.extend(fresh)
            self.add_options([Option(entry_text(e, self.utc)) for e in fresh])
        self._total = view.timeline_total
        if following:
            if self.has_focus:
                self.highlighted = len(self.entries) - 1
            self.scroll_end(animate=False)

    def on_focus(self) -> None:
        if self.highlighted is None and self.entries:
            self.highlighted = len(self.entries) - 1  # start from the newest entry

    def reset(self) -> None:
        """Forget everything shown (another job)."""
        self.entries = []
        self._total = 0
        self.clear_options()

    def selected_entry(self) -> TimelineEntry | None:
        i = self.highlighted
        if i is None or not 0 <= i < len(self.entries):
            return None
        return self.entries[i]
