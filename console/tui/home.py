"""The home screen: the jobs on the Redis server, as k9s opens on its resource list.

``elastic-console`` (no subcommand) and ``elastic-console attach`` (no job) open on it; ``esc``
in a job comes back to it. A row per job of the job index (what ``elastic-console ls``
reads, :meth:`~elastic_console.job.client.JobClient.list_jobs`): state (``lost`` when no agent
heartbeat is fresh and the job has no final state), nodes, world size, restarts used, age,
and when a finished or lost job's records expire. ``/`` filters (a regex, smart case, matched
against the id and the state; an invalid one is taken literally), ``enter`` attaches,
``esc`` clears the filter, ``q`` quits.

Live by a bounded periodic read, not by events: nothing in Redis announces "a job changed"
across jobs (keyspace notifications are a server setting, off by default, that a console
must not switch on), and the state ``lost`` is the *absence* of heartbeats, i.e. time passing.
One ``list_jobs`` (two pipelined round trips) every ``REFRESH_S``, spaced further when it is
slow: the pause is at least ``SLOW_FACTOR`` times the last read, so a huge server costs the
console and Redis a bounded share of their time.

Hostile input: the list shows what ``list_jobs`` decoded (invalid job ids and keys of the
wrong type are left out there); every cell is sanitized and drawn as plain text
(:class:`~.widgets.jobs.JobTable`), never markup.
An unexpected failure of the read is one line under the table, never a traceback.

The screen is modal: the job's keys (``r``, ``s``, ``K``...) of the app behind it do not
reach through while the list is shown.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import ClassVar

from rich.style import Style
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from elastic_agent.coordination.transport.connection import RedisUnavailableError
from elastic_agent.coordination.transport.endpoints import Endpoint

from ..job.client import JobClient, JobSummary
from ..job.formatting import fmt_age
from .messages import JobsListed
from .widgets.common import safe_text
from .widgets.footer import KeyFooter
from .widgets.jobs import JobTable

__all__ = ["JobsScreen", "job_row"]

logger = logging.getLogger(__name__)

REFRESH_S = 2.0
SLOW_FACTOR = 5.0


def _state_label(j: JobSummary) -> str:
    return j.state if j.lost_for_s is None else f"lost {fmt_age(j.lost_for_s)}"


def job_row(j: JobSummary) -> tuple[str, ...]:
    """The cells of a job's row, as plain strings (before :func:`safe_text`)."""
    return (j.job_id, _state_label(j), str(j.nodes),
            "-" if j.world_size is None else str(j.world_size),
            f"{j.restarts_used}/{'-' if j.max_restarts is None else j.max_restarts}",
            fmt_age(j.age_s), "-" if j.expires_in_s is None else fmt_age(j.expires_in_s))


def _pattern(text: str) -> re.Pattern[str] | None:
    if not text:
        return None
    flags = 0 if any(c.isupper() for c in text) else re.IGNORECASE  # smart case, as the logs
    try:
        return re.compile(text, flags)
    except re.error:
        return re.compile(re.escape(text), flags)


class JobsScreen(ModalScreen[str]):
    """The job list (see the module doc). Dismissed with the job id to attach to."""

    DEFAULT_CSS = """
    JobsScreen { background: $background; }
    #home { padding: 0 1; }
    #home-title { height: auto; margin-bottom: 1; }
    #home-jobs { height: 1fr; }
    #home-filter { display: none; }
    #home-status { height: auto; }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "app.quit", "Quit", id="home.quit"),
        Binding("slash", "filter", "Filter", id="home.filter"),
        Binding("escape", "clear_filter", "Clear filter", show=False, id="home.escape"),
        Binding("j", "down", "Down", show=False, id="home.down"),
        Binding("k", "up", "Up", show=False, id="home.up"),
    ]

    def __init__(self, endpoint: Endpoint, endpoint_display: str,
                 current: str | None = None) -> None:
        super().__init__(id="home-screen")
        self.endpoint = endpoint
        self.endpoint_display = endpoint_display
        self.current = current  # the job attached to before esc, if any: its row is selected
        self.jobs: list[JobSummary] = []
        self.error = ""
        self.listed = 0  # listings received (tests wait on it)
        self.pattern: re.Pattern[str] | None = None
        self.last_read_s = 0.0
        self._client: JobClient | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="home"):
            title = Text(end="")
            title.append("Jobs on ")
            title.append_text(safe_text(self.endpoint_display, "bold"))
            title.append("   enter: attach · esc in a job: back here", Style(dim=True))
            yield Static(title, markup=False, id="home-title")
            yield Input(placeholder="filter: regex on job id and state (esc clears)",
                        id="home-filter")
            yield JobTable(id="home-jobs")
            yield Static(Text("reading the job index…", Style(dim=True)), markup=False,
                         id="home-status")
        yield KeyFooter()

    def on_mount(self) -> None:
        self.table.focus()
        self._client = JobClient(self.endpoint, None)
        self._poll()

    async def on_unmount(self) -> None:
        if self._client is not None:
            await self._client.close()

    @property
    def table(self) -> JobTable:
        return self.query_one("#home-jobs", JobTable)

    @property
    def shown(self) -> list[str]:
        """The job ids in the table, in order."""
        return self.table.job_ids

    @work(exclusive=True, group="home", exit_on_error=False)
    async def _poll(self) -> None:
        client = self._client
        assert client is not None
        while True:
            started = time.monotonic()
            try:
                jobs = await client.list_jobs()
                self.post_message(JobsListed(jobs))
            except RedisUnavailableError as exc:
                self.post_message(JobsListed(self.jobs, error=str(exc)))
            except Exception as exc:  # hostile records must never end the list
                logger.exception("listing the jobs failed")
                self.post_message(JobsListed(
                    self.jobs, error=f"cannot read the job index: {type(exc).__name__}: {exc}"))
            self.last_read_s = time.monotonic() - started
            # Periodic on purpose: see the module doc (no cross-job event exists in Redis).
            await asyncio.sleep(max(REFRESH_S, SLOW_FACTOR * self.last_read_s))

    def on_jobs_listed(self, message: JobsListed) -> None:
        message.stop()
        self.jobs = message.jobs
        self.error = message.error
        first = self.listed == 0
        self.listed += 1
        self._show(keep=self.current if first else None)

    def _show(self, keep: str | None = None) -> None:
        pattern = self.pattern
        jobs = [j for j in self.jobs if pattern is None or pattern.search(j.job_id)
                or pattern.search(_state_label(j))]
        self.table.set_rows([(j.job_id, j.state, job_row(j)) for j in jobs], keep=keep,
                            bold=self.current)
        self._status(len(jobs))

    def _status(self, shown: int) -> None:
        status = Text(end="")
        total = len(self.jobs)
        if self.error:
            status.append_text(safe_text(f"{self.error} — retrying…", Style(color="red")))
            status.append("  ")
        if self.pattern is not None:
            status.append(f"{shown} of {total} jobs match /{self.pattern.pattern}/",
                          Style(dim=True))
        elif not self.jobs and not self.error:
            status.append(f"no jobs on this server (refreshed every {REFRESH_S:g} s)",
                          Style(dim=True))
        elif self.jobs:
            status.append(f"{total} job{'' if total == 1 else 's'}", Style(dim=True))
        self.query_one("#home-status", Static).update(status)

    # -- keys ------------------------------------------------------------------------------------
    def action_filter(self) -> None:
        bar = self.query_one("#home-filter", Input)
        bar.display = True
        bar.focus()

    @on(Input.Changed, "#home-filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.pattern = _pattern(event.value)
        self._show()

    @on(Input.Submitted, "#home-filter")
    def _filter_kept(self, event: Input.Submitted) -> None:
        event.stop()
        bar = self.query_one("#home-filter", Input)
        if not bar.value:
            bar.display = False
        self.table.focus()

    def action_clear_filter(self) -> None:
        bar = self.query_one("#home-filter", Input)
        if bar.value:
            bar.value = ""  # Input.Changed re-shows every job
            self.pattern = None
            self._show()
        bar.display = False
        self.table.focus()

    @on(JobTable.Chosen)
    def _row_chosen(self, event: JobTable.Chosen) -> None:
        event.stop()
        self.dismiss(event.job_id)

    def action_down(self) -> None:
        self.table.action_cursor_down()

    def action_up(self) -> None:
        self.table.action_cursor_up()
