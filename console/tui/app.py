"""`elastic-console attach JOB`: the live console of one job (Textual).

One screen: the job header, a red banner while Redis is unreachable, the rank table, the
selected rank's CPU/RSS sparklines, the timeline, and the log view; a footer with the keys.
``?`` lists every key, ``ctrl+p`` finds any command by name.

Architecture

The app is this module (the bindings, the widgets and their layout, the messages matched with
``@on``) and five mixins, one job each (the app is their ``self``):

* :mod:`~elastic_console.tui.feed`: the ``@work`` workers that read the job through the
  :class:`~elastic_console.job.client.JobClient` into the
  :class:`~elastic_console.job.state.JobView` (attach, history, follow, polls, write access),
  and the messages they post (:mod:`elastic_console.tui.messages`);
* :mod:`~elastic_console.tui.refresh`: the refresh policy: what a 10 Hz tick redraws from the
  JobView, keys first (:class:`~elastic_console.tui.input_gate.InputGate`);
* :mod:`~elastic_console.tui.log_controls`: what the log view shows (all ranks or one,
  identical lines once, the filter, stderr, wrap, timestamps) and saving it;
* :mod:`~elastic_console.tui.navigation`: the other screens (the job list, go to, stacks, an
  earlier attempt, an entry in full, the help, the command palette) and the rank table's keys;
* :mod:`~elastic_console.tui.command_actions`: the commands, their confirm dialogs and acks.

Untrusted text (log lines, host names, messages, tracebacks, Redis errors) is shown through
``Text`` objects built by :func:`~.widgets.common.safe_text` or the LogView, never as markup:
notifications use ``markup=False`` and every ``Static`` is created with ``markup=False``.

Commands (``r`` restart, ``s`` stop, ``K`` SIGTERM the selected rank) always go through a
confirm dialog whose default is Cancel. They are disabled, visibly in the footer and the help,
and explained when pressed, with ``--read-only``, when the Redis user may not write the command
stream, before the job's state is known, once the job has ended, and while no agent runs.
``q`` detaches: it never stops the job.

A big job (issue 21: 4,096 nodes x 8 ranks): ``n`` shows the rank table by node (worst first),
``:`` or a digit typed in the table jumps to a rank or a host (:class:`.widgets.goto.GotoScreen`,
then :meth:`RankTable.goto`).
"""

from __future__ import annotations

import contextlib
import gc
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from textual import events as ui_events
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.widgets import OptionList

from elastic_agent.coordination.transport.endpoints import Endpoint
from elastic_agent.coordination.wire.text import sanitize

from ..job.client import JobClient
from ..job.dedupe import UniqueLogs
from ..job.state import DEFAULT_ALL_SCROLLBACK, DEFAULT_SCROLLBACK, JobView
from .command_actions import CommandActions
from .feed import JobFeed
from .gc_policy import GcPolicy
from .input_gate import InputGate
from .log_controls import LogControls
from .navigation import Navigation
from .refresh import REFRESH_S, RefreshLoop
from .widgets.dialogs import CommandDialog
from .widgets.footer import KeyFooter
from .widgets.header import Banner, JobHeader
from .widgets.log_panel import FilterBar, LogTitle
from .widgets.log_view import LogView
from .widgets.rank_table import RankTable
from .widgets.sparklines import ResourcePanel
from .widgets.timeline import Timeline

__all__ = ["ConsoleApp", "run_app"]

ACK_TIMEOUT_S = 10.0


class ConsoleApp(JobFeed, RefreshLoop, LogControls, Navigation, CommandActions, App[int]):
    """The console of one job. See the module docstring.

    ``endpoint`` (or a ready ``client``) connects it to Redis. Without either it shows the
    given ``view`` as it is (no I/O at all): that is how the snapshot tests draw fixed screens.
    ``clock`` (server ms, for "seconds since the last line") defaults to the local clock
    corrected by the server times seen; ``utc`` shows times in UTC.
    """

    TITLE = "elastic-console"
    # Absolute: Textual resolves a relative CSS_PATH next to the module of the *subclass*.
    CSS_PATH = Path(__file__).with_name("console.tcss")

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Detach", id="console.detach"),
        Binding("question_mark", "help", "Help", id="console.help"),
        # The job keys come first: the footer shows bindings in this order and cuts the rest
        # off on a narrow terminal (80 columns). Each command key has a hidden twin: when the
        # command is disabled (check_action -> None: shown dimmed, not run) the key falls
        # through to the twin, which says why.
        Binding("r", "restart", "Restart", id="console.restart"),
        Binding("r", "disabled('restart')", show=False, id="console.restart_disabled"),
        Binding("s", "stop", "Stop", id="console.stop"),
        Binding("s", "disabled('stop')", show=False, id="console.stop_disabled"),
        Binding("K", "kill_rank", "SIGTERM", id="console.kill"),
        Binding("K", "disabled('kill_rank')", show=False, id="console.kill_disabled"),
        Binding("slash", "filter", "Filter", id="console.filter"),
        Binding("a", "toggle_all", "All/rank", id="console.all_ranks"),
        Binding("u", "toggle_unique", "Unique", show=False, id="console.unique"),
        Binding("e", "toggle_stderr", "Stderr", id="console.stderr"),
        Binding("w", "toggle_wrap", "Wrap", id="console.wrap"),
        Binding("t", "toggle_timestamps", "Times", id="console.timestamps"),
        Binding("f", "follow", "Follow", show=False, id="console.follow"),
        Binding("o", "sort", "Sort", id="console.sort"),
        Binding("O", "sort(True)", "Reverse sort", show=False, id="console.sort_reverse"),
        Binding("n", "by_node", "By node", show=False, id="console.by_node"),
        Binding("colon", "goto", "Go to", show=False, id="console.goto"),
        Binding("d", "stacks", "Stacks", show=False, id="console.stacks"),
        Binding("m", "metrics", "Metrics", show=False, id="console.metrics"),
        Binding("p", "previous_attempt", "Previous", show=False, id="console.previous_attempt"),
        Binding("ctrl+s", "save_log", "Save", show=False, id="console.save"),
        Binding("escape", "back", "Back", show=False, id="console.back"),
    ]

    def __init__(
        self,
        job_id: str | None,
        *,
        endpoint: Endpoint | None = None,
        client: JobClient | None = None,
        view: JobView | None = None,
        read_only: bool = False,
        scrollback: int = DEFAULT_SCROLLBACK,
        all_scrollback: int | None = None,
        utc: bool = False,
        clock: Callable[[], int] | None = None,
        ack_timeout: float = ACK_TIMEOUT_S,
        cursor_blink: bool = True,
        freeze_gc: bool = False,
    ) -> None:
        super().__init__()
        self.job_id = job_id or ""  # "": none yet, the home screen picks one (home.py)
        self._owns_client = client is None and endpoint is not None
        self.client: JobClient | None = client or (
            JobClient(endpoint, job_id) if endpoint is not None else None)
        ep = endpoint or (self.client.endpoint if self.client is not None else None)
        self.scrollback = scrollback
        self.all_scrollback = all_scrollback or max(DEFAULT_ALL_SCROLLBACK, scrollback)
        self.view: JobView = view or self._new_view(self.job_id)
        # Offline, the view's own record of where it came from is all there is to show.
        self.endpoint_display = sanitize(ep.display if ep is not None else
                                         self.view.endpoint or "(offline)")
        self.read_only_flag = read_only
        self.write_denied = ""  # why the Redis user may not write commands ("" if it may)
        self.loaded = self.client is None  # the history was read (offline: the view is all)
        self.utc = utc
        self.ack_timeout = ack_timeout
        self.cursor_blink = cursor_blink
        self.all_ranks = True  # the log view shows every rank interleaved
        self.unique_lines = False  # ...with a line many ranks printed shown once (dedupe.py)
        self._unique: UniqueLogs | None = None
        self.selected_rank: int | None = None
        self.connect_error = ""  # before the history is read: why Redis cannot be reached
        self.reader_error = ""  # a refusal the reader keeps hitting (NOPERM...)
        self._clock = clock
        self._server_offset_ms: float | None = None
        self._freeze_gc = freeze_gc
        #: Full collections at quiet moments (run_app's setting; tests keep Python's default).
        self.gc_policy: GcPolicy | None = GcPolicy() if freeze_gc else None
        self.input_gate = InputGate()
        self._last_input: ui_events.Event | None = None
        self._drawn_version = -1
        self._next_table = 0.0
        self._next_full = 0.0
        self._blocks: tuple[str, ...] | None = None
        self._dialogs: dict[int, CommandDialog] = {}
        self._filter_text = ""
        self._filter_timer: Any = None
        self._pending_pattern: re.Pattern[str] | None = None

    def _new_view(self, job_id: str) -> JobView:
        return JobView(job_id, self.scrollback, all_scrollback=self.all_scrollback)

    # -- layout ------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        # Kept as attributes: ``App.query_one`` searches the screen on top (a dialog, the
        # waiting screen), and the timer must reach these widgets whatever is on top.
        self.header = JobHeader(id="header")
        self.banner = Banner(id="banner")
        self.rank_table = RankTable(id="ranks")
        self.resources = ResourcePanel(id="resources")
        self.timeline = Timeline(utc=self.utc, id="timeline")
        self.log_title = LogTitle(id="log-title")
        self.log_view = LogView(self.view.all_logs, utc=self.utc, id="log")
        self.log_view.yield_to = self.input_gate.pause
        self.filter_bar = FilterBar(cursor_blink=self.cursor_blink, id="filter")
        yield self.header
        yield self.banner
        with Horizontal(id="top"):
            yield self.rank_table
            yield self.resources
        yield self.timeline
        with Vertical(id="logs"):
            yield self.log_title
            yield self.log_view
            yield self.filter_bar
        yield KeyFooter()

    #: Below this width the resources panel folds away (console.tcss: ``Screen.-narrow``).
    NARROW_COLUMNS = 100
    #: Below this height the timeline keeps two lines (console.tcss: ``Screen.-short``).
    SHORT_ROWS = 30
    #: The ranks' box is as high as its rows need, up to this share of the terminal's height;
    #: at least 4 rows, 6 when the resources panel beside it shows (two labels, two sparklines).
    TOP_SHARE = 0.35
    _top_height = 0  # the height last given to #top (0: none yet)

    def _fit_layout(self, width: int | None = None, height: int | None = None) -> None:
        """The job screen fitted to the terminal and the number of ranks (CSS has no media
        queries): classes for the width and height, and the rank table's box as high as it
        needs up to a cap, the rest going to the log view. Restyled only when that changes."""
        screen = getattr(self, "main_screen", None)
        if screen is None:
            return
        width = self.size.width if width is None else width
        height = self.size.height if height is None else height
        narrow = width < self.NARROW_COLUMNS
        screen.set_class(narrow, "-narrow")
        screen.set_class(height < self.SHORT_ROWS, "-short")
        cap = max(4, int(height * self.TOP_SHARE))
        top = max(min(self.rank_table.wanted_height(), cap), 4 if narrow else 6)
        if top != self._top_height:
            self._top_height = top
            screen.query_one("#top").styles.height = top

    def on_resize(self, event: ui_events.Resize) -> None:
        self._fit_layout(*event.size)
        timeline = getattr(self, "timeline", None)
        if timeline is not None and not timeline.has_focus:  # following: keep the newest shown
            self.call_after_refresh(timeline.scroll_end, animate=False)

    def on_mount(self) -> None:
        self.main_screen = self.screen
        self._fit_layout()
        self.filter_bar.display = False
        self.rank_table.border_title = "Ranks"
        self.timeline.border_title = "Timeline"
        self.resources.border_title = "Resources"
        self.rank_table.focus()
        self.set_interval(REFRESH_S, self._tick)
        self._tick(force=True)
        if self.client is not None:
            if self.job_id:
                self._attach()
            else:
                self.open_home()
        if self._freeze_gc:
            # Startup objects (Textual's, ours) never die: keep full collections from
            # walking them again and again (bench/log_view_bench.py, "tuned").
            self.call_after_refresh(gc.freeze)

    async def on_unmount(self) -> None:
        if self._owns_client and self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.close()

    # -- messages matched by @on -------------------------------------------------------------
    # Textual collects ``@on`` handlers from a MessagePump class's own body only, never from a
    # plain mixin's: they stay here and hand over to the mixins.
    @on(RankTable.HeightWanted)
    def _rank_rows_changed(self) -> None:
        self._fit_layout()  # ranks came or went (or a scrollbar): the table's box follows

    @on(FilterBar.Changed)
    def _filter_changed(self, message: FilterBar.Changed) -> None:
        self._filter_edited(message.text, message.pattern)  # log_controls.py

    @on(FilterBar.Closed)
    def _filter_closed(self, message: FilterBar.Closed) -> None:
        self._close_filter(clear=message.clear)  # log_controls.py

    @on(OptionList.OptionSelected, "#timeline")
    def _timeline_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.open_timeline_entry(event.option_index)  # navigation.py


def run_app(endpoint: Endpoint, job_id: str | None, read_only: bool = False,
            scrollback: int = DEFAULT_SCROLLBACK) -> int:
    """Run the console until the user detaches; the exit status (0)."""
    app = ConsoleApp(job_id, endpoint=endpoint, read_only=read_only, scrollback=scrollback,
                     freeze_gc=True)
    code = app.run()
    return code if isinstance(code, int) else 0
