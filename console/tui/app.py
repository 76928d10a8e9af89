"""`elastic-console attach JOB`: the live console of one job (Textual).

One screen: the job header, a red banner while Redis is unreachable, the rank table, the
selected rank's CPU/RSS sparklines, the timeline, and the log view; a footer with the keys.
``?`` lists every key, ``ctrl+p`` finds any command by name.

Architecture

* I/O lives in :class:`~elastic_console.job.client.JobClient`. The app runs it in async
  workers on its own event loop (``@work``, ``exit_on_error=False``: a Redis problem is shown,
  never fatal):

  - ``attach``: does the job exist? If not, :class:`~.widgets.waiting.WaitingScreen` polls
    until it does (or the user picks another job);
  - ``reader``: the job's meta and the history Redis kept (``client.history``), folded into
    the :class:`~elastic_console.job.state.JobView` in slices that yield to the UI, then
    ``client.follow()`` forever. ``follow`` rides out outages itself (it resumes from the
    last ids: no gap, no duplicate) and yields ``ConnectionChange`` records;
  - ``poll``: resource samples every second, the meta hash every few seconds;
  - ``acl``: may this Redis user write the command stream (``client.can_write``)?
  - ``commands``: send a command, then wait for the agents' acks (``client.wait_acks``).

* Workers fold records into the JobView directly (same loop, no locks) and post messages
  (:mod:`elastic_console.tui.messages`) only for discrete happenings: connection lost or
  back, history loaded, write access known, a command sent, an ack, a command's outcome.

* Refresh policy: records never redraw anything. A 10 Hz timer compares ``JobView.version``
  with the version drawn and, only if it moved, refreshes the header, the log view (it folds
  in just the new lines), the timeline (just the new entries) and the banner. The rank table
  is synced at most 4 times a second (the visible rows only, repainted if one changed) and
  its order once a second; sparklines only when the selected rank's samples changed. Keys act at once
  (they do not wait for the timer), and go first: a key or click closes the
  :class:`~elastic_console.tui.input_gate.InputGate`, and the reader and the log view's
  rescans wait until the frame after it is drawn (at most 0.1 s). Why 10 Hz: every frame
  costs Textual ~5 ms of compositing whatever changed; following 40 lines/s took 13% of a
  core at 20 Hz, 8% at 10 Hz.

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

import asyncio
import contextlib
import gc
import logging
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from textual import events as ui_events
from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import OptionList
from textual.worker import Worker, WorkerState

from elastic_agent.coordination.connection import Endpoint, RedisUnavailableError
from elastic_agent.coordination.text import sanitize

from ..job.client import RESOURCES_PER_SLICE, ConnectionChange, JobClient
from ..job.dedupe import UniqueLogs
from ..job.save import save_log_view
from ..job.state import (
    DEFAULT_ALL_SCROLLBACK,
    DEFAULT_SCROLLBACK,
    FAILED,
    FINAL_STATES,
    RANK_LINES_TOTAL,
    SCROLLBACK_FLOOR,
    SUCCEEDED,
    JobView,
)
from .command_actions import CommandActions
from .gc_policy import GcPolicy
from .home import JobsScreen
from .input_gate import InputGate
from .messages import ConnectionChanged, HistoryLoaded, JobAppeared, JobMissing, ReaderFailed, WriteAccess
from .widgets.attempt_logs import AttemptLogsScreen
from .widgets.dialogs import CommandDialog, DetailScreen
from .widgets.footer import KeyFooter
from .widgets.goto import GotoScreen
from .widgets.header import ALERT, ENDED_OK, ENDED_OTHERWISE, Banner, JobHeader
from .widgets.help import HelpScreen, KeyHelp
from .widgets.log_panel import FilterBar, LogTitle
from .widgets.log_view import LogView
from .widgets.rank_table import RankTable
from .widgets.sparklines import ResourcePanel
from .widgets.stacks import StacksScreen
from .widgets.timeline import Timeline
from .widgets.waiting import WaitingScreen

__all__ = ["ConsoleApp", "run_app"]

logger = logging.getLogger(__name__)

REFRESH_S = 0.1  # UI refresh from the JobView: at most 10 times a second (see the module doc)
TABLE_S = 0.25  # visible rank rows
TABLE_FULL_S = 1.0  # rank order (sorting), and "seconds since last line" everywhere
POLL_S = 1.0  # resource samples are written once a second
META_EVERY = 5  # meta hash: every fifth poll
#: Resource samples are read on every poll up to this many ranks, on every k-th beyond
#: (resource_polls_every): reading and folding 32,768 samples costs ~0.25 s of CPU, a quarter of
#: a core taken from the log reader every second.
RESOURCE_RANKS_PER_POLL = 8_192
HISTORY_EVENTS = 10_000
HISTORY_LINES_TOTAL = 500_000  # log lines read on attach, over all node streams...
#: ...but at least this many per rank of a stream (a few screens of each rank's own past). Per
#: rank, not per stream: 1,000 lines per stream took every line of 30 s at 4,096 nodes (2.5M,
#: minutes to fold and 1 GiB), the total cap having been made moot.
HISTORY_LINES_MIN_PER_RANK = 16
FOLD_SLICE = 500  # history records folded between yields to the UI
FOLD_BUDGET_S = 0.005  # live records folded before yielding to the UI
LIVE_FOLD_SLICE = 256  # live records folded at once (~2 ms at 4,096 ranks) between checks
_INPUT_EVENTS = (ui_events.Key, ui_events.MouseDown, ui_events.MouseScrollDown,
                 ui_events.MouseScrollUp)
#: After a key or click, how long its hops take with the readers held (input_gate.py); the
#: gate opens at the first frame after that.
INPUT_SETTLE_S = 0.015
RETRY_START_S, RETRY_MAX_S = 0.5, 5.0
REFUSED_RETRY_S = 5.0  # a refusal (NOPERM...) is retried slowly
FILTER_DEBOUNCE_S = 0.12  # a 200k-line rescan per keystroke would lag typing
ACK_TIMEOUT_S = 10.0
#: Lines of the all-ranks ring taken into the collapsed rows (``u``) per slice while the
#: toggle catches up (~10 ms each), and per refresh after that.
UNIQUE_SLICE_LINES = 4_096
UNIQUE_TICK_LINES = 20_000

#: (section, keys shown, description, action or None): the help screen's table; the
#: bindings below carry the same keys.
KEY_HELP: tuple[tuple[str, str, str, str | None], ...] = (
    ("Job", "r", "restart the worker group (confirm; shows the acks)", "restart"),
    ("Job", "s", "stop the job on every node (confirm; shows the acks)", "stop"),
    ("Job", "K", "send SIGTERM to the selected rank (confirm)", "kill_rank"),
    ("Job", "d", "every rank's Python stacks, identical ones grouped, odd ones first "
     "(no confirm; sends a stacks request, so not with --read-only)", None),
    ("Job", "q", "detach (the job keeps running)", None),
    ("Logs", "/", "filter lines by regex (smart case); enter keeps it, esc clears it", None),
    ("Logs", "a", "all ranks interleaved / the selected rank only", None),
    ("Logs", "u", "a line many ranks printed, once: ×N ranks [0-511] (all ranks view)", None),
    ("Logs", "e", "stderr only", None),
    ("Logs", "w", "wrap long lines", None),
    ("Logs", "t", "timestamps", None),
    ("Logs", "p", "the previous attempt's logs (the round before a restart) of the selected "
     "rank, or of every rank; there p goes further back, n forward", None),
    ("Logs", "ctrl+s", "save the log view as shown (ranks, filter, stderr) to a new file "
     "here", None),
    ("Logs", "f  end", "follow new lines (scrolling up pauses)", None),
    ("Logs", "↑↓ j k  pgup pgdn  home", "scroll (in the log view)", None),
    ("Logs", "← →", "scroll sideways when not wrapping", None),
    ("Ranks", "↑↓ j k  g G", "select a rank (its logs with `a`, its CPU/RSS)", None),
    ("Ranks", "o  O", "sort by the next column / reverse (or click a header)", None),
    ("Ranks", "n", "by node: one row per node, worst state first, its ranks counted by state; "
     "n or enter on a node: back to its ranks (the cursor on its worst one)", None),
    ("Ranks", ":  0-9", "go to a rank (its number) or a host or node (its name, or the start "
     "of it); a digit typed in the table starts the number", None),
    ("Ranks", "", "QUIET: time since the rank's last log line; EXIT: code or signal", None),
    ("Timeline", "↑↓ j k", "move in the timeline", None),
    ("Timeline", "enter", "the entry in full (a failure's traceback; a stall's stacks; a "
     "restart: the logs of the attempt it ended)", None),
    ("Anywhere", "tab  shift+tab", "move between ranks, timeline and logs", None),
    ("Anywhere", "esc", "back: close a dialog, the filter, this help; else the list of jobs",
     None),
    ("Anywhere", "?", "this help", None),
    ("Anywhere", "ctrl+p", "command palette: every command by name", None),
)



class ConsoleApp(CommandActions, App[int]):
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

    @on(RankTable.HeightWanted)
    def _rank_rows_changed(self) -> None:
        self._fit_layout()  # ranks came or went (or a scrollbar): the table's box follows

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

    # -- clocks ----------------------------------------------------------------------------
    def now_ms(self) -> int:
        """Redis server time, as well as this console knows it (see ``clock``)."""
        if self._clock is not None:
            return self._clock()
        return int(time.time() * 1000 + (self._server_offset_ms or 0.0))

    def _saw_server_ms(self, ms: int) -> None:
        # A live entry's id was the server's clock a moment ago: its offset from ours is a
        # lower bound of the real one, off by the read latency. Keep the largest.
        candidate = ms - time.time() * 1000
        if self._server_offset_ms is None or candidate > self._server_offset_ms:
            self._server_offset_ms = candidate

    # -- workers -----------------------------------------------------------------------------
    @work(exclusive=True, group="attach", exit_on_error=False)
    async def _attach(self) -> None:
        client = self.client
        assert client is not None
        delay = RETRY_START_S
        while True:
            try:
                exists = await client.job_exists()
                break
            except RedisUnavailableError as exc:
                self.connect_error = str(exc)
                await asyncio.sleep(delay)  # retry backoff while Redis cannot be reached
                delay = min(delay * 2, RETRY_MAX_S)
        self.connect_error = ""
        if exists:
            self.post_message(JobAppeared(self.job_id))
        else:
            self.post_message(JobMissing(self.job_id))

    @work(exclusive=True, group="reader", exit_on_error=False)
    async def _read_job(self) -> None:
        client, view = self.client, self.view
        assert client is not None
        delay = RETRY_START_S
        while not self.loaded:
            try:
                meta = await client.meta()
                events, batches = await client.history(
                    max_events=HISTORY_EVENTS,
                    max_log_entries_per_stream=await self._history_entries(client, meta))
            except RedisUnavailableError as exc:
                self.connect_error = str(exc)
                await asyncio.sleep(delay)  # retry backoff while Redis cannot be reached
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            except Exception as exc:  # a bug must not leave the screen on "connecting…"
                logger.exception("reading the job's history failed")
                self.post_message(ReaderFailed(f"internal error: {type(exc).__name__}: {exc}"))
                await asyncio.sleep(REFUSED_RETRY_S)
                continue
            self.connect_error = ""
            view.apply_meta(meta)
            view.note_skipped(client.skipped)
            view.set_connection(True, self.endpoint_display)
            for records in (events, batches):
                for i in range(0, len(records), FOLD_SLICE):
                    view.apply_many(records[i:i + FOLD_SLICE])
                    await asyncio.sleep(0)  # let the UI draw and take keys between slices
                    await self.input_gate.pause()
                self._fit_scrollback()  # the ranks are known from the events: before the lines
            self.loaded = True
            self.post_message(HistoryLoaded(len(events), view.lines_total))
            # The decoded history is folded in: let it go, or every full collection walks it
            # for the app's whole life (bench/console_bench.py: 300+ ms pauses).
            del events, batches, records
            if self.gc_policy is not None:
                self.gc_policy.settle()
        while True:
            try:
                budget = time.monotonic()
                async for records in client.follow_many():
                    first = records[0]
                    if isinstance(first, ConnectionChange):  # always alone in its list
                        view.set_connection(first.connected, self.endpoint_display, first.error)
                        self.post_message(ConnectionChanged(first.connected, first.error))
                        if view.redis_gone:
                            # Its agent said the server stops with the job: nothing will
                            # come back to reconnect to.
                            self.workers.cancel_group(self, "poll")
                            return
                        continue
                    if self.reader_error:
                        self.reader_error = ""
                    # A read holds up to READ_COUNT entries of every stream: folded in
                    # slices, so a key waits for one slice at most, not the whole read.
                    for i in range(0, len(records), LIVE_FOLD_SLICE):
                        newest = view.apply_many(records[i:i + LIVE_FOLD_SLICE])
                        if newest:
                            self._saw_server_ms(newest)
                        if not self.input_gate.is_open:
                            await self.input_gate.pause()  # a key is on its way: it goes first
                            budget = time.monotonic()
                        elif time.monotonic() - budget > FOLD_BUDGET_S:
                            await asyncio.sleep(0)  # a big reply must not freeze the keys
                            budget = time.monotonic()
            except RedisUnavailableError as exc:
                self.post_message(ReaderFailed(str(exc)))
                await asyncio.sleep(REFUSED_RETRY_S)  # waiting does not cure a refusal fast
            except Exception as exc:  # a bug must not leave a silently frozen screen
                logger.exception("the reader failed")
                self.post_message(ReaderFailed(f"internal error: {type(exc).__name__}: {exc}"))
                await asyncio.sleep(REFUSED_RETRY_S)

    def _fit_scrollback(self) -> None:
        """The lines each rank's ring keeps: ``--scrollback``, or less when the job has so many
        ranks that their rings together would hold more than RANK_LINES_TOTAL. Rings made
        from now on get it; those that exist keep theirs (they were made for fewer ranks)."""
        share = RANK_LINES_TOTAL // max(1, len(self.view.ranks))
        self.view.scrollback = min(self.scrollback, max(SCROLLBACK_FLOOR, share))

    async def _history_entries(self, client: JobClient, meta: dict[str, str]) -> int:
        """Log entries to read per node stream on attach.

        Enough for every rank's scrollback (``nproc`` ranks share a node's stream), but at
        most ``HISTORY_LINES_TOTAL`` lines over all streams (or ``HISTORY_LINES_MIN_PER_RANK``
        lines per rank, when that is more: 32,768 ranks get 16): ``client.history`` reads and
        decodes in one go and the console shows nothing new meanwhile. An entry holds the
        lines of one worker stream (older agents) or of the whole node over 50 ms: a probe
        (the newest entry of each stream) counts the streams and the lines an entry holds.
        """
        nproc = max(1, _to_int(meta.get("nproc_per_node"), 8))
        _, probe = await client.history(max_events=1, max_log_entries_per_stream=1)
        streams = max(1, len(client.last_ids) - 1)  # the cursor: the events + each log stream
        # An entry is its stream's (its node's) and its id: ids repeat across streams (the same
        # millisecond), so ids alone counted 3 entries for 400 nodes.
        entries = len({(b.node, b.id) for b in probe})
        per_entry = max(1.0, sum(len(b.lines) for b in probe) / max(1, entries))
        lines = min(self.scrollback * nproc,
                    max(HISTORY_LINES_MIN_PER_RANK * nproc, HISTORY_LINES_TOTAL // streams))
        return max(1, math.ceil(lines / per_entry))

    @work(exclusive=True, group="poll", exit_on_error=False)
    async def _poll(self) -> None:
        client, view = self.client, self.view
        assert client is not None
        n = 0
        while True:
            with contextlib.suppress(RedisUnavailableError):  # the reader reports outages
                if n % resource_polls_every(len(view.ranks)) == 0:
                    samples = list((await client.resources()).items())
                    for i in range(0, len(samples), RESOURCES_PER_SLICE):
                        if i:
                            await asyncio.sleep(0)  # 4,096 ranks: keys and frames go between
                        view.apply_resources(dict(samples[i:i + RESOURCES_PER_SLICE]))
                if n % META_EVERY == 0:
                    view.apply_meta(await client.meta())
                    view.apply_liveness(*await client.liveness())
            n += 1
            await asyncio.sleep(POLL_S)  # samples are written once a second

    @work(exclusive=True, group="acl", exit_on_error=False)
    async def _check_write(self) -> None:
        client = self.client
        assert client is not None
        delay = RETRY_START_S
        while True:
            try:
                ok, why = await client.can_write()
                break
            except RedisUnavailableError:
                await asyncio.sleep(delay)  # retry backoff while Redis cannot be reached
                delay = min(delay * 2, RETRY_MAX_S)
        self.post_message(WriteAccess(ok, why))

    # -- worker messages ---------------------------------------------------------------------
    def on_job_appeared(self, message: JobAppeared) -> None:
        self._start_reading()

    def on_job_missing(self, message: JobMissing) -> None:
        assert self.client is not None
        self.push_screen(WaitingScreen(self.client, self.endpoint_display), self._job_chosen)

    def _job_chosen(self, job_id: str | None) -> None:
        if job_id and job_id != self.job_id:
            self._switch_job(job_id)
        self._start_reading()

    def _switch_job(self, job_id: str) -> None:
        """Attach to another job (picked on the waiting screen) instead."""
        old = self.client
        assert old is not None
        self.client = JobClient(old.endpoint, job_id)
        self._owns_client = True
        self.run_worker(old.close(), group="close", exit_on_error=False)
        self.job_id = job_id
        self.view = self._new_view(job_id)
        self.timeline.reset()
        self.rank_table.reset()
        self.rank_table.sync(self.view, self.now_ms(), full=True)
        self.selected_rank = None
        self._point_log(force=True)
        self._drawn_version = -1

    def _start_reading(self) -> None:
        self._read_job()
        self._poll()
        self._check_write()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        # Workers catch what they expect; anything else is a bug the user must hear about.
        if event.state == WorkerState.ERROR:
            error = event.worker.error
            self.notify(f"{event.worker.group} worker failed: {type(error).__name__}: {error}",
                        title="internal error", severity="error", markup=False)

    def on_history_loaded(self, message: HistoryLoaded) -> None:
        self._tick(force=True)

    def on_connection_changed(self, message: ConnectionChanged) -> None:
        if message.connected:
            self.notify(f"reconnected to {self.endpoint_display}", markup=False)
        self._tick(force=True)  # the banner now, not on the next version change

    def on_reader_failed(self, message: ReaderFailed) -> None:
        self.reader_error = message.error
        self._tick(force=True)

    def on_write_access(self, message: WriteAccess) -> None:
        self.write_denied = "" if message.allowed else (message.reason or "not allowed")
        self._refresh_blocks(force=True)
        self._tick(force=True)

    # -- refresh -----------------------------------------------------------------------------
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

    def on_rank_table_sort_changed(self, message: RankTable.SortChanged) -> None:
        self._show_sort(message.description)

    def on_rank_table_goto_requested(self, message: RankTable.GotoRequested) -> None:
        self.action_goto(message.text)

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

    @on(FilterBar.Changed)
    def _filter_changed(self, message: FilterBar.Changed) -> None:
        self._filter_text = message.text
        self._pending_pattern = message.pattern
        if self._filter_timer is not None:
            self._filter_timer.stop()
        # Debounced: each change rescans the buffer shown (up to 200k lines).
        self._filter_timer = self.set_timer(FILTER_DEBOUNCE_S, self._apply_filter)
        self._update_log_title()

    def _apply_filter(self) -> None:
        self._filter_timer = None
        if self.log_view.pattern is not self._pending_pattern:
            self.log_view.pattern = self._pending_pattern

    @on(FilterBar.Closed)
    def _filter_closed(self, message: FilterBar.Closed) -> None:
        self._close_filter(clear=message.clear)

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

    def action_back(self) -> None:
        bar = self.filter_bar
        if bar.display or self._filter_text:
            self._close_filter(clear=True)
        elif self.client is not None:
            self.open_home()

    # -- the home screen: the job list (home.py) -----------------------------------------------
    def open_home(self) -> None:
        """Show the jobs on the server (k9s's resource list); the job attached to, if any,
        keeps being read behind it, so coming back to it costs nothing."""
        if self.screen is not self.main_screen or self.client is None:
            return  # from the job only (a waiting screen lists the jobs itself)
        self.push_screen(JobsScreen(self.client.endpoint, self.endpoint_display,
                                    current=self.job_id or None), self._home_chosen)

    def _home_chosen(self, job_id: str | None) -> None:
        if not job_id or job_id == self.job_id:
            return
        self.loaded = self.client is None
        self.write_denied = self.reader_error = self.connect_error = ""
        self._unique = None
        self._switch_job(job_id)
        self._attach()

    # -- other actions -------------------------------------------------------------------------
    def action_sort(self, reverse: bool = False) -> None:
        self._show_sort(self.rank_table.cycle_sort(reverse=reverse))

    def _show_sort(self, description: str) -> None:
        what = "Nodes" if self.rank_table.by_node else "Ranks"
        self.rank_table.border_title = f"{what} · {description}"

    def action_by_node(self) -> None:
        """``n``: one row per node, or per rank again (rank_table.py)."""
        table = self.rank_table
        table.set_by_node(not table.by_node)
        self._show_sort(table.sort_description())
        self._check_selection()

    def action_goto(self, text: str = "") -> None:
        """``:`` (or a digit in the rank table): ask for a rank or a host, then go there."""
        if self.screen is not self.main_screen:
            return
        self.push_screen(GotoScreen(text, cursor_blink=self.cursor_blink), self._goto_chosen)

    def _goto_chosen(self, text: str | None) -> None:
        if not text:
            return
        table = self.rank_table
        if table.goto(text):
            table.focus()
            self._check_selection()
        else:
            self.notify(f"no rank, host or node matches {sanitize(text)!r}", markup=False,
                        severity="warning")

    def action_stacks(self) -> None:
        """Every rank's stacks (issue 13). The request changes nothing in the job (no confirm),
        but it is a write (a ``stacks`` command), so ``--read-only`` and a Redis user who may
        not write the command stream refuse it; without a running agent nobody would answer.
        A read-only console still shows a capture that exists (a stall's, from the timeline)."""
        view = self.view
        why = self._read_only_reason()
        if not why and not self.loaded:
            why = "the job's state is still being read"
        elif not why and view.state in FINAL_STATES:
            why = f"job {self.job_id} has already {view.state}: no worker to ask"
        elif not why and not view.active_nodes():
            why = f"no agent of job {self.job_id} is running to answer"
        if why:
            self._explain(why)
            return
        self.open_stacks()

    def open_stacks(self, request_id: str | None = None, rank: int | None = None) -> None:
        """The stacks screen: ask every rank (or ``rank``), or with ``request_id`` show a
        capture that exists already (a stall's, the evidence of a stop) without asking."""
        ep = self.client.endpoint if self.client is not None else None
        self.push_screen(StacksScreen(ep, self.job_id, request_id=request_id, rank=rank))

    def action_previous_attempt(self) -> None:
        """``p``: the logs of the attempt before the current one (k9s's previous logs)."""
        if self.screen is not self.main_screen:
            return
        current = self.view.round
        if current is None or current < 1:
            self.notify("no earlier attempt: the job is in its first round", severity="warning",
                        markup=False)
            return
        self.open_attempt(current - 1)

    def open_attempt(self, attempt: int) -> None:
        """The logs of ``attempt`` (a round), of the selected rank unless all ranks are shown."""
        ep = self.client.endpoint if self.client is not None else None
        rank = None if self.all_ranks else self.selected_rank
        self.push_screen(AttemptLogsScreen(ep, self.job_id, attempt, rank=rank,
                                           newest=self.view.round))

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.key_help()))

    def key_help(self) -> list[KeyHelp]:
        """The help screen's rows, with the disabled commands marked and why."""
        return [KeyHelp(section, keys, text, self.block_reason(action) if action else "")
                for section, keys, text, action in KEY_HELP]

    @on(OptionList.OptionSelected, "#timeline")
    def _timeline_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        entries = self.timeline.entries
        if 0 <= event.option_index < len(entries):
            entry = entries[event.option_index]
            if entry.kind == "stalled" and entry.ref and self.client is not None:
                self.open_stacks(request_id=entry.ref)  # the stacks the stall captured
                return
            if entry.kind == "restart" and entry.ref.isdigit():
                self.open_attempt(int(entry.ref))  # the logs of the attempt it ended
                return
            self.push_screen(DetailScreen(entry, utc=self.utc))

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        commands: Sequence[tuple[str, str, Callable[[], Any]]] = (
            ("Restart the worker group", "r: every worker stopped and started (confirm)",
             self.action_restart),
            ("Stop the job", "s: every worker on every node (confirm)", self.action_stop),
            ("SIGTERM the selected rank", "K: to the rank under the cursor (confirm)",
             self.action_kill_rank),
            ("Python stacks of every rank", "d: grouped, odd ones first (read-only)",
             self.action_stacks),
            ("Filter the logs", "/: by regular expression", self.action_filter),
            ("Logs: all ranks / selected rank", "a", self.action_toggle_all),
            ("Logs: identical lines of many ranks once", "u", self.action_toggle_unique),
            ("Logs: stderr only", "e", self.action_toggle_stderr),
            ("Logs: wrap long lines", "w", self.action_toggle_wrap),
            ("Logs: timestamps", "t", self.action_toggle_timestamps),
            ("Logs: follow", "f / end", self.action_follow),
            ("Logs of the previous attempt", "p: the round before the last restart",
             self.action_previous_attempt),
            ("Sort the ranks by the next column", "o", self.action_sort),
            ("Ranks: by node / by rank", "n: one row per node, worst first",
             self.action_by_node),
            ("Go to a rank or a host", ": or a digit in the rank table", self.action_goto),
            ("Help: every key", "?", self.action_help),
            ("Detach", "q: the job keeps running", self.exit),
        )
        for title, help_text, callback in commands:
            yield SystemCommand(title, help_text, callback)


def resource_polls_every(ranks: int) -> int:
    """Polls (one a second) between two reads of the resource samples of ``ranks`` ranks: 1
    up to RESOURCE_RANKS_PER_POLL ranks, 4 at 32,768."""
    return max(1, math.ceil(ranks / RESOURCE_RANKS_PER_POLL))


def _to_int(value: object, default: int) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default






def run_app(endpoint: Endpoint, job_id: str | None, read_only: bool = False,
            scrollback: int = DEFAULT_SCROLLBACK) -> int:
    """Run the console until the user detaches; the exit status (0)."""
    app = ConsoleApp(job_id, endpoint=endpoint, read_only=read_only, scrollback=scrollback,
                     freeze_gc=True)
    code = app.run()
    return code if isinstance(code, int) else 0
