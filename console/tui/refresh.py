"""What the console redraws from the JobView, and when: keys first (the ConsoleApp's mixin:
the app is ``self``).

Refresh policy: records never redraw anything. A 10 Hz timer compares ``JobView.version``
with the version drawn and, only if it moved, refreshes the header, the log view (it folds
in just the new lines), the timeline (just the new entries) and the banner. The rank table
is synced at most 4 times a second (the visible rows only, repainted if one changed) and
its order once a second; sparklines only when the selected rank's samples changed. Keys act at once
(they do not wait for the timer), and go first: a key or click closes the
:class:`~elastic_console.tui.input_gate.InputGate`, and the reader and the log view's
rescans wait until the frame after it is drawn (at most 0.1 s). Why 10 Hz: every frame
costs Textual ~5 ms of compositing whatever changed; following 40 lines/s took 13% of a
core at 20 Hz, 8% at 10 Hz.

Each tick also gives the garbage collector its quiet moments (:mod:`.gc_policy`) and chooses
the banner's sentence (``_banner``: an outage, a refusal, restart patterns, the end of a job
whose Redis stops with it).

What it uses of the app: ``view``, ``loaded``, ``client``, ``job_id``, ``endpoint_display``,
the error fields, ``gc_policy``, ``input_gate``, ``main_screen`` and the widgets, and of the
other mixins ``now_ms``, ``_fit_scrollback``, ``_refresh_blocks``, ``_read_only_reason``,
``_check_selection``, ``_update_log_title``.
"""

from __future__ import annotations

import math
import time
from functools import partial

from textual import events as ui_events

from ..job.model import FAILED, SUCCEEDED
from .feed import REFUSED_RETRY_S
from .log_controls import UNIQUE_TICK_LINES
from .widgets.header import ALERT, ENDED_OK, ENDED_OTHERWISE

__all__ = ["REFRESH_S", "RefreshLoop"]

REFRESH_S = 0.1  # UI refresh from the JobView: at most 10 times a second (see the module doc)
TABLE_S = 0.25  # visible rank rows
TABLE_FULL_S = 1.0  # rank order (sorting), and "seconds since last line" everywhere
_INPUT_EVENTS = (ui_events.Key, ui_events.MouseDown, ui_events.MouseScrollDown,
                 ui_events.MouseScrollUp)
#: After a key or click, how long its hops take with the readers held (input_gate.py); the
#: gate opens at the first frame after that.
INPUT_SETTLE_S = 0.015


class RefreshLoop:
    """The drawing half of ConsoleApp: the refresh tick and the input gate's keys (see the
    module docstring)."""

    async def on_event(self, event: ui_events.Event) -> None:
        if isinstance(event, _INPUT_EVENTS) and event is not self._last_input:
            self._last_input = event  # an unhandled key bubbles back up here: once is enough
            if self.gc_policy is not None:
                self.gc_policy.saw_input()
            gate = self.input_gate
            gate.close()  # the readers wait until the key is handled and drawn
            self.set_timer(INPUT_SETTLE_S, partial(self._input_settled, gate.closed_at))
        await super().on_event(event)

    def _input_settled(self, closed_at: float) -> None:
        # The key's hops (app, screen, focused widget, binding) are done by now, the readers
        # having stepped aside; open the gate once the frame after them is drawn.
        if self.input_gate.closed_at == closed_at:  # else a newer key holds it
            self.call_after_refresh(self._input_drawn, closed_at)

    def _input_drawn(self, closed_at: float) -> None:
        if self.input_gate.closed_at == closed_at:
            self.input_gate.open()

    def _tick(self, force: bool = False) -> None:
        """Redraw what changed in the JobView (see "Refresh policy" in the module doc)."""
        if not self.log_view.is_attached:
            return  # shutting down: the widgets are gone
        if not force and not self.input_gate.is_open:
            return  # a key is being handled: its frame first, the refresh 0.1 s later
        if self.gc_policy is not None and self.loaded:
            self.gc_policy.tick()
        view = self.view
        now = time.monotonic()
        if force or view.version != self._drawn_version:
            self._drawn_version = view.version
            self.header.show(
                view, self.endpoint_display, loaded=self.loaded, read_only=self._read_only_reason())
            if self._unique is not None and self.log_view.source is self._unique.buffer:
                self._unique.sync(limit=UNIQUE_TICK_LINES)
            self.log_view.on_new_lines()
            self.timeline.sync(view)
            self._refresh_blocks()
        self.banner.show(*self._banner())
        self.main_screen.set_class(self.loaded and not view.connected and self.client is not None
                                   and not view.redis_gone, "-disconnected")
        if force or now >= self._next_table:
            self._next_table = now + TABLE_S
            full = force or now >= self._next_full
            if full:
                self._next_full = now + TABLE_FULL_S
            if full:
                self._fit_scrollback()  # ranks that came since get rings of the right size
            self.rank_table.sync(view, self.now_ms(), full=full)
            self._check_selection()
        self.resources.show(view.ranks.get(self.selected_rank)
                            if self.selected_rank is not None else None)
        self._update_log_title()

    def _banner(self) -> tuple[str | None, str]:
        """The banner's sentence (None: hidden) and tone."""
        view = self.view
        if (not self.reader_error and self.loaded and self.client is not None
                and view.redis_stops_ms is not None and view.is_final):
            # Its agent announced that the job's embedded Redis stops: its end is no outage.
            tone = ENDED_OK if view.state == SUCCEEDED else ENDED_OTHERWISE
            if not view.connected:
                return f"job {view.state}; its embedded Redis has stopped (q to leave)", tone
            left = max(0, math.ceil((view.redis_stops_ms - self.now_ms()) / 1000))
            return (f"job {view.state}; its embedded Redis stops when you detach (q), "
                    f"in {left} s at the latest"), tone
        return self._banner_message(), ALERT

    def _banner_message(self) -> str | None:
        # What is being done comes first: the reason can be longer than the screen is wide.
        if self.reader_error:
            return (f"Cannot read job {self.job_id} — retrying every {REFUSED_RETRY_S:g} s "
                    f"({self.reader_error})")
        if self.loaded and not self.view.connected and self.client is not None:
            why = self.view.connection_error or "the connection was lost"
            return f"Redis unreachable — reconnecting… ({why})"
        if not self.loaded and self.connect_error:
            return f"Redis unreachable — retrying… ({self.connect_error})"
        view = self.view
        if view.patterns and (not view.is_final or view.state == FAILED):
            return " · ".join(view.patterns.values())  # restart patterns (issue 22)
        return None
