"""The screen shown while the job attached to does not exist (yet).

It says which job it waits for and on which server, lists the jobs the server knows (``enter``
attaches to the highlighted one instead), and asks Redis once a second whether the job exists:
when it appears, the screen dismisses itself with the job id and the console attaches.
Its worker belongs to the screen, so it ends with it.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

from rich.style import Style
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import DataTable, Static

from elastic_agent.coordination.transport.connection import RedisUnavailableError
from elastic_console.job.client import JobClient, JobSummary

from ..messages import JobAppeared, JobsListed
from .common import JOB_STATE_STYLES, fmt_age, safe_text
from .footer import KeyFooter

__all__ = ["WaitingScreen"]

POLL_S = 1.0  # job_exists: one cheap pipeline a second
LIST_EVERY = 3  # list_jobs every third poll: it folds recent events of every job


class WaitingScreen(Screen[str]):
    """Waits for ``client.job_id`` (see the module docstring). Dismissed with a job id."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "app.quit", "Detach", id="waiting.quit"),
        Binding("j", "down", "Down", show=False),
        Binding("k", "up", "Up", show=False),
    ]

    def __init__(self, client: JobClient, endpoint: str) -> None:
        super().__init__(id="waiting-screen")
        self.client = client
        self.endpoint = endpoint
        self.jobs: list[JobSummary] = []
        self.error = ""

    def compose(self) -> ComposeResult:
        with Vertical(id="waiting"):
            msg = Text(end="")
            msg.append("Waiting for job ")
            msg.append_text(safe_text(self.client.job_id or "?", "bold"))
            msg.append(" on ")
            msg.append_text(safe_text(self.endpoint, "bold"))
            msg.append(" …\n", Style(dim=True))
            msg.append("The console attaches as soon as its first agent starts. "
                       "Jobs on this server (enter attaches to one of them):", Style(dim=True))
            yield Static(msg, markup=False, id="waiting-message")
            yield DataTable(id="jobs", cursor_type="row")
            yield Static("", markup=False, id="waiting-status")
        yield KeyFooter()

    def on_mount(self) -> None:
        table = self.query_one("#jobs", DataTable)
        for key, label, width in (("job", "JOB", 28), ("state", "STATE", 11), ("nodes", "NODES", 6),
                                  ("world", "WORLD", 6), ("restarts", "RESTARTS", 9),
                                  ("age", "AGE", 8)):
            table.add_column(Text(label), width=width, key=key)
        table.focus()
        self._poll()

    @work(exclusive=True, group="waiting", exit_on_error=False)
    async def _poll(self) -> None:
        client = self.client
        n = 0
        while True:
            try:
                if await client.job_exists():
                    self.post_message(JobAppeared(client.job_id or ""))
                    return
                if n % LIST_EVERY == 0:
                    self.post_message(JobsListed(await client.list_jobs()))
            except RedisUnavailableError as exc:
                self.post_message(JobsListed(self.jobs, error=str(exc)))
            n += 1
            await asyncio.sleep(POLL_S)  # polling interval: the job has no event to wait on yet

    def on_jobs_listed(self, message: JobsListed) -> None:
        message.stop()
        self.jobs = message.jobs
        self.error = message.error
        table = self.query_one("#jobs", DataTable)
        selected = None
        if table.row_count:
            selected = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        table.clear()
        for j in self.jobs:
            table.add_row(
                safe_text(j.job_id), safe_text(j.state, JOB_STATE_STYLES.get(j.state, "")),
                Text(str(j.nodes)), Text("-" if j.world_size is None else str(j.world_size)),
                Text(f"{j.restarts_used}/{'-' if j.max_restarts is None else j.max_restarts}"),
                Text(fmt_age(j.age_s)), key=j.job_id)
        if selected is not None:
            for i, j in enumerate(self.jobs):
                if j.job_id == selected:
                    table.move_cursor(row=i, animate=False)
        status = Text(end="")
        if self.error:
            status.append_text(safe_text(f"Redis unreachable: {self.error} — retrying…",
                                         Style(color="red")))
        elif not self.jobs:
            status.append("no jobs on this server yet", Style(dim=True))
        self.query_one("#waiting-status", Static).update(status)

    def on_job_appeared(self, message: JobAppeared) -> None:
        message.stop()
        self.dismiss(message.job_id)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if event.row_key.value is not None:
            self.dismiss(str(event.row_key.value))  # attach to this one instead

    def action_down(self) -> None:
        self.query_one("#jobs", DataTable).action_cursor_down()

    def action_up(self) -> None:
        self.query_one("#jobs", DataTable).action_cursor_up()
