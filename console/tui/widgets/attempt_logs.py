"""The logs of an earlier attempt (key ``p``, or ``enter`` on a restart in the timeline), as
k9s's ``p`` shows a container's previous run: one rank's lines (or every rank's) of one
rendezvous round, read once from Redis (console/job/attempts.py) in a ``@work`` worker.

``p`` goes one attempt further back, ``n`` one forward, ``a`` switches between the rank and
every rank; ``esc``/``q`` closes. Worker text is escaped and its colours dropped before it
reaches the ``Log`` widget (which would pass an ESC through, textual #3506).
"""

from __future__ import annotations

from typing import ClassVar

from rich.style import Style
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Log, Static

from elastic_agent.coordination.transport.endpoints import Endpoint
from elastic_agent.coordination.wire.text import sanitize, strip_sgr
from elastic_console.job.attempts import AttemptLogs
from elastic_console.job.client import JobClient
from elastic_console.job.inplace import latest_rows

from .common import safe_text

__all__ = ["AttemptLogsScreen"]

#: Lines shown at most (the newest of the attempt: where it ended).
MAX_LINES = 20_000
_DIM = Style(dim=True)
_ERROR = Style(color="red")


class AttemptFetched(Message):
    def __init__(self, attempt: int, rank: int | None, result: AttemptLogs | None,
                 error: str = "") -> None:
        super().__init__()
        self.attempt, self.rank, self.result, self.error = attempt, rank, result, error


class AttemptLogsScreen(ModalScreen[None]):
    """See the module docstring. ``newest``: the newest attempt there is (``n`` stops there)."""

    DEFAULT_CSS = """
    AttemptLogsScreen { align: center middle; background: $background; }
    #attempt-dialog { width: 120; max-width: 98%; height: 90%; border: thick $primary;
                      background: $surface; padding: 0 1; }
    #attempt-status { height: auto; margin-bottom: 1; }
    #attempt-log { height: 1fr; }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "close", "Close", id="attempt.close"),
        Binding("p", "older", "Older attempt", id="attempt.older"),
        Binding("n", "newer", "Newer attempt", id="attempt.newer"),
        Binding("a", "toggle_all", "All/rank", id="attempt.all_ranks"),
    ]

    def __init__(self, endpoint: Endpoint | None, job_id: str, attempt: int, *,
                 rank: int | None = None, newest: int | None = None) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.job_id = job_id
        self.attempt = max(0, attempt)
        self.rank = rank
        self.chosen_rank = rank  # what ``a`` comes back to
        self.newest = newest
        self.result: AttemptLogs | None = None
        self.status_text = ""
        self.lines: list[str] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="attempt-dialog"):
            yield Static("", markup=False, id="attempt-title", classes="dialog-title")
            yield Static("", markup=False, id="attempt-status")
            yield Log(id="attempt-log", max_lines=MAX_LINES, auto_scroll=True)
            yield Static(Text("p older attempt · n newer · a all ranks/the rank · esc closes",
                              style=_DIM, end=""), markup=False, classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one("#attempt-log", Log).focus()
        self._load()

    # -- fetching -------------------------------------------------------------------------------
    def _load(self) -> None:
        who = "every rank" if self.rank is None else f"rank {self.rank}"
        title = safe_text(f"Logs of attempt {self.attempt} (round {self.attempt}) of job "
                          f"{self.job_id}, {who}", "bold")
        self.query_one("#attempt-title", Static).update(title)
        self.result, self.lines = None, []
        self.query_one("#attempt-log", Log).clear()
        if self.endpoint is None:
            self._status("this console is not connected to Redis", _ERROR)
            return
        self._status("reading the attempt's lines…")
        self._fetch(self.attempt, self.rank)

    @work(exclusive=True, group="attempt-logs", exit_on_error=False)
    async def _fetch(self, attempt: int, rank: int | None) -> None:
        assert self.endpoint is not None
        client = JobClient(self.endpoint, self.job_id, retries=1)
        try:
            result = await client.attempt_logs(attempt, rank, max_lines=MAX_LINES)
        except Exception as exc:  # a Redis problem is shown, never fatal
            self.post_message(AttemptFetched(attempt, rank, None, f"{type(exc).__name__}: {exc}"))
            return
        finally:
            await client.close()
        self.post_message(AttemptFetched(attempt, rank, result))

    def on_attempt_fetched(self, message: AttemptFetched) -> None:
        if (message.attempt, message.rank) != (self.attempt, self.rank):
            return  # an answer for an attempt the user has moved away from
        if message.result is None:
            self._status(f"cannot read the attempt's lines: {message.error}", _ERROR)
            return
        self.result = r = message.result
        every = self.rank is None
        rows, _ = latest_rows(r.batches)  # a redrawn bar once, in its latest state
        self.lines = [strip_sgr(sanitize(f"[rank {row[0]}] {row[1]}" if every else row[1]))
                      for row in rows if row is not None][-MAX_LINES:]
        log = self.query_one("#attempt-log", Log)
        log.write_lines(self.lines)
        n = len(self.lines)
        status = (f"{n} line{'' if n == 1 else 's'}" if n else
                  "no lines of this attempt are kept (none printed, or Redis trimmed them)")
        if r.partial and n:
            status += " (the newest ones; older lines of the attempt are not kept)"
        if r.note:
            status += f"; note: {r.note}"
        self._status(status)

    def _status(self, text: str, style: Style | str = "") -> None:
        self.status_text = text
        self.query_one("#attempt-status", Static).update(safe_text(text, style))

    # -- actions --------------------------------------------------------------------------------
    def action_close(self) -> None:
        self.dismiss(None)

    def action_older(self) -> None:
        if self.attempt == 0:
            self.notify("attempt 0 is the job's first", markup=False)
            return
        self.attempt -= 1
        self._load()

    def action_newer(self) -> None:
        if self.newest is not None and self.attempt >= self.newest:
            self.notify(f"attempt {self.attempt} is the newest", markup=False)
            return
        self.attempt += 1
        self._load()

    def action_toggle_all(self) -> None:
        self.rank = self.chosen_rank if self.rank is None else None
        self._load()
