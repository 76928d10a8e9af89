"""LogView: live per-rank worker logs, rendering only the visible lines.

The app owns a :class:`~elastic_console.job.logbuffer.LogBuffer` (bounded ring of
``LogLine(server_ms, rank, stream, text)``, ``text`` a ``str``), gives it to the view
(``view.source = buffer``) and, after appending, calls :meth:`LogView.on_new_lines`
(coalesced, ~20-30 times a second). (``refresh_lines`` is Textual's own ScrollView method,
"repaint these rows"; it is left alone.)

Follow mode (``follow``, on by default) keeps the newest line in view. Any scroll away from
the end (keys, mouse wheel, scrollbar, a programmatic ``scroll_to``) turns it off; ``end`` or
``f`` (or scrolling back down to the very end) turns it on again. Each change posts
:class:`LogView.FollowChanged`. While it is off the view stays on the same lines, also when
older lines fall off the ring.

How it stays fast at 50k lines/s over a 200k-line buffer:

* Rows are located through a *visible index*: an ``array('q')`` of the absolute ``seq`` of
  every line that passes the filters, with a moving start offset. New lines are scanned once
  (C-level ``map``/``compress`` for the rank and stream filters); lines that fell off the ring
  are dropped from the front by a bisect. A full rescan happens only when a filter, wrap or
  the source changes, and it goes backwards from the newest line in slices of a few
  milliseconds (the first one fills the screen), so such a key never holds the event loop
  for the whole buffer; :attr:`LogView.scanning` says when older matches are still coming.
* With ``wrap`` on, the index also keeps each line's cell width and a running sum of rows,
  so ``row -> (line, sub-row)`` is a bisect, and a width change recomputes heights from the
  stored widths without touching the text again. Without wrap, the scroll width comes from
  character counts and is corrected when a line drawn turns out wider.
* A line redrawn in place (a progress bar: the JobView replaces its row with each newer
  state, :meth:`LogBuffer.replace`) is picked up by ``on_new_lines`` from the buffer's edit
  log: its rendering is dropped, its width (and wrapped height) measured again and, under a
  pattern, its match checked again (a rescan only if that changed). The frame is redrawn only
  when such a row is on screen.
* Only the visible rows are rendered (``render_line``). The LRU cache holds each line's full,
  uncropped rendering as segments, keyed by its absolute ``seq`` (stable when older lines fall
  off), in the line's own styles; the widget's base style (focus tints it) is added and the
  row's Strip made per frame (see :class:`~.log_lines.Rendered`). It is cleared when the prefix columns
  change. A frame is drawn only when the rows on screen changed (``_repaint_if_moved``).

Untrusted text: every line is made safe (sanitized, never markup) by
:func:`~.log_lines.build_text` (see :mod:`.log_lines`). The visible index is
:mod:`.log_index`'s (a mixin of the widget); the rest is here.
"""

from __future__ import annotations

import asyncio
import re
import time
from array import array
from bisect import bisect_left
from collections.abc import Awaitable, Callable
from types import EllipsisType
from typing import ClassVar

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.actions import SkipAction
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.reactive import var
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widget import Widget

from elastic_agent.coordination.wire.text import sanitize
from elastic_console.job.logbuffer import LogBuffer, LogLine, LogRing

from .common import fit_row
from .log_index import LINE_TEXT, VisibleIndex
from .log_lines import (
    ERR_TEXT_STYLE,
    MAX_LINE_CELLS,
    TS_ERR_STYLE,
    TS_STYLE,
    RenderCache,
    Rendered,
    TimestampFormatter,
    build_text,
    cells_of,
    rank_style,
    styled,
)

__all__ = ["LogBuffer", "LogLine", "LogView"]

#: A rescan (filter, wrap or source change) goes backwards from the newest line in chunks of
#: this many lines; the first slice takes at least SCAN_FIRST_LINES (a screenful of matches,
#: usually), later slices about SCAN_SLICE_S each, SCAN_PAUSE_S apart (other events run then).
SCAN_CHUNK_LINES = 2_048
SCAN_FIRST_LINES = 4_096
SCAN_SLICE_S = 0.003
SCAN_PAUSE_S = 0.003


class LogView(VisibleIndex, ScrollView, can_focus=True):
    """Live log lines of one rank or all ranks interleaved, with filters and follow mode.

    Give it a :class:`LogRing` (``source``) and call :meth:`on_new_lines` after appending.
    """

    #: Mouse text selection is not supported (the rows carry no offsets metadata).
    ALLOW_SELECT = False

    DEFAULT_CSS = """
    LogView {
        background: $surface;
        color: $foreground;
        overflow-y: scroll;
        overflow-x: auto;
        &.-wrap { overflow-x: hidden; }
        &:focus { background-tint: $foreground 5%; }
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "line_up", "Up", show=False, id="log_view.line_up"),
        Binding("down,j", "line_down", "Down", show=False, id="log_view.line_down"),
        Binding("pageup", "page_up", "Page up", show=False, id="log_view.page_up"),
        Binding("pagedown", "page_down", "Page down", show=False, id="log_view.page_down"),
        Binding("home", "home", "Oldest", show=False, id="log_view.home"),
        Binding("end,f", "follow", "Follow", id="log_view.follow"),
        Binding("left", "scroll_left", "Left", show=False, id="log_view.left"),
        Binding("right", "scroll_right", "Right", show=False, id="log_view.right"),
    ]

    #: Keep the view at the newest line as lines arrive. Scrolling up turns it off.
    follow: var[bool] = var(True, init=False)
    #: Show only this rank (None: all ranks).
    rank_filter: var[int | None] = var(None, init=False)
    #: Show only stderr lines.
    stderr_only: var[bool] = var(False, init=False)
    #: Show only lines whose visible text (sanitized, colours stripped) matches.
    pattern: var[re.Pattern[str] | None] = var(None, init=False)
    #: Fold long lines to the widget width (else cut, with horizontal scrolling).
    wrap: var[bool] = var(False, init=False)
    #: Show the ``HH:MM:SS.mmm`` column (from the line's server time).
    show_timestamps: var[bool] = var(True, init=False)
    #: Show the coloured ``[rank]`` column (the all-ranks interleaved mode).
    show_rank_tags: var[bool] = var(True, init=False)
    #: Minimum digits of the rank column (grows by itself when a wider rank shows up).
    rank_width: var[int] = var(3, init=False)

    class FollowChanged(Message):
        """Follow mode turned on or off (by the user or the program)."""

        def __init__(self, log_view: LogView, follow: bool) -> None:
            super().__init__()
            self.log_view = log_view
            self.follow = follow

        @property
        def control(self) -> LogView:
            return self.log_view

    def __init__(
        self,
        source: LogRing | None = None,
        *,
        follow: bool = True,
        show_timestamps: bool = True,
        show_rank_tags: bool = True,
        wrap: bool = False,
        rank_filter: int | None = None,
        stderr_only: bool = False,
        pattern: re.Pattern[str] | None = None,
        rank_width: int = 3,
        utc: bool = False,
        cache_size: int = 512,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
        disabled: bool = False,
    ) -> None:
        super().__init__(name=name, id=id, classes=classes, disabled=disabled)
        self._source: LogRing | None = source
        self._format_ts = TimestampFormatter(utc)
        self._cache = RenderCache(max(64, cache_size))
        # The visible index (see module docstring). Entries below _off are dead.
        self._seqs = array("q")
        self._off = 0
        self._cells = array("q")  # wrap only: text cells of each indexed line
        self._cum = array("q", [0])  # wrap only: rows before each line (+1 entry); absolute
        self._max_cells = 0  # no wrap: widest text seen since the last rescan
        self._scanned = 0  # buffer seq up to which lines were scanned into the index
        self._edits = 0  # the buffer's edit count folded in (lines replaced in place)
        self._scan_lo = 0  # rescan: lines [first_seq, _scan_lo) are still to be scanned
        self._scan_gen = 0  # rescan generation: a slice of an older rescan does nothing
        self._scan_top: int | None = None  # rescan: the line to show at the top once indexed
        self._digits = rank_width  # digits of the rank column in use
        self._text_width = 0  # wrap: cells available for text (width - prefix); 0 = unknown
        self._internal = 0  # >0 while the view itself moves the scroll position
        self._stale = True  # the index needs a full rescan
        self._ready = False  # mounted (is_mounted is still False inside on_mount)
        self._base_style: Style | None = None  # rich_style, cached until styles change
        self._look = 0  # bumped whenever the same lines would be drawn differently
        self._drawn: tuple[object, ...] | None = None  # _screen_key() of the last frame
        #: Awaited before each later slice of a rescan (the app's InputGate.pause: keys first).
        self.yield_to: Callable[[], Awaitable[None]] | None = None
        self.set_reactive(LogView.follow, follow)
        self.set_reactive(LogView.show_timestamps, show_timestamps)
        self.set_reactive(LogView.show_rank_tags, show_rank_tags)
        self.set_reactive(LogView.wrap, wrap)
        self.set_reactive(LogView.rank_filter, rank_filter)
        self.set_reactive(LogView.stderr_only, stderr_only)
        self.set_reactive(LogView.pattern, pattern)
        self.set_reactive(LogView.rank_width, rank_width)
        self.set_class(wrap, "-wrap")

    # -- public API -------------------------------------------------------------------------------

    @property
    def source(self) -> LogRing | None:
        """The buffer shown. Assigning a new one rescans it."""
        return self._source

    @source.setter
    def source(self, buffer: LogRing | None) -> None:
        self._source = buffer
        self._digits = self.rank_width
        self._rebuild(keep_position=False)

    @property
    def utc(self) -> bool:
        """Timestamps in UTC instead of local time."""
        return self._format_ts.utc

    @utc.setter
    def utc(self, value: bool) -> None:
        self._format_ts = TimestampFormatter(bool(value))
        self._restyle()

    def set_filters(
        self,
        *,
        rank: int | EllipsisType | None = ...,
        stderr_only: bool | EllipsisType = ...,
        pattern: re.Pattern[str] | EllipsisType | None = ...,
    ) -> None:
        """Change several filters with a single rescan (``...`` leaves one as it is)."""
        changed = False
        for attr, value in (("rank_filter", rank), ("stderr_only", stderr_only),
                            ("pattern", pattern)):
            if value is not ... and getattr(self, attr) != value:
                self.set_reactive(getattr(LogView, attr), value)
                changed = True
        if changed:
            self._watch_filters()

    def on_new_lines(self) -> None:
        """Fold in what was appended to (and dropped from) the buffer since the last call."""
        src = self._source
        if src is None:
            return
        if self._stale or src.total_appended < self._scanned:
            self._rebuild(keep_position=True)
            return
        edited = False
        if src.edits != self._edits:
            edited = self._fold_edits(src)
            if self._stale:
                self._rebuild(keep_position=True)
                return
        rows_dropped = self._drop_front(src.first_seq)
        total = src.total_appended
        grew = False
        if total > self._scanned:
            a = max(self._scanned, src.first_seq)
            self._scanned = total
            grew = self._append(a, total)
        elif not rows_dropped and not edited:
            return
        self._sync(rows_dropped)
        if grew:  # a wider rank showed up: the prefix column is wider now
            self._restyle()

    def scroll_to_end(self) -> None:
        """Jump to the newest line and follow."""
        if self.follow:
            self._scroll_end()
        else:
            self.follow = True

    # -- index maintenance ----------------------------------------------------------------------

    def _prefix_width(self) -> int:
        w = 0
        if self.show_timestamps:
            w += 13  # "HH:MM:SS.mmm "
        if self.show_rank_tags:
            w += self._digits + 3  # "[" digits "] "
        return w

    def _wrap_width(self) -> int:
        """Cells available for text on a wrapped row (0 while not laid out)."""
        width = self.scrollable_content_region.width
        if width <= 0:
            return 0
        return max(8, width - self._prefix_width())

    def _fold_edits(self, src: LogRing) -> bool:
        """Take in the lines ``src`` replaced since the last look (see the module doc).
        True if one of them is indexed; sets ``_stale`` when only a rescan will do (a
        pattern's match changed, or more edits than the buffer remembers)."""
        seqs = src.edited_since(self._edits)
        self._edits = src.edits
        if seqs is None:
            self._stale = True
            return False
        first, top, bottom = src.first_seq, None, None
        indexed = False
        for seq in set(seqs):
            self._cache.discard(seq)
            if not (max(first, self._scan_lo) <= seq < self._scanned):
                continue  # dropped, or not scanned yet (it will be, as it is now)
            i = bisect_left(self._seqs, seq, self._off)
            held = i < len(self._seqs) and self._seqs[i] == seq
            if self.pattern is not None and held != bool(self._select(seq, seq + 1)[1]):
                self._stale = True
                return False
            if not held:
                continue
            indexed = True
            text = LINE_TEXT(src.get(seq))
            if self._text_width and len(self._cells) != len(self._seqs):
                self._stale = True  # widths never measured (see _rewrap): measure them all
                return False
            if self._text_width:
                cells = self._cells[i] = cells_of([text])[0]
                tw = self._text_width
                if ((cells + tw - 1) // tw or 1) != self._cum[i + 1] - self._cum[i]:
                    del self._cum[i + 1:]  # its height changed: the rows below move
                    self._extend_cum(self._cells[i:])
            elif len(text) > self._max_cells:
                self._max_cells = min(len(text), MAX_LINE_CELLS + 1)
            if top is None:
                y = round(self.scroll_y)
                top = self.line_at_row(y)
                bottom = self.line_at_row(y + self.scrollable_content_region.height - 1)
            if top is not None and top[0] <= seq and (bottom is None or seq <= bottom[0]):
                self._look += 1  # on screen: the same rows, drawn anew
        return indexed

    def _rebuild(self, keep_position: bool) -> None:
        """Rescan the buffer into the index (filters, wrap or source changed).

        Backwards from the newest line, in slices: the first slice (at least
        ``SCAN_FIRST_LINES`` lines) fills the screen before the next frame, the rest follows
        in slices of about ``SCAN_SLICE_S`` between other events, so a key that changes a filter
        over a big buffer never holds the screen. Until it is done, :attr:`scanning` is True
        and the older matches are still being added above.
        """
        top = self.line_at_row(round(self.scroll_y)) if keep_position and not self.follow else None
        self._stale = False
        self._cache.clear()
        self._look += 1
        self._edits = self._source.edits if self._source is not None else 0
        self._seqs = array("q")
        self._off = 0
        self._cells = array("q")
        self._cum = array("q", [0])
        self._max_cells = 0
        self._text_width = self._wrap_width() if self.wrap else 0
        self._scan_gen += 1
        src = self._source
        self._scanned = 0 if src is None else src.total_appended
        self._scan_lo = self._scanned  # lines [first_seq, _scan_lo) are left to scan
        self._scan_top = top[0] if top else None
        self._scan_slice(first=True)

    @property
    def scanning(self) -> bool:
        """A rescan is under way: :attr:`line_count` and :meth:`visible_seqs` do not have the
        older matches yet (they are added above, in slices)."""
        src = self._source
        return src is not None and self._scan_lo > src.first_seq

    def _scan_slice(self, first: bool = False, gen: int | None = None) -> None:
        """Scan one slice of the rescan backwards and publish it; schedule the next one.
        Before the view is mounted there is nothing to keep responsive: all in one go."""
        if gen is not None and gen != self._scan_gen:
            return  # a newer rescan replaced this one
        src = self._source
        if src is None:
            return
        t0 = time.perf_counter()
        rows = lines = 0
        grew = False
        while True:
            lo = self._scan_lo
            a = max(src.first_seq, lo - SCAN_CHUNK_LINES)
            if a >= lo:
                break
            r, g = self._prepend(a, lo)
            self._scan_lo = a
            rows += r
            grew = grew or g
            lines += lo - a
            if not self._ready or (first and lines < SCAN_FIRST_LINES):
                continue
            if time.perf_counter() - t0 >= SCAN_SLICE_S:
                break
        if grew and self._text_width:
            self._text_width = self._wrap_width()  # the rank column grew
            self._recompute_cum()
        top = self._scan_top
        if top is not None and (top >= self._scan_lo or not self.scanning):
            self._scan_top = None  # the line that was at the top is indexed: back to it
            self._sync(0, top_seq=top)
        elif top is not None and first:  # meanwhile: the lines right after it
            self._sync(0, top_seq=self._seqs[self._off] if len(self._seqs) > self._off else None)
        else:
            self._sync(-rows)  # the lines in view stay in view
        if grew and not first:
            self._restyle()  # rendered lines have the narrower rank column
        if first and self.scanning and self._ready:
            self.run_worker(self._scan_rest(self._scan_gen), group="log-view-scan",
                            exclusive=True, exit_on_error=False)

    async def _scan_rest(self, gen: int) -> None:
        # A queued message would not do: a widget's message loop takes the next message
        # without going back to the event loop, so the slices would run as one long stall.
        while self.scanning and gen == self._scan_gen:
            # Not sleep(0): a key travels driver -> app -> focused widget -> handler, a loop
            # turn per hop; a pause as long as a slice leaves the loop at least half free.
            await asyncio.sleep(SCAN_PAUSE_S)
            if self.yield_to is not None:
                await self.yield_to()
            self._scan_slice(gen=gen)

    def _rewrap(self) -> None:
        """Recompute wrapped heights from the stored cell widths (width or prefix changed)."""
        if not self.wrap:
            return
        tw = self._wrap_width()
        if not tw:
            return
        if not self._text_width or len(self._cells) != len(self._seqs):
            self._rebuild(keep_position=True)  # widths were never measured
            return
        if tw == self._text_width:
            return
        top = self.line_at_row(round(self.scroll_y)) if not self.follow else None
        self._text_width = tw
        self._look += 1
        self._recompute_cum()
        self._sync(0, top_seq=top[0] if top else None)

    def _restyle(self) -> None:
        """Prefix or style inputs changed: drop rendered lines, re-measure if wrapping."""
        self._cache.clear()
        self._look += 1
        if self._text_width:
            self._rewrap()
        self._sync(0)

    # -- scrolling --------------------------------------------------------------------------------

    def _virtual_size(self) -> Size:
        if self.wrap:  # no horizontal scrolling (rows == lines until the width is known)
            return Size(0, self.row_count)
        return Size(self._prefix_width() + self._max_cells, len(self._seqs) - self._off)

    def _sync(self, rows_dropped: int, top_seq: int | None = None) -> None:
        """Publish the new virtual size and keep the view where it should be."""
        if not self._ready:
            return
        self._internal += 1
        try:
            self._set_virtual_size(self._virtual_size())
            if self.follow:
                self._scroll_end()
            elif top_seq is not None:
                i = bisect_left(self._seqs, top_seq, self._off)
                row = self._cum[i] - self._cum[self._off] if self._text_width else i - self._off
                self.scroll_to(y=row, animate=False, immediate=True)
            elif rows_dropped:
                self.scroll_to(y=max(0, round(self.scroll_y) - rows_dropped), animate=False,
                               immediate=True)
        finally:
            self._internal -= 1
        self._repaint_if_moved()

    def _screen_key(self) -> tuple[object, ...]:
        """What the view shows, in brief: the same key means the same rows on screen (lines
        are only ever added at the ends of the index between two rebuilds, and a line
        replaced in place on screen bumps ``_look``)."""
        region = self.scrollable_content_region
        top = round(self.scroll_y)
        bottom = self.line_at_row(top + region.height - 1)
        if bottom is None:  # the lines end above the last row: one added below them shows
            bottom = (-1, self.row_count)
        return (self._look, self.line_at_row(top), bottom, round(self.scroll_x), region.width,
                region.height)

    def _repaint_if_moved(self) -> None:
        """Repaint unless the rows on screen are the very ones last drawn: a following view
        whose rescan adds older lines above, or whose new lines are all filtered out, shows
        the same rows, and a frame costs Textual ~10 ms whatever it contains."""
        if self._screen_key() != self._drawn:
            self.refresh()

    def _set_virtual_size(self, size: Size) -> None:
        """Publish a new virtual size without relayouting the whole screen.

        ``Widget.virtual_size`` is a layout reactive: assigning it relayouts every widget on
        the screen (~12 ms with the console's ~30 widgets), and a following view changes it on
        every refresh (10-20 times a second). Only this view's scrollbars depend on it (its height
        is never ``auto``), so they are updated directly; if one has to appear or disappear,
        Textual relayouts by itself (their ``display`` changes).
        """
        if size == self.virtual_size:
            return
        self.set_reactive(Widget.virtual_size, size)
        self._scroll_update(size)  # the scrollbars; the rows are _sync's business

    def _scroll_end(self) -> None:
        self._internal += 1
        try:
            self.scroll_to(y=self.max_scroll_y, animate=False, immediate=True)
        finally:
            self._internal -= 1
        self._repaint_if_moved()

    def _user_scroll(self, y: float | None = None, x: float | None = None) -> None:
        self.scroll_to(x=x, y=y, animate=False, immediate=True)

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        if self._internal:  # the view moved itself: the mover repaints if the rows changed
            if self.show_vertical_scrollbar:
                self.vertical_scrollbar.position = new_value
            return
        super().watch_scroll_y(old_value, new_value)
        self._scan_top = None  # the user moved: a rescan must not move the view back
        at_end = round(new_value) >= self.max_scroll_y
        if self.follow and not at_end:
            self.follow = False  # the user (mouse wheel, scrollbar, keys) moved away
        elif not self.follow and at_end and new_value > old_value:
            self.follow = True  # scrolled back down to the newest line

    def watch_follow(self, follow: bool) -> None:
        if follow and self._ready:
            self._scroll_end()
        self.post_message(self.FollowChanged(self, follow))

    def _watch_filters(self) -> None:
        if self._ready:
            self._rebuild(keep_position=True)
        else:
            self._stale = True

    watch_rank_filter = _watch_filters
    watch_stderr_only = _watch_filters
    watch_pattern = _watch_filters

    def watch_wrap(self, wrap: bool) -> None:
        self.set_class(wrap, "-wrap")
        if wrap:
            self._internal += 1
            try:
                self.scroll_to(x=0, animate=False, immediate=True)
            finally:
                self._internal -= 1
        self._watch_filters()  # wrap needs (or drops) per-line widths: rescan

    def _watch_prefix(self) -> None:
        if self._ready:
            self._restyle()

    watch_show_timestamps = _watch_prefix
    watch_show_rank_tags = _watch_prefix

    def watch_rank_width(self, width: int) -> None:
        self._digits = width
        self._watch_filters()  # rescan: the column may need to grow again

    def on_mount(self) -> None:
        self._ready = True
        self._rebuild(keep_position=False)

    def on_resize(self, event: events.Resize) -> None:
        if self.wrap and self._wrap_width() != self._text_width:
            self._rewrap()
        if self.follow:
            self.call_after_refresh(self._scroll_end)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._base_style = None  # the cache holds no base style (see Rendered): it stays
        self._look += 1

    def _style(self) -> Style:
        """The widget's ``rich_style`` (costly to compute: ~20 us), cached like the strips."""
        style = self._base_style
        if style is None:
            style = self._base_style = self.rich_style
        return style

    # -- actions ----------------------------------------------------------------------------------

    def _page(self) -> int:
        return max(1, self.scrollable_content_region.height - 1)

    def action_line_up(self) -> None:
        self.follow = False
        self._user_scroll(y=self.scroll_y - 1)

    def action_line_down(self) -> None:
        self._user_scroll(y=self.scroll_y + 1)

    def action_page_up(self) -> None:
        self.follow = False
        self._user_scroll(y=self.scroll_y - self._page())

    def action_page_down(self) -> None:
        self._user_scroll(y=self.scroll_y + self._page())

    def action_home(self) -> None:
        self.follow = False
        self._user_scroll(y=0)

    def action_follow(self) -> None:
        """Jump to the newest line and follow new lines again (``end``, ``f``)."""
        self.scroll_to_end()

    def action_scroll_left(self) -> None:
        if self.wrap:
            raise SkipAction()  # nothing to scroll: let the app have the key
        self._user_scroll(x=max(0, self.scroll_x - 8))

    def action_scroll_right(self) -> None:
        if self.wrap:
            raise SkipAction()
        self._user_scroll(x=self.scroll_x + 8)

    # -- rendering -------------------------------------------------------------------------------

    def _render(self, seq: int) -> Rendered:
        cached = self._cache.get(seq)
        if cached is not None:
            return cached
        assert self._source is not None
        line = self._source.get(seq)
        try:
            ms, rank, stream, raw = line
        except (TypeError, ValueError):  # not a 4-tuple: show what it is rather than crash
            ms, rank, stream, raw = 0, "?", "err", repr(line)
        if type(raw) is not str:
            raw = str(raw)
        err = stream == "err"
        prefix: list[Segment] = []
        width = 0
        if self.show_timestamps:
            ts = self._format_ts(ms) + " "
            prefix.append(Segment(ts, TS_ERR_STYLE if err else TS_STYLE))
            width += len(ts)
        if self.show_rank_tags:
            tag = sanitize(f"[{rank!s:>{self._digits}}]")
            prefix.append(Segment(tag, rank_style(rank)))
            prefix.append(Segment(" "))
            width += cell_len(tag) + 1
        text = build_text(raw)
        body = text.render(self.app.console)
        body = list(Segment.apply_style(body, ERR_TEXT_STYLE) if err else body)
        rendered = Rendered(prefix, width, body, text.cell_len)
        self._cache.put(seq, rendered)
        return rendered

    def render_line(self, y: int) -> Strip:
        if y == 0:
            self._drawn = self._screen_key()
        scroll_x, scroll_y = self.scroll_offset
        width = self.scrollable_content_region.width
        style = self._style()
        loc = self.line_at_row(scroll_y + y)
        if loc is None or self._source is None:
            return Strip.blank(width, style)
        seq, sub = loc
        try:
            rendered = self._render(seq)
        except IndexError:  # fell off the ring since the last on_new_lines
            return Strip.blank(width, style)
        if self._text_width:
            tw = self._text_width
            if sub == 0 and rendered.text_width <= tw:  # fits on one row: the common case
                return fit_row(styled(rendered.prefix + rendered.text, style),
                               rendered.prefix_width + rendered.text_width, 0, width, style)
            body = Strip(rendered.text, rendered.text_width).crop(sub * tw, (sub + 1) * tw)
            # continuation rows are indented under the text
            if sub == 0:
                head: list[Segment] = rendered.prefix
                head_width = rendered.prefix_width
            else:
                head_width = self._prefix_width()
                head = [Segment(" " * head_width)]
            return fit_row(styled(head + list(body), style), head_width + body.cell_length, 0,
                           width, style)
        if rendered.text_width > self._max_cells:  # wider than its length said
            self._max_cells = rendered.text_width
            self.call_after_refresh(self._sync, 0)
        return fit_row(styled(rendered.prefix + rendered.text, style),
                       rendered.prefix_width + rendered.text_width, scroll_x, width, style)


