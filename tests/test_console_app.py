"""The attach console (Textual) driven by Pilot against real jobs on a real Redis.

Real agents (``tests/scripts/sleeper.py`` workers), the session's redis-server (a private one
for the restart test), real keys through Pilot. Waits are conditions with deadlines
(``wait_until_async``); the cursor blink is frozen. The SVG snapshots are drawn from a fixed,
hand-written set of records (no agent, no clock), so they are the same on every run.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import re
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from rich.text import Text
from textual.pilot import Pilot
from textual.widgets import Button, Input

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.coordination.wire.event_records import EventType, decode_event, encode_event
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.log_records import LogBatch, decode_log_entries
from elastic_console.job.state import JobView
from elastic_console.tui.app import ConsoleApp
from elastic_console.tui.navigation import KEY_HELP
from elastic_console.tui.widgets import rank_rows, rank_table
from elastic_console.tui.widgets.dialogs import CommandDialog, DetailScreen
from elastic_console.tui.widgets.footer import KeyFooter
from elastic_console.tui.widgets.help import HelpScreen, help_text
from elastic_console.tui.widgets.log_panel import FilterBar
from elastic_console.tui.widgets.waiting import WaitingScreen
from tests.agents import SCRIPTS, Agent
from tests.waiting import wait_until, wait_until_async

SIZE = (120, 34)
T0 = 1_700_000_000_000  # 2023-11-14 22:13:20 UTC: the snapshots' fixed server time


# -- helpers ------------------------------------------------------------------------------------


class App(ConsoleApp):
    """The console, recording every notification (and checking none is markup)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("cursor_blink", False)
        super().__init__(*args, **kwargs)
        self.notes: list[tuple[str, str]] = []

    def notify(self, message: str, *, title: str = "", severity: Any = "information",
               timeout: float | None = None, markup: bool = True) -> None:
        assert markup is False, f"a notification parsed as markup: {message!r}"
        self.notes.append((message, severity))
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)


def console(redis_url: str, job_id: str, **kwargs: Any) -> App:
    return App(job_id, endpoint=parse_endpoint(redis_url), **kwargs)


def run(app: App, body: Callable[[Pilot[int], App], Awaitable[None]],
        size: tuple[int, int] = SIZE, timeout: float = 60) -> None:
    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await pilot.pause()
            await body(pilot, app)

    asyncio.run(asyncio.wait_for(main(), timeout))


def screen_text(app: ConsoleApp) -> str:
    """What the terminal shows now (every layer composed), as plain text."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


async def loaded(app: App, ranks: int = 1, timeout: float = 20) -> None:
    await wait_until_async(lambda: app.loaded and len(app.view.ranks) >= ranks
                           and app.rank_table.row_count >= ranks, timeout, "the job's history")


async def on_screen(app: App, screen: type, shown: bool = True) -> None:
    """Wait until a screen of type ``screen`` is (or is not) the one on top: pushing and
    dismissing take a few messages, which Pilot's key press does not always wait for."""
    await wait_until_async(lambda: isinstance(app.screen, screen) == shown, 5,
                           f"{screen.__name__} {'on top' if shown else 'gone'}")


async def open_dialog(pilot: Pilot[int], app: App, key: str) -> CommandDialog:
    """Press ``key`` and return the confirm dialog it opened, once Cancel has the focus."""
    await pilot.press(key)
    await on_screen(app, CommandDialog)
    await wait_until_async(lambda: isinstance(app.focused, Button), 5, "the dialog's focus")
    assert app.focused.id == "cancel", "Cancel must be the focused default"
    dialog = app.screen
    assert isinstance(dialog, CommandDialog)
    return dialog


def ticks(app: ConsoleApp, rank: int) -> list[int]:
    """The sleeper's tick numbers of one rank's latest attempt, as the console holds them."""
    out = []
    for _, _, _, text in app.view.logs_for(rank):
        m = re.match(r"tick (\d+) rank", text)
        if m:
            out.append(int(m.group(1)))
    return out


def log_entries(r: redis.Redis, job_id: str) -> int:
    return sum(r.xlen(s) for s in r.smembers(JobKeys(job_id).log_streams))


def stream_ends(r: redis.Redis, job_id: str) -> dict[bytes, bytes]:
    """The last entry id of each of the job's log streams."""
    ends = {}
    for stream in r.smembers(JobKeys(job_id).log_streams):
        last = r.xrevrange(stream, count=1)
        ends[stream] = last[0][0] if last else b"0-0"
    return ends


def lines_after(r: redis.Redis, job_id: str, ends: dict[bytes, bytes]) -> int:
    """How many log lines the job's streams took in after ``ends`` (see stream_ends)."""
    n = 0
    for stream in r.smembers(JobKeys(job_id).log_streams):
        for entry_id, fields in r.xrange(stream, min=b"(" + ends.get(stream, b"0-0")):
            n += sum(len(b.lines) for b in decode_log_entries(entry_id, fields) or ())
    return n


def commands_sent(r: redis.Redis, job_id: str) -> int:
    return r.xlen(JobKeys(job_id).commands)


def events_of(r: redis.Redis, job_id: str, event_type: str) -> list[Any]:
    evs = (decode_event(i, f) for i, f in r.xrange(JobKeys(job_id).events))
    return [e for e in evs if e is not None and e.type == event_type]


def start_job(redis_url: str, job_id: str, tmp: Path, *script: str, nproc: int = 2,
              max_restarts: int = 3, name: str = "agent") -> Agent:
    return Agent(["--redis", redis_url, "--job-id", job_id, "--local-addr", "127.0.0.1",
                  "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
                  "--shutdown-timeout", "3", *script], tmp, name)


def sleeper_job(redis_url: str, job_id: str, tmp: Path, *args: str, **kw: Any) -> Agent:
    agent = start_job(redis_url, job_id, tmp, str(SCRIPTS / "sleeper.py"), *args, **kw)
    r = make_client(redis_url)
    try:
        wait_until(lambda: events_of(r, job_id, EventType.WORKERS_STARTED), 30, "workers")
    finally:
        r.close()
    return agent


def stop_agent(agent: Agent) -> None:
    if agent.proc.poll() is None:
        agent.kill()
    agent.wait(30)


@pytest.fixture(scope="module")
def job(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Agent]]:
    """One running job (2 sleeper workers) shared by the tests that do not change it."""
    job_id = f"app-{uuid.uuid4().hex[:8]}"
    agent = sleeper_job(redis_url, job_id, tmp_path_factory.mktemp("app"))
    yield job_id, agent
    stop_agent(agent)


@pytest.fixture
def own_job(redis_url: str, tmp_path: Path) -> Iterator[tuple[str, Agent]]:
    """A running job of the test's own (for commands that change it)."""
    job_id = f"own-{uuid.uuid4().hex[:8]}"
    agent = sleeper_job(redis_url, job_id, tmp_path)
    yield job_id, agent
    stop_agent(agent)


# -- attaching: history first, then live ------------------------------------------------------


def test_attach_shows_the_history_then_live_lines(job, redis_url):
    job_id, _ = job
    r = make_client(redis_url)
    wait_until(lambda: log_entries(r, job_id) > 5, 20, "log batches before the console attaches")
    r.close()
    app = console(redis_url, job_id)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=2)
        first = ticks(app, 0)
        assert first and first[0] == 0, "the history from the job's start is shown first"
        header = screen_text(app).splitlines()[:2]
        assert f"job {job_id}" in header[0] and "RUNNING" in header[0]
        assert "world 2" in header[0] and "restarts 0/3" in header[0]
        assert redis_url in header[1] and "● connected" in header[1]
        # Live: new lines keep arriving, in order, none twice.
        await wait_until_async(lambda: len(ticks(app, 0)) > len(first) + 10, 10, "live lines")
        got = ticks(app, 0)
        assert got == list(range(got[0], got[0] + len(got)))
        rows = app.rank_table.order()
        assert rows == [0, 1]
        assert [app.rank_table.shown_row(r)[4] for r in rows] == ["running", "running"]
        text = screen_text(app)
        assert "LOGS  all ranks" in text and "following" in text
        assert re.search(r"\[  1\] tick \d+ rank 1", text), "rank-tagged lines on screen"

    run(app, body)


def test_log_keys_a_e_w_t_f_and_rank_movement(job, redis_url):
    job_id, _ = job
    app = console(redis_url, job_id)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=2)
        log = app.log_view
        assert log.source is app.view.all_logs and log.show_rank_tags
        # a: the selected rank only: the view points at that rank's own ring (no scan).
        await pilot.press("a")
        assert app.selected_rank == 0 and log.source is app.view.logs[0]
        assert not log.show_rank_tags
        assert "LOGS  rank 0" in screen_text(app)
        # j / down / k / up move the rank cursor; the log follows the selection.
        await pilot.press("j")
        assert app.selected_rank == 1 and log.source is app.view.logs[1]
        await pilot.press("k")
        assert app.selected_rank == 0
        await pilot.press("down")
        assert app.selected_rank == 1
        await pilot.press("up")
        assert app.selected_rank == 0 and log.source is app.view.logs[0]
        await pilot.press("a")
        assert log.source is app.view.all_logs and log.show_rank_tags
        # e: stderr only (the sleeper writes nothing there).
        await pilot.press("e")
        assert log.stderr_only and log.line_count == 0 and "stderr only" in screen_text(app)
        await pilot.press("e")
        assert not log.stderr_only and log.line_count > 0
        # w: wrap; t: timestamps.
        await pilot.press("w")
        assert log.wrap
        await pilot.press("w")
        assert not log.wrap
        stamped = re.compile(r"^\d\d:\d\d:\d\d\.\d\d\d \[  \d\] tick", re.M)
        assert stamped.search(screen_text(app))
        await pilot.press("t")
        assert not log.show_timestamps
        await pilot.pause()
        assert not stamped.search(screen_text(app))
        assert re.search(r"^\[  \d\] tick", screen_text(app), re.M)
        await pilot.press("t")
        assert log.show_timestamps
        # Follow: scrolling up pauses it (the view stays put), f resumes.
        log.focus()
        await pilot.press("up", "up")
        assert not log.follow
        await pilot.pause()
        assert "paused (f follows)" in screen_text(app)
        top = log.line_at_row(round(log.scroll_y))
        await wait_until_async(lambda: app.view.all_logs.total_appended > (top[0] + 30), 10,
                               "more lines")
        await pilot.pause()
        assert log.line_at_row(round(log.scroll_y)) == top  # it did not move
        await pilot.press("f")
        assert log.follow and log.scroll_y == log.max_scroll_y
        await pilot.press("up")
        assert not log.follow
        await pilot.press("end")
        assert log.follow

    run(app, body)


def test_filter_slash_regex_errors_enter_and_esc(job, redis_url):
    job_id, _ = job
    app = console(redis_url, job_id)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=2)
        log = app.log_view
        bar = app.query_one("#filter", FilterBar)
        await pilot.press("slash")
        assert bar.display and isinstance(app.focused, Input)
        await pilot.press(*"rank 1 t=")
        await wait_until_async(lambda: log.pattern is not None
                               and log.pattern.pattern == "rank 1 t=", 5, "the filter to apply")
        assert log.line_count > 0
        assert all(" rank 1 " in line[3] for line in log.visible_lines())
        # An invalid regex: a one-line error in the bar, the last valid filter stays.
        await pilot.press("(")
        await pilot.pause()
        assert bar.error.startswith("invalid regex: missing ), unterminated subpattern")
        assert "invalid regex" in screen_text(app)
        assert log.pattern.pattern == "rank 1 t="
        await pilot.press("enter")  # refused while invalid: the bar stays open
        assert bar.display
        await pilot.press("backspace", "enter")
        assert not bar.display and app.focused is log
        assert log.pattern.pattern == "rank 1 t=" and "/rank 1 t=/" in screen_text(app)
        # Smart case: upper case makes it case-sensitive.
        await pilot.press("slash", *"X", "enter")
        assert log.pattern.pattern == "rank 1 t=X" and log.line_count == 0
        # esc: closes the bar and clears the filter.
        await pilot.press("slash")
        assert bar.display
        await pilot.press("escape")
        assert not bar.display and log.pattern is None and log.line_count > 0
        # esc also clears a filter kept by enter.
        await pilot.press("slash", *"TICK", "enter")
        assert log.pattern is not None and log.line_count == 0  # smart case: no match
        await pilot.press("escape")
        assert log.pattern is None and "│ /" not in screen_text(app)

    run(app, body)


def test_help_tab_sort_and_palette(job, redis_url):
    job_id, _ = job
    app = console(redis_url, job_id)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=2)
        await pilot.press("question_mark")
        await on_screen(app, HelpScreen)
        assert "restart the worker group" in screen_text(app)  # the top of it, on screen
        text = help_text(app.screen.rows).plain  # all of it (it scrolls)
        for key, what in (("r", "restart the worker group"), ("s", "stop the job"),
                          ("K", "send SIGTERM"), ("q", "detach"), ("/", "filter"),
                          ("a", "all ranks"), ("e", "stderr only"), ("w", "wrap"),
                          ("t", "timestamps"), ("f  end", "follow"), ("o  O", "sort"),
                          ("enter", "traceback"), ("tab", "move between"), ("esc", "back"),
                          ("?", "this help"), ("ctrl+p", "command palette")):
            assert re.search(rf"^  {re.escape(key)}\s+.*{what}", text, re.M), key
        # every key bound on the main screen is in the help
        helped = {k for _, keys, _, _ in KEY_HELP for k in keys.split()}
        for binding in ConsoleApp.BINDINGS:
            key = {"question_mark": "?", "slash": "/", "escape": "esc",
                   "colon": ":"}.get(binding.key, binding.key)
            assert key in helped, binding.key
        await pilot.press("escape")
        await on_screen(app, HelpScreen, shown=False)
        # tab: ranks -> timeline -> logs -> ranks
        assert app.focused is app.rank_table
        await pilot.press("tab")
        assert app.focused is app.timeline
        await pilot.press("tab")
        assert app.focused is app.log_view
        await pilot.press("tab")
        assert app.focused is app.rank_table
        # o cycles the sort column, O reverses; the cursor stays on its rank.
        await pilot.press("j")
        assert app.selected_rank == 1
        await pilot.press("O")
        assert app.rank_table.order() == [1, 0] and app.selected_rank == 1
        assert "Ranks · sorted by rank (reversed)" in screen_text(app)
        await pilot.press("o")
        assert app.rank_table.sort_column == "host" and app.selected_rank == 1
        # The command palette knows the console's commands.
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for title in ("Restart the worker group", "Stop the job", "SIGTERM the selected rank",
                      "Filter the logs", "Help: every key", "Detach"):
            assert title in titles

    run(app, body)


def test_readers_step_aside_while_a_key_is_handled(job, redis_url):
    """A key closes the input gate: the Redis reader stops folding records until the key is
    drawn (input_gate.py), then catches up with nothing lost; the frame after the key opens
    the gate by itself, long before its deadline."""
    job_id, _ = job
    app = console(redis_url, job_id)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=2)
        gate = app.input_gate
        gate.hold_max_s = 30.0
        gate.close()  # as a key does; nothing will draw it
        before = app.view.lines_total
        r = make_client(redis_url)
        try:
            mark = stream_ends(r, job_id)
            await wait_until_async(lambda: lines_after(r, job_id, mark) >= 40, 10,
                                   "lines in Redis while the gate is closed")
        finally:
            r.close()
        assert app.view.lines_total - before < 20  # at most the reply in hand when it closed
        held = app.view.lines_total
        gate.open()
        await wait_until_async(lambda: app.view.lines_total - held >= 40, 10, "the catch-up")
        ticks0 = ticks(app, 0)
        assert ticks0 == list(range(ticks0[0], ticks0[0] + len(ticks0)))  # no gap, no repeat
        holds = gate.holds
        await pilot.press("j")
        assert gate.holds == holds + 1
        await wait_until_async(lambda: gate._opened.is_set(), 5, "the gate opened by the frame")
        assert app.selected_rank == 1

    run(app, body)


def test_q_detaches_and_the_job_keeps_running(job, redis_url):
    job_id, agent = job
    app = console(redis_url, job_id)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=2)
        await pilot.press("q")

    run(app, body)
    assert app.return_code == 0
    assert agent.proc.poll() is None
    r = make_client(redis_url)
    try:
        assert commands_sent(r, job_id) == 0, "detaching sends nothing"
        assert not events_of(r, job_id, EventType.JOB_STOPPED)
    finally:
        r.close()


# -- read-only -------------------------------------------------------------------------------


def assert_commands_refused(app: App, why: str) -> Callable[[Pilot[int], App], Awaitable[None]]:
    async def check(pilot: Pilot[int], app_: App) -> None:
        for key, action in (("r", "restart"), ("s", "stop"), ("K", "kill_rank")):
            before = len(app.notes)
            await pilot.press(key)
            await pilot.pause()
            assert not isinstance(app.screen, CommandDialog), key
            assert len(app.notes) == before + 1, key
            message, severity = app.notes[-1]
            assert message.startswith(why) and severity == "warning", message
            assert app.check_action(action, ()) is None  # the footer shows it disabled
        footer = [b for b in app.screen.active_bindings.values() if b.binding.key in "rsK"]
        assert {b.binding.key for b in footer} == {"r", "s", "K"}
        assert not any(b.enabled for b in footer)
        await pilot.press("question_mark")
        assert screen_text(app).count("disabled: " + why[:30]) == 3
        await pilot.press("escape")
    return check


def test_read_only_flag_disables_commands(job, redis_url):
    job_id, _ = job
    app = console(redis_url, job_id, read_only=True)
    r = make_client(redis_url)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=2)
        await assert_commands_refused(app, "read-only (--read-only)")(pilot, app)
        assert "read-only" in screen_text(app).splitlines()[1]

    try:
        run(app, body)
        assert commands_sent(r, job_id) == 0
    finally:
        r.close()


def test_an_acl_user_that_may_not_write_commands(job, redis_url, r):
    job_id, _ = job
    user, password = f"viewer-{uuid.uuid4().hex[:6]}", f"pw-{uuid.uuid4().hex}"
    r.execute_command("ACL", "SETUSER", user, "on", f">{password}", "%R~*", "+@read", "+ping",
                      "+acl|whoami", "+acl|dryrun")
    url = f"redis://{user}:{password}@{redis_url.split('://', 1)[1]}"
    app = console(url, job_id)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=2)
        await wait_until_async(lambda: app.write_denied, 10, "the ACL check")
        why = f"read-only: the Redis user '{user}' may not write the command stream"
        await assert_commands_refused(app, why)(pilot, app)
        assert password not in screen_text(app)
        assert all(password not in m for m, _ in app.notes)

    try:
        run(app, body)
        assert commands_sent(r, job_id) == 0
    finally:
        r.execute_command("ACL", "DELUSER", user)


# -- commands ---------------------------------------------------------------------------------


def test_r_confirm_cancel_then_restart_with_acks(own_job, redis_url, r):
    job_id, agent = own_job
    app = console(redis_url, job_id)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=2)
        await wait_until_async(lambda: app.check_action("restart", ()) is True, 10, "enabled")
        # esc cancels, sending nothing; Cancel is the focused default (enter cancels too).
        await open_dialog(pilot, app, "r")
        assert "Restart the worker group?" in screen_text(app)
        await pilot.press("escape")
        await on_screen(app, CommandDialog, shown=False)
        await open_dialog(pilot, app, "r")
        await pilot.press("enter")
        await on_screen(app, CommandDialog, shown=False)
        await open_dialog(pilot, app, "r")
        await pilot.press("n")
        await on_screen(app, CommandDialog, shown=False)
        assert commands_sent(r, job_id) == 0
        # y sends; the dialog shows the ack as it arrives, then the outcome.
        dialog = await open_dialog(pilot, app, "r")
        await pilot.press("y")
        await wait_until_async(lambda: dialog.phase == "done", 15, "the acks")
        progress = dialog.progress_text
        assert re.search(r"restart command c-[0-9a-f]{8} sent; waiting for 1 agent", progress)
        assert "✓ accepted by " in progress and "accepted by 1/1 agent" in progress
        assert commands_sent(r, job_id) == 1
        await pilot.press("y")  # y again does not send again
        assert commands_sent(r, job_id) == 1
        await pilot.press("escape")
        await on_screen(app, CommandDialog, shown=False)
        # The workers were started again: a new workers_started, rank restarts 1.
        await wait_until_async(lambda: all(app.view.ranks[i].restarts == 1 for i in (0, 1)),
                               20, "the restarted workers")
        await wait_until_async(lambda: app.rank_table.shown_row(0)[5] == "1", 5, "the table")
        kinds = [(e.kind, e.text) for e in app.timeline.entries]
        assert any(k == "command" and "sent from this console" in t for k, t in kinds)
        assert any(k == "ack" and "accepted" in t for k, t in kinds)
        assert any(k == "restart" and "restarting (command)" in t for k, t in kinds)
        assert agent.proc.poll() is None

    run(app, body)
    assert len(events_of(r, job_id, EventType.WORKERS_STARTED)) == 2


def test_K_sends_sigterm_to_the_selected_rank(own_job, redis_url, r):
    job_id, _ = own_job
    app = console(redis_url, job_id)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=2)
        await wait_until_async(lambda: app.check_action("kill_rank", ()) is True, 10, "enabled")
        await pilot.press("j")
        assert app.selected_rank == 1
        pid = app.view.ranks[1].pid
        dialog = await open_dialog(pilot, app, "K")
        assert f"Rank 1 (pid {pid} on " in screen_text(app)
        await pilot.press("y")
        await wait_until_async(lambda: dialog.phase == "done", 15, "the acks")
        assert "SIGTERM sent to rank 1" in dialog.progress_text
        await pilot.press("escape")
        await wait_until_async(
            lambda: any(e.kind == "failure" and "rank 1 failed" in e.text and "SIGTERM" in e.text
                        for e in app.timeline.entries), 15, "rank 1's worker_exited")
        await wait_until_async(lambda: app.rank_table.shown_row(1)[6] == "SIGTERM", 5,
                               "the last exit in the table")

    run(app, body)
    exited = events_of(r, job_id, EventType.WORKER_EXITED)
    assert any(e.data["rank"] == 1 and e.data["signal"] == "SIGTERM" for e in exited)


def test_s_stops_the_job(own_job, redis_url):
    job_id, agent = own_job
    app = console(redis_url, job_id)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=2)
        await wait_until_async(lambda: app.check_action("stop", ()) is True, 10, "enabled")
        dialog = await open_dialog(pilot, app, "s")
        assert "Stop the job?" in screen_text(app)
        await pilot.press("y")
        await wait_until_async(lambda: dialog.phase == "done", 15, "the acks")
        assert "accepted by 1/1 agent" in dialog.progress_text
        await wait_until_async(lambda: agent.proc.poll() is not None, 30, "the agent to exit")
        await wait_until_async(lambda: app.view.state == "stopped", 10, "the stopped state")
        await pilot.press("escape")
        # the header follows the JobView at the next refresh tick (10 Hz)
        await wait_until_async(lambda: "STOPPED" in screen_text(app).splitlines()[0], 5,
                               "the header to say so")
        # Now there is nothing to stop: the keys say so.
        await pilot.press("s")
        await on_screen(app, CommandDialog, shown=False)
        assert "has already stopped" in app.notes[-1][0]

    run(app, body)
    assert agent.wait(10) == 143


def test_missing_acks_are_named_after_the_timeout(redis_url, r, job_id):
    """A node the job says is active but that never answers (no agent: hand-written events)."""
    keys = JobKeys(job_id)
    for i, (etype, data) in enumerate((
        (EventType.NODE_JOINED, {"host": "ghost", "pid": 1, "nproc": 1}),
        (EventType.RENDEZVOUS_COMPLETE, {"round": 0, "world_size": 1, "group_world_size": 1,
                                          "nodes": [{"node": "ghost-1-x", "host": "ghost",
                                                     "group_rank": 0, "nproc": 1}]}),
        (EventType.WORKERS_STARTED, {"round": 0, "attempt": 0, "restart_count": 0, "ranks": [0],
                                     "local_ranks": [0], "pids": [7], "host": "ghost"}),
    ), start=1):
        r.xadd(keys.events, encode_event(etype, "ghost-1-x", data, i))
    app = console(redis_url, job_id, ack_timeout=0.5)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=1)
        dialog = await open_dialog(pilot, app, "r")
        await pilot.press("y")
        await wait_until_async(lambda: dialog.phase == "done", 10, "the timeout")
        assert "no answer within 0.5 s from: ghost (ghost-1-x)" in dialog.progress_text
        assert app.notes[-1][1] == "error" and "ghost (ghost-1-x)" in app.notes[-1][0]
        await wait_until_async(lambda: any(e.kind == "command" and "no answer" in e.text
                                           for e in app.timeline.entries), 5, "the timeline")

    run(app, body)
    assert r.xlen(keys.commands) == 1


# -- failures, hostile output ---------------------------------------------------------------

FAILING_WORKER = r'''
import json, os, sys, time
rank, attempt = int(os.environ["RANK"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"worker {rank} attempt {attempt}", flush=True)
if rank == 1 and attempt == "0":
    time.sleep(0.3)
    tb = ('Traceback (most recent call last):\n  File "train.py", line 7, in <module>\n'
          '    step()\nValueError: loss is [bold]nan[/bold] \x1b]0;pwned\x07')
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
        json.dump({"message": {"message": "ValueError: loss is nan",
                               "extraInfo": {"py_callstack": tb, "timestamp": str(int(time.time()))}}}, f)
    print("about to fail", file=sys.stderr, flush=True)
    sys.exit(1)
time.sleep(60)
'''


def test_failure_root_cause_and_traceback_modal(redis_url, tmp_path, job_id):
    script = tmp_path / "failing.py"
    script.write_text(FAILING_WORKER)
    agent = start_job(redis_url, job_id, tmp_path, str(script), max_restarts=1)
    app = console(redis_url, job_id)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=2, timeout=30)
        await wait_until_async(
            lambda: any(e.kind == "group_failed" for e in app.timeline.entries)
            and any(e.kind == "restart" for e in app.timeline.entries), 30, "failure and restart")
        entries = app.timeline.entries
        failure = next(i for i, e in enumerate(entries) if e.kind == "failure")
        cause = next(i for i, e in enumerate(entries) if e.kind == "group_failed")
        assert "rank 1 failed on " in entries[failure].text
        assert "ValueError: loss is nan" in entries[failure].text
        assert "worker group failed: rank 1 on " in entries[cause].text
        restart = next(e for e in entries if e.kind == "restart")
        assert "restarting (failure): 1/1 restarts used" in restart.text
        text = screen_text(app)
        assert "root cause worker group failed: rank 1" in text
        # Enter on the root cause opens the traceback, scrollable; esc closes it.
        app.timeline.focus()
        await pilot.pause()
        app.timeline.highlighted = cause
        await pilot.press("enter")
        await on_screen(app, DetailScreen)
        shown = screen_text(app)
        assert 'File "train.py", line 7, in <module>' in shown
        assert r"ValueError: loss is [bold]nan[/bold] \x1b]0;pwned\x07" in shown
        await pilot.press("escape")
        await on_screen(app, DetailScreen, shown=False)
        # The failed rank is red-flagged in the table until it runs again.
        await wait_until_async(lambda: app.view.ranks[1].restarts == 1, 20, "the restart")
        assert app.view.ranks[1].last_exit == 1

    try:
        run(app, body)
    finally:
        stop_agent(agent)


def test_hostile_worker_output_is_shown_as_text(redis_url, tmp_path, job_id):
    agent = start_job(redis_url, job_id, tmp_path, str(SCRIPTS / "hostile_output.py"), nproc=1)
    assert agent.wait(60) == 0, agent.output[-2000:]
    app = console(redis_url, job_id)  # a late attach: everything comes from the history

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=1)
        await wait_until_async(lambda: app.view.lines_total >= 5, 10, "the lines")
        log = app.log_view
        rows = [log.render_line(y) for y in range(log.scrollable_content_region.height)]
        text = "\n".join(strip.text for strip in rows)
        # The title is data (escaped) when its read held no cursor movement, else the agent
        # rendered it (the same read as the next line's screen erase) and removed it.
        assert r"\x1b]0;pwned\x07title" in text or re.search(r"\]\s+title\s", text)
        # Erasing the screen is rendered by the agent (records/screen.py), not shown as data.
        assert "clear red [bold]markup[/bold]" in text and r"\x1b[2J" not in text
        assert "after the big line" in text and "bad utf8 \ufffd\ufffd end" in text
        assert re.search(r"\[  0\] x{50}", text)  # the 1 MB line (cut at 4000 cells)
        for strip in rows:
            for seg in strip:
                assert not any(c in seg.text for c in "\x1b\x07\r"), seg
                assert seg.style is None or not seg.style.link, seg
        red = [seg for strip in rows for seg in strip if seg.text == "red"]
        assert red and red[0].style.color.number == 1  # SGR colour kept
        assert "SUCCEEDED" in screen_text(app).splitlines()[0]

    run(app, body)


def test_hostile_text_in_events_is_never_markup_anywhere():
    """Host names, messages and tracebacks from events, in the header, table, timeline,
    dialogs and notifications: shown literally (an offline view, no Redis needed)."""
    view = fixed_view()
    evil = "evil[link=http://x]click[/link]\x1b]0;t\x07[red]"
    ev(view, T0 + 5000, EventType.NODE_LEFT, "b-202-y", host=evil, reason="[bold]signal[/bold]")
    app = App("job-42", view=view, utc=True, clock=lambda: T0 + 6000)

    async def body(pilot: Pilot[int], app: App) -> None:
        text = screen_text(app)
        assert r"evil[link=http://x]click[/link]\x1b]0;t\x07[red]" in text
        assert "[bold]signal[/bold]" in text
        await pilot.press("j", "j")
        await open_dialog(pilot, app, "K")
        assert "Rank 2 (pid 5352 on gpu-b[red]) gets SIGTERM" in screen_text(app)
        await pilot.press("y")
        await wait_until_async(lambda: app.screen.phase == "done", 5, "the offline refusal")
        assert app.notes[-1][1] == "error"
        for strip in app.screen._compositor.render_strips():
            for seg in strip:
                assert "\x1b" not in seg.text and "\x07" not in seg.text
                assert seg.style is None or not seg.style.link, seg

    run(app, body)


# -- Redis restarted while attached -------------------------------------------------------------


def test_redis_restart_banner_then_no_gap_and_no_duplicate(private_redis, tmp_path, job_id):
    srv = private_redis
    srv.stop()
    srv.extra_args = ["--appendonly", "yes", "--appendfsync", "always"]
    srv.start()
    agent = sleeper_job(srv.url, job_id, tmp_path, nproc=1)
    app = console(srv.url, job_id)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=1)
        await wait_until_async(lambda: len(ticks(app, 0)) > 5, 10, "lines before the outage")
        srv.kill()
        await wait_until_async(lambda: "Redis unreachable" in screen_text(app), 15, "the banner")
        text = screen_text(app)
        assert "● disconnected" in text and "Redis unreachable — reconnecting… (cannot reach" in text
        seen_at_outage = max(ticks(app, 0))
        await asyncio.to_thread(srv.start)
        await wait_until_async(lambda: "Redis unreachable" not in screen_text(app), 20,
                               "the banner to go")
        assert "● connected" in screen_text(app)
        await wait_until_async(lambda: max(ticks(app, 0)) > seen_at_outage + 40, 20,
                               "lines written after the restart")
        got = ticks(app, 0)
        assert got == list(range(got[0], got[0] + len(got))), "a gap or a duplicate"
        assert any("reconnected" in m for m, _ in app.notes)

    try:
        run(app, body, timeout=90)
    finally:
        stop_agent(agent)


# -- a job that does not exist yet -------------------------------------------------------------


def test_waiting_screen_lists_jobs_then_switches_when_the_job_appears(job, redis_url, tmp_path):
    other, _ = job
    job_id = f"later-{uuid.uuid4().hex[:8]}"
    app = console(redis_url, job_id)
    agents: list[Agent] = []

    async def body(pilot: Pilot[int], app: App) -> None:
        await wait_until_async(lambda: isinstance(app.screen, WaitingScreen), 10, "waiting")
        await wait_until_async(lambda: other in screen_text(app), 10, "the known jobs")
        text = screen_text(app)
        assert f"Waiting for job {job_id} on {redis_url}" in text
        assert re.search(rf"{other}\s+running\s+1\s+2\s+0/3", text)
        agents.append(await asyncio.to_thread(sleeper_job, redis_url, job_id, tmp_path, nproc=1))
        await wait_until_async(lambda: not isinstance(app.screen, WaitingScreen), 10, "switch")
        await loaded(app, ranks=1)
        await wait_until_async(lambda: ticks(app, 0), 10, "its lines")
        assert f"job {job_id}" in screen_text(app).splitlines()[0]

    try:
        run(app, body)
    finally:
        for a in agents:
            stop_agent(a)


def test_enter_on_the_waiting_screen_attaches_to_another_job(job, redis_url):
    other, _ = job
    app = console(redis_url, f"never-{uuid.uuid4().hex[:8]}")

    async def body(pilot: Pilot[int], app: App) -> None:
        await wait_until_async(lambda: isinstance(app.screen, WaitingScreen)
                               and any(j.job_id == other for j in app.screen.jobs), 10, "jobs")
        screen = app.screen
        row = next(i for i, j in enumerate(screen.jobs) if j.job_id == other)
        screen.query_one("#jobs").move_cursor(row=row)
        await pilot.press("enter")
        await on_screen(app, WaitingScreen, shown=False)
        assert app.job_id == other
        await loaded(app, ranks=2)
        await wait_until_async(lambda: ticks(app, 1), 10, "its lines")
        assert f"job {other}" in screen_text(app).splitlines()[0]

    run(app, body)


def test_attach_scrollback_flag_and_no_terminal(redis_url):
    from elastic_console.cli import build_parser, main

    args = build_parser().parse_args(["attach", "j", "--scrollback", "500", "--read-only"])
    assert (args.scrollback, args.read_only) == (500, True)
    default = App("j")
    assert build_parser().parse_args(["attach", "j"]).scrollback == default.scrollback
    assert main(["attach", "j", "--scrollback", "0"]) == 2
    # What the app was configured with is what its view keeps, per rank and interleaved.
    for app in (default, App("j", scrollback=500), App("j", scrollback=default.all_scrollback * 2)):
        assert app.view.scrollback == app.scrollback
        assert app.view.all_scrollback == app.all_scrollback >= app.scrollback
    assert App("j", scrollback=500).view.scrollback == 500
    # Without a terminal there is nothing to draw: one line, status 2 (pytest's stdin is no tty).
    assert main(["--redis", redis_url, "attach", "no-such-job-yet"]) == 2


# -- many ranks ----------------------------------------------------------------------------------


def big_view(ranks: int = 1024) -> JobView:
    view = JobView("big", scrollback=10)
    view.set_connection(True, "redis://h:6379")
    ev(view, T0, EventType.RENDEZVOUS_COMPLETE, "a-1-x", round=0, world_size=ranks,
       nodes=[{"node": "a-1-x", "host": "a", "group_rank": 0, "nproc": ranks}])
    ev(view, T0 + 1, EventType.WORKERS_STARTED, "a-1-x", round=0, attempt=0, restart_count=0,
       ranks=list(range(ranks)), local_ranks=list(range(ranks)),
       pids=list(range(1000, 1000 + ranks)))
    return view


def test_1024_ranks_table_computes_only_what_is_visible(monkeypatch: pytest.MonkeyPatch):
    view = big_view()
    app = App("big", view=view, clock=lambda: T0 + 5000)

    async def body(pilot: Pilot[int], app: App) -> None:
        table = app.rank_table
        assert table.row_count == 1024
        computed: list[int] = []
        original = rank_rows.row_values

        def counting(r: Any, now_ms: int) -> tuple[str, ...]:
            computed.append(r.rank)
            return original(r, now_ms)

        monkeypatch.setattr(rank_table, "row_values", counting)
        for rank in range(1024):  # every rank printed a line: every row's QUIET changes
            view.apply_logs(LogBatch("a-1-x", rank, rank, 0, "out", 1, ["x"], id=f"{T0 + 4000}-0"))
        table.sync(view, T0 + 5000, full=True)
        visible = table.scrollable_content_region.height - 1  # minus the header
        assert 0 < len(computed) <= visible, len(computed)  # the rows on screen, not 1024
        assert set(computed) <= set(range(visible))
        assert table.shown_row(0)[9] == "1s" and table.shown_row(1023) is None
        await pilot.press("G")  # rows scrolled into view are brought up to date at once
        await pilot.pause()
        assert table.selected_rank == 1023 and table.shown_row(1023)[9] == "1s"
        assert "1023" in screen_text(app)

    run(app, body)


def test_rank_table_cursor_keys_clicks_and_sorting():
    """The rank table's own keys and mouse: j/k/arrows, page keys, g/G, home/end; a click on a
    row selects it, on a header sorts by that column (again: reversed); the selection and the
    log follow the rank, not the row, through every re-sort."""
    view = big_view(64)
    for rank in range(64):  # rank 63 is the busiest, rank 0 the quietest
        view.apply_resources({rank: {"cpu": float(rank), "rss": rank << 20, "threads": 1,
                                     "ts": 1_700_000_002.0}})
    app = App("big", view=view, clock=lambda: T0 + 5000)

    async def body(pilot: Pilot[int], app: App) -> None:
        table = app.rank_table
        page = table.scrollable_content_region.height - 1
        assert table.selected_rank == 0 == app.selected_rank
        await pilot.press("j", "down")
        assert table.selected_rank == 2 == app.selected_rank
        await pilot.press("k")
        assert app.selected_rank == 1
        # The log panel's title follows at its next refresh, not within the key's handling.
        await wait_until_async(lambda: "rank 1" in screen_text(app), 5, "the log of rank 1")
        await pilot.press("pagedown")
        assert table.cursor_row == 1 + page and table.scroll_y > 0
        await pilot.press("G")
        assert app.selected_rank == 63 and table.scroll_y == table.max_scroll_y
        await pilot.press("home")
        assert app.selected_rank == 0 and table.scroll_y == 0
        await pilot.press("end", "g")
        assert app.selected_rank == 0
        # a click on the third row selects rank 2 (row 0 of the widget is the header)
        region = table.content_region
        await pilot.click(table, offset=(region.x - table.region.x + 2,
                                         region.y - table.region.y + 3))
        assert app.selected_rank == 2
        # a click on the CPU% header sorts by it; again: reversed (busiest first)
        shown = table.columns  # 64 ranks: the vertical scrollbar's cells cost LOCAL its place
        cpu_x = sum(w + 2 for key, _, w, _ in rank_rows.COLUMNS
                    if key in shown[:shown.index("cpu")]) + 1
        header = (region.x - table.region.x + cpu_x, region.y - table.region.y)
        await pilot.click(table, offset=header)
        assert table.sort_column == "cpu" and not table.sort_reverse
        assert table.order()[:3] == [0, 1, 2] and app.selected_rank == 2
        await pilot.click(table, offset=header)
        assert table.sort_reverse and table.order()[:3] == [63, 62, 61]
        assert app.selected_rank == 2 and table.cursor_row == 61
        assert "Ranks · sorted by cpu% (reversed)" in screen_text(app)
        assert "CPU%▼" in screen_text(app)
        # a rank that becomes the busiest moves up at the next full sync; the cursor follows
        view.apply_resources({2: {"cpu": 99.0, "rss": 1, "threads": 1, "ts": 1_700_000_009.0}})
        table.sync(view, T0 + 5000, full=True)
        assert table.order()[0] == 2 and table.cursor_row == 0 and app.selected_rank == 2
        await wait_until_async(lambda: "rank 2" in screen_text(app), 5, "the log of rank 2")

    run(app, body)


def test_the_footer_shows_the_focused_keys_and_a_click_presses_one():
    """One line, no widget per key (Textual's Footer recomposes on every focus change): the
    keys follow the focus (the timeline adds Details, the filter input hides the letters it
    takes as text), disabled commands are dimmed, and a click on a key presses it."""
    app = App("job-42", view=fixed_view(), utc=True, clock=lambda: T0 + 6000, read_only=True)

    async def body(pilot: Pilot[int], app: App) -> None:
        footer = app.screen.query_one(KeyFooter)
        await wait_until_async(lambda: footer.shown, 5, "the footer")

        def line() -> str:
            return screen_text(app).splitlines()[-1]

        def shown() -> dict[str, bool]:
            return {description: enabled for _, _, description, enabled in footer.shown}

        # the job keys first: at 80 columns they are the ones still on the line
        assert line().startswith(" q Detach  ? Help  r Restart  s Stop  K SIGTERM  / Filter")
        assert line().rstrip().endswith("▏^p palette")
        assert shown()["Restart"] is False and shown()["Wrap"] is True  # --read-only
        assert "Details" not in shown()
        await pilot.press("tab")
        await wait_until_async(lambda: "Details" in line(), 5, "the timeline's key")
        await pilot.press("slash")
        await wait_until_async(lambda: "Wrap" not in shown(), 5, "the letters hidden")
        await pilot.press("escape")  # back to the log: its Follow key first
        await wait_until_async(lambda: line().startswith(" end Follow  q Detach"), 5,
                               "the log's keys")
        app.rank_table.focus()
        await wait_until_async(lambda: line().startswith(" q Detach"), 5, "the ranks' keys")
        wrap_x = line().index(" w Wrap") + 2
        assert not app.log_view.wrap
        await pilot.click(KeyFooter, offset=(wrap_x, 0))
        await wait_until_async(lambda: app.log_view.wrap, 5, "wrap on, by a click")
        await pilot.click(KeyFooter, offset=(line().index(" r Restart") + 2, 0))
        await pilot.pause()
        assert not isinstance(app.screen, CommandDialog)  # disabled: a bell, no dialog

    run(app, body)


def test_rank_table_host_names_are_text():
    """A host name is job data: markup shows as brackets, escapes as visible text, SGR as
    colour; a long one is cut with an ellipsis, never spills into the next column."""
    view = big_view(2)
    view.ranks[0].host = "[red]x\x1b]0;t\x07"
    view.ranks[1].host = "\x1b[31mredhost\x1b[0m-with-a-long-name"
    app = App("big", view=view, clock=lambda: T0 + 5000)

    async def body(pilot: Pilot[int], app: App) -> None:
        await pilot.pause()
        table = app.rank_table
        lines = [table.render_line(y) for y in (1, 2)]
        row0, row1 = (line.text for line in lines)
        assert "[red]x\\x1…" in row0  # escaped, cut to the column
        assert "redhost-w…" in row1 and "\x1b" not in row1
        assert any(seg.style and seg.style.color and seg.style.color.number == 1
                   and "redhost" in seg.text for seg in lines[1])
        assert all(line.cell_length == table.scrollable_content_region.width for line in lines)

    run(app, body)


def test_full_collections_wait_for_a_quiet_keyboard():
    """run_app's setting (freeze_gc): keys and clicks hold full collections off; the app's
    refresh runs one once the user has been quiet (GcPolicy; its thresholds in its tests)."""
    app = App("job-42", view=fixed_view(), utc=True, clock=lambda: T0 + 6000, freeze_gc=True)
    policy = app.gc_policy
    assert policy is not None and App("j", view=JobView("j", 10)).gc_policy is None
    policy.min_interval_s, policy.idle_s = 0.0, 0.5
    # The policy's own clock, moved by hand: how quiet the user was does not depend on how
    # busy this machine is.
    now = [policy.last_input]
    policy._clock = lambda: now[0]

    async def body(pilot: Pilot[int], app: App) -> None:
        before = policy.full_collections
        for _ in range(4):  # a key every 0.2 s: never quiet for 0.5 s
            now[0] += 0.2
            t = policy.last_input
            await pilot.press("j")
            assert policy.last_input > t
        ticks = policy.young_collections
        await wait_until_async(lambda: policy.young_collections >= ticks + 3, 5, "refresh ticks")
        assert policy.full_collections == before
        now[0] += 0.5
        await wait_until_async(lambda: policy.full_collections > before, 5, "a full collection")

    try:
        run(app, body)
    finally:
        gc.unfreeze()
        gc.set_threshold(700, 10, 10)


# -- snapshots ------------------------------------------------------------------------------------

_seq = itertools.count(1)


def ev(view: JobView, ms: int, etype: str, node: str, **data: Any) -> None:
    e = decode_event(f"{ms}-0", encode_event(etype, node, data, next(_seq)))
    assert e is not None
    view.apply_event(e)


def logs(view: JobView, ms: int, node: str, rank: int, seq: int, lines: list[str],
         stream: str = "out") -> None:
    view.apply_logs(LogBatch(node, rank, rank % 2, 0, stream, seq, lines, id=f"{ms}-0"))


TRACEBACK = ('Traceback (most recent call last):\n  File "train.py", line 12, in <module>\n'
             '    main()\nValueError: [bold]boom[/bold]')


def fixed_view() -> JobView:
    """A two-node job that failed once and runs again; hostile text included. No clock."""
    v = JobView("job-42", all_scrollback=1000)
    v.set_connection(True, "redis://alice:***@redis.internal:6379/0")
    v.apply_meta({"min_nodes": "1", "max_nodes": "4", "max_restarts": "3", "created_ms": str(T0)})
    nodes = [{"node": "a-101-x", "host": "gpu-a", "group_rank": 0, "nproc": 2},
             {"node": "b-202-y", "host": "gpu-b[red]", "group_rank": 1, "nproc": 2}]
    ev(v, T0 + 10, EventType.NODE_JOINED, "a-101-x", host="gpu-a", pid=101, nproc=2)
    ev(v, T0 + 20, EventType.NODE_JOINED, "b-202-y", host="gpu-b[red]", pid=202, nproc=2)
    ev(v, T0 + 30, EventType.RENDEZVOUS_COMPLETE, "a-101-x", round=0, world_size=4, nodes=nodes)
    for node, ranks, pids, host in (("a-101-x", [0, 1], [4242, 4243], "gpu-a"),
                                    ("b-202-y", [2, 3], [5252, 5253], "gpu-b[red]")):
        ev(v, T0 + 40, EventType.WORKERS_STARTED, node, round=0, attempt=0, restart_count=0,
           ranks=ranks, local_ranks=[0, 1], pids=pids, host=host)
    for i in range(6):
        for r in range(4):
            logs(v, T0 + 100 + i * 250 + r, "a-101-x" if r < 2 else "b-202-y", r, i + 1,
                 [f"epoch 1 step {i * 10} \x1b[32mloss={0.7 - i * 0.01 - r * 0.001:.3f}\x1b[0m"])
    logs(v, T0 + 1700, "b-202-y", 3, 1, ["Traceback (most recent call last):",
                                         "ValueError: [bold]boom[/bold] \x1b]0;pwned\x07"], "err")
    cause = {"rank": 3, "local_rank": 1, "pid": 5253, "exit_code": 1, "signal": None,
             "message": "ValueError: [bold]boom[/bold]", "host": "gpu-b[red]", "node": "b-202-y",
             "server_ms": T0 + 1800, "traceback": TRACEBACK}
    ev(v, T0 + 1800, EventType.WORKER_EXITED, "b-202-y", rank=3, local_rank=1, pid=5253,
       exit_code=1, signal=None, message=cause["message"], stopping=False, host="gpu-b[red]",
       error_file={"message": {"message": "ValueError: boom",
                               "extraInfo": {"py_callstack": TRACEBACK, "timestamp": "1"}}})
    ev(v, T0 + 1850, EventType.GROUP_FAILED, "b-202-y", round=0, root_cause=cause,
       failures=[cause])
    ev(v, T0 + 1900, EventType.RESTARTING, "b-202-y", reason="failure", restarts_used=1,
       max_restarts=3)
    ev(v, T0 + 2000, EventType.RENDEZVOUS_COMPLETE, "a-101-x", round=1, world_size=4, nodes=nodes)
    for node, ranks, pids, host in (("a-101-x", [0, 1], [4342, 4343], "gpu-a"),
                                    ("b-202-y", [2, 3], [5352, 5353], "gpu-b[red]")):
        ev(v, T0 + 2100, EventType.WORKERS_STARTED, node, round=1, attempt=1, restart_count=1,
           ranks=ranks, local_ranks=[0, 1], pids=pids, host=host)
    for i in range(30):
        v.apply_resources({r: {"cpu": 50 + (i * 7 + r * 13) % 50, "rss": (800 + r * 50 + i * 3) << 20,
                               "threads": 9, "ts": 1_700_000_002.0 + i} for r in range(4)})
    for i in range(6, 12):
        for r in range(4):
            logs(v, T0 + 2200 + i * 250 + r, "a-101-x" if r < 2 else "b-202-y", r, i + 10,
                 [f"epoch 2 step {i * 10} \x1b[32mloss={0.6 - i * 0.01 - r * 0.001:.3f}\x1b[0m"])
    return v


def snapshot_app() -> App:
    return App("job-42", view=fixed_view(), utc=True, clock=lambda: T0 + 6000)


def test_snapshot_overview(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(snapshot_app(), terminal_size=SIZE)


def test_snapshot_filtered_log(snap_compare: Callable[..., bool]) -> None:
    async def filtered(pilot: Pilot[int]) -> None:
        await pilot.press("slash", *"step [1-3]0|boom", "enter")  # enter applies it at once
        assert pilot.app.log_view.pattern.pattern == "step [1-3]0|boom"

    assert snap_compare(snapshot_app(), terminal_size=SIZE, run_before=filtered)


def test_snapshot_confirm_dialog(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(snapshot_app(), terminal_size=SIZE, press=["r"])


def test_snapshot_help(snap_compare: Callable[..., bool]) -> None:
    assert snap_compare(snapshot_app(), terminal_size=SIZE, press=["question_mark"])


def test_the_fixed_view_renders_without_a_clock_and_without_markup():
    app = snapshot_app()

    async def body(pilot: Pilot[int], app: App) -> None:
        text = screen_text(app)
        assert "gpu-b[red]" in text and "ValueError: [bold]boom[/bold]" in text
        assert "redis://alice:***@redis.internal:6379/0" in text
        assert "22:13:20" in text  # UTC: the same on every machine
        assert isinstance(app.timeline.get_option_at_index(0).prompt, Text)

    run(app, body)



def test_the_resources_panel_folds_away_below_100_columns():
    """Issue 15: at 80 columns the sparklines give their width to the rank table's columns;
    widened again, they come back."""
    app = snapshot_app()

    async def body(pilot: Pilot[int], app: App) -> None:
        assert app.resources.display and app.resources.size.width > 0  # 120 columns
        await pilot.resize_terminal(80, 24)
        await wait_until_async(lambda: app.resources.size.width == 0, 5, "the fold")
        assert "RESTARTS" in screen_text(app) and "EXIT" in screen_text(app)
        await pilot.resize_terminal(120, 34)
        await wait_until_async(lambda: app.resources.size.width > 0, 5, "the panel back")

    run(app, body)
