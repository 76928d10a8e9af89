"""The console's other screens, the keys that open them, the help and the command palette
(the ConsoleApp's mixin: the app is ``self``).

From the job screen: ``esc`` the list of jobs (:mod:`~elastic_console.tui.home`; it first
closes the log filter), ``:`` or a digit typed in the rank table a rank or a host to go to,
``d`` every rank's stacks, ``m`` the training metrics' charts, ``p`` the previous attempt's
logs, ``enter`` on the timeline the entry in full (or the stacks or the attempt it points
to), ``?`` the help (its table is :data:`KEY_HELP`), ``ctrl+p`` every command by name
(``get_system_commands``); and the rank table's own keys (``o``/``O`` sort, ``n`` by node).
The keys themselves are the app's ``BINDINGS`` (app.py).

What it uses of the app: ``client``, ``view``, ``job_id``, ``loaded``, ``endpoint_display``,
``all_ranks``, ``selected_rank``, ``utc``, ``cursor_blink``, ``main_screen``, the widgets, and
of the other mixins ``_switch_job``, ``_attach``, ``_check_selection``, ``_close_filter``,
``_filter_text``, ``_read_only_reason``, ``_explain``, ``block_reason`` and the actions the
palette lists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from textual.app import SystemCommand
from textual.screen import Screen

from elastic_agent.coordination.wire.text import sanitize

from ..job.model import FINAL_STATES
from .home import JobsScreen
from .widgets.attempt_logs import AttemptLogsScreen
from .widgets.dialogs import DetailScreen
from .widgets.goto import GotoScreen
from .widgets.help import HelpScreen, KeyHelp
from .widgets.metrics_screen import MetricsScreen
from .widgets.rank_table import RankTable
from .widgets.stacks import StacksScreen

__all__ = ["KEY_HELP", "Navigation"]

#: (section, keys shown, description, action or None): the help screen's table; the
#: app's bindings (app.py) carry the same keys.
KEY_HELP: tuple[tuple[str, str, str, str | None], ...] = (
    ("Job", "r", "restart the worker group (confirm; shows the acks)", "restart"),
    ("Job", "s", "stop the job on every node (confirm; shows the acks)", "stop"),
    ("Job", "K", "send SIGTERM to the selected rank (confirm)", "kill_rank"),
    ("Job", "d", "every rank's Python stacks, identical ones grouped, odd ones first "
     "(no confirm; sends a stacks request, so not with --read-only)", None),
    ("Job", "q", "detach (the job keeps running)", None),
    ("Job", "m", "training metrics: one chart per metric (loss first), rank 0, the median "
     "with the min-max band, chosen ranks; n/p metric, t step/time, 0 a c x curves", None),
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
    ("Ranks", "", "QUIET: time since the rank's last log line (until it exited); EXIT: code "
     "or signal; STEP, STEPS/S: its training step and rate, the slowest rank's STEP "
     "highlighted (shown once a rank prints steps)", None),
    ("Timeline", "↑↓ j k", "move in the timeline", None),
    ("Timeline", "enter", "the entry in full (a failure's traceback; a stall's stacks; a "
     "restart: the logs of the attempt it ended)", None),
    ("Anywhere", "tab  shift+tab", "move between ranks, timeline and logs", None),
    ("Anywhere", "esc", "back: close a dialog, the filter, this help; else the list of jobs",
     None),
    ("Anywhere", "?", "this help", None),
    ("Anywhere", "ctrl+p", "command palette: every command by name", None),
)


class Navigation:
    """The screens half of ConsoleApp (see the module docstring)."""

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

    # -- the rank table ------------------------------------------------------------------------
    def action_sort(self, reverse: bool = False) -> None:
        self._show_sort(self.rank_table.cycle_sort(reverse=reverse))

    def _show_sort(self, description: str) -> None:
        what = "Nodes" if self.rank_table.by_node else "Ranks"
        self.rank_table.border_title = f"{what} · {description}"

    def on_rank_table_sort_changed(self, message: RankTable.SortChanged) -> None:
        self._show_sort(message.description)

    def on_rank_table_goto_requested(self, message: RankTable.GotoRequested) -> None:
        self.action_goto(message.text)

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

    # -- other screens -------------------------------------------------------------------------
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

    def action_metrics(self) -> None:
        """``m``: the training curves (widgets/metrics_screen.py)."""
        if self.screen is not self.main_screen:
            return
        self.push_screen(MetricsScreen(utc=self.utc, cursor_blink=self.cursor_blink))

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

    def open_timeline_entry(self, index: int) -> None:
        """``enter`` on the timeline's entry ``index`` (wired in app.py)."""
        entries = self.timeline.entries
        if 0 <= index < len(entries):
            entry = entries[index]
            if entry.kind == "stalled" and entry.ref and self.client is not None:
                self.open_stacks(request_id=entry.ref)  # the stacks the stall captured
                return
            if entry.kind == "restart" and entry.ref.isdigit():
                self.open_attempt(int(entry.ref))  # the logs of the attempt it ended
                return
            self.push_screen(DetailScreen(entry, utc=self.utc))

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.key_help()))

    def key_help(self) -> list[KeyHelp]:
        """The help screen's rows, with the disabled commands marked and why."""
        return [KeyHelp(section, keys, text, self.block_reason(action) if action else "")
                for section, keys, text, action in KEY_HELP]

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
            ("Training metrics: charts", "m: loss first, by step or time, rank 0, median, "
             "chosen ranks", self.action_metrics),
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
