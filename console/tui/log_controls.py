"""What the console's log view shows, and the keys that change it (the ConsoleApp's mixin:
the app is ``self``).

The view shows a ring of the JobView as it is, never a filtered copy: every rank's lines
interleaved (``a``), the same with a line many ranks printed collapsed into one row (``u``:
:class:`~elastic_console.job.dedupe.UniqueLogs`, kept only while the toggle is on and caught
up in slices, keys first), or the selected rank's. Stderr only (``e``), wrap (``w``),
timestamps (``t``) and the ``/`` filter are the LogView's own settings; the filter waits for
typing to pause (a rescan per keystroke would lag it). The title line above the view says
what is shown, and how; ``ctrl+s`` saves it as shown (:mod:`elastic_console.job.save`).

What it uses of the app: ``view``, ``loaded``, ``client``, ``all_ranks``, ``unique_lines``,
``_unique``, ``selected_rank``, the filter's state (``_filter_text``, ``_pending_pattern``,
``_filter_timer``), ``input_gate``, and the widgets (``log_view``, ``log_title``,
``filter_bar``, ``rank_table``).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from textual import work

from ..job.dedupe import UniqueLogs
from ..job.save import save_log_view
from .widgets.log_view import LogView
from .widgets.rank_table import RankTable

__all__ = ["UNIQUE_TICK_LINES", "LogControls"]

FILTER_DEBOUNCE_S = 0.12  # a 200k-line rescan per keystroke would lag typing
#: Lines of the all-ranks ring taken into the collapsed rows (``u``) per slice while the
#: toggle catches up (~10 ms each), and per refresh after that.
UNIQUE_SLICE_LINES = 4_096
UNIQUE_TICK_LINES = 20_000


class LogControls:
    """The log half of ConsoleApp (see the module docstring)."""

    def _update_log_title(self) -> None:
        log = self.log_view
        if self.all_ranks:
            source = "all ranks, identical lines once" if self.unique_lines else "all ranks"
        elif self.selected_rank is None:
            source = "no rank selected"
        else:
            source = f"rank {self.selected_rank}"
        self.log_title.show(
            source=source, follow=log.follow, pattern=self._filter_text,
            stderr_only=log.stderr_only, wrap=log.wrap, timestamps=log.show_timestamps,
            lines=log.line_count, loading=(not self.loaded and self.client is not None) or (
                self._unique is not None and log.source is self._unique.buffer
                and self._unique.pending > UNIQUE_TICK_LINES))

    def _check_selection(self) -> None:
        rank = self.rank_table.selected_rank
        if rank != self.selected_rank:
            self.selected_rank = rank
            if not self.all_ranks:
                self._point_log()

    def _point_log(self, force: bool = False) -> None:
        """Show all ranks' ring, or the selected rank's: no filtering scan either way."""
        log = self.log_view
        if self.all_ranks:
            source = self._unique_buffer() if self.unique_lines else self.view.all_logs
        else:
            source = (self.view.buffer_for(self.selected_rank)
                      if self.selected_rank is not None else None)
        tags = self.all_ranks  # one rank's lines need no rank column
        if log.show_rank_tags != tags:
            log.show_rank_tags = tags
        if force or log.source is not source:
            log.source = source

    def _unique_buffer(self) -> Any:
        """The rows of the all-ranks ring with identical lines collapsed, caught up now (it
        exists only while the toggle is on: nothing is spent on it otherwise)."""
        unique = self._unique
        if unique is None or unique.source is not self.view.all_logs:
            unique = self._unique = UniqueLogs(self.view.all_logs)
        unique.sync(limit=UNIQUE_SLICE_LINES)
        if unique.pending:
            self._catch_up_unique(unique)
        return unique.buffer

    @work(exclusive=True, group="unique", exit_on_error=False)
    async def _catch_up_unique(self, unique: UniqueLogs) -> None:
        # A full ring is ~0.5 s of work on these machines: in slices, keys first between them.
        while unique is self._unique and unique.pending:
            await asyncio.sleep(0.003)
            await self.input_gate.pause()
            unique.sync(limit=UNIQUE_SLICE_LINES)
            if self.log_view.source is unique.buffer:
                self.log_view.on_new_lines()
                self._update_log_title()

    def on_rank_table_rank_highlighted(self, message: RankTable.RankHighlighted) -> None:
        self._check_selection()
        self._update_log_title()

    def on_log_view_follow_changed(self, message: LogView.FollowChanged) -> None:
        self._update_log_title()

    # -- log actions ---------------------------------------------------------------------------
    def action_toggle_all(self) -> None:
        self.all_ranks = not self.all_ranks
        self._check_selection()
        self._point_log()
        self._update_log_title()

    def action_toggle_unique(self) -> None:
        self.unique_lines = not self.unique_lines
        if not self.unique_lines:
            self._unique = None
        if not self.all_ranks:
            self.notify("identical lines are collapsed in the all-ranks view (a)" if
                        self.unique_lines else "identical lines: shown one by one", markup=False)
        self._point_log()
        self._update_log_title()

    def action_toggle_stderr(self) -> None:
        self.log_view.stderr_only = not self.log_view.stderr_only
        self._update_log_title()

    def action_toggle_wrap(self) -> None:
        self.log_view.wrap = not self.log_view.wrap
        self._update_log_title()

    def action_toggle_timestamps(self) -> None:
        self.log_view.show_timestamps = not self.log_view.show_timestamps
        self._update_log_title()

    def action_save_log(self) -> None:
        self.run_worker(save_log_view(self), group="save", exit_on_error=False)

    def action_follow(self) -> None:
        self.log_view.scroll_to_end()

    def action_filter(self) -> None:
        self.filter_bar.open(self._filter_text)

    def _filter_edited(self, text: str, pattern: re.Pattern[str] | None) -> None:
        """The filter bar's text changed (``FilterBar.Changed``, wired in app.py)."""
        self._filter_text = text
        self._pending_pattern = pattern
        if self._filter_timer is not None:
            self._filter_timer.stop()
        # Debounced: each change rescans the buffer shown (up to 200k lines).
        self._filter_timer = self.set_timer(FILTER_DEBOUNCE_S, self._apply_filter)
        self._update_log_title()

    def _apply_filter(self) -> None:
        self._filter_timer = None
        if self.log_view.pattern is not self._pending_pattern:
            self.log_view.pattern = self._pending_pattern

    def _close_filter(self, clear: bool) -> None:
        bar = self.filter_bar
        if clear:
            self._filter_text = ""
            self._pending_pattern = None
            if self._filter_timer is not None:
                self._filter_timer.stop()
                self._filter_timer = None
            self.log_view.pattern = None
        else:
            self._apply_filter()  # enter: now, not after the debounce
        bar.display = False
        self.log_view.focus()
        self._update_log_title()
