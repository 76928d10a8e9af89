"""The home screen (the list of jobs) and ctrl+s (save what you see), driven by Pilot against
real jobs and hand-written records on the session's real Redis."""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from textual.pilot import Pilot

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.coordination.wire.event_records import EventType, encode_event
from elastic_agent.coordination.wire.keyspace import JOBS_INDEX, JobKeys
from elastic_console.job.save import new_log_file
from elastic_console.tui.home import JobsScreen
from tests.agents import SCRIPTS
from tests.test_console_app import (
    App,
    loaded,
    on_screen,
    run,
    sleeper_job,
    start_job,
    stop_agent,
)
from tests.waiting import wait_until_async


def write_job(r: redis.Redis, job: str, *, state: str, now_ms: int, events: int = 0) -> None:
    """The records an agent leaves, by hand: meta, index entry, heartbeat, events."""
    k = JobKeys(job)
    meta = {"created_ms": now_ms - 90_000, "max_restarts": 3, "heartbeat_timeout_ms": 10_000,
            "nproc_per_node": 2, "min_nodes": 1, "max_nodes": 1}
    if state in ("succeeded", "failed", "stopped"):
        meta["final_state"] = state
    r.hset(k.meta, mapping=meta)
    r.zadd(JOBS_INDEX, {job: now_ms - 90_000})
    if state == "running":
        r.zadd(k.rdzv_heartbeats, {"node-a": now_ms})
    elif state == "lost":
        r.zadd(k.rdzv_heartbeats, {"node-a": now_ms - 60_000})  # stale: no final state
    for i in range(events):
        r.xadd(k.events, encode_event(EventType.NODE_JOINED, "node-a", {"host": "h"}, i + 1))


def server_ms(r: redis.Redis) -> int:
    secs, micros = r.time()
    return int(secs) * 1000 + int(micros) // 1000


@pytest.fixture(scope="module")
def jobs(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A prefix of its own, a running job (real agent), a finished one whose worker printed
    escape sequences (real agent), and hand-written lost and succeeded records."""
    prefix = f"home{uuid.uuid4().hex[:6]}"
    tmp = tmp_path_factory.mktemp("home")
    running = f"{prefix}-run"
    hostile = f"{prefix}-hostile"
    agent = sleeper_job(redis_url, running, tmp)
    done = start_job(redis_url, hostile, tmp, str(SCRIPTS / "hostile_output.py"), nproc=1,
                     name="hostile")
    assert done.wait(60) == 0, done.output[-2000:]
    r = make_client(redis_url)
    now = server_ms(r)
    write_job(r, f"{prefix}-lost", state="lost", now_ms=now)
    write_job(r, f"{prefix}-ok", state="succeeded", now_ms=now)
    r.close()
    yield {"prefix": prefix, "running": running, "hostile": hostile,
           "lost": f"{prefix}-lost", "ok": f"{prefix}-ok"}
    stop_agent(agent)


def home_app(redis_url: str, job: str | None = None) -> App:
    return App(job, endpoint=parse_endpoint(redis_url))


def home(app: App) -> JobsScreen:
    screen = app.screen
    assert isinstance(screen, JobsScreen), screen
    return screen


def row_text(screen: JobsScreen, job: str) -> list[str]:
    return screen.table.row_cells(job)


# -- the home screen ------------------------------------------------------------------------------


def test_home_lists_jobs_filter_enter_attaches_esc_returns(jobs, redis_url):
    app = home_app(redis_url)
    prefix = jobs["prefix"]

    async def body(pilot: Pilot[int], app: App) -> None:
        await on_screen(app, JobsScreen)
        screen = home(app)
        await wait_until_async(lambda: all(j in screen.shown for j in (
            jobs["running"], jobs["lost"], jobs["ok"], jobs["hostile"])), 10, "the jobs listed")
        assert row_text(screen, jobs["lost"])[1].startswith("lost ")
        assert row_text(screen, jobs["ok"])[1] == "succeeded"
        assert row_text(screen, jobs["hostile"])[1] == "succeeded"
        running = row_text(screen, jobs["running"])
        assert running[1] == "running" and running[2:5] == ["1", "2", "0/3"], running
        # `/` filters (the table narrows to the matches; other tests' jobs go away).
        await pilot.press("slash", *f"{prefix}-(run|lost)")
        await wait_until_async(lambda: sorted(screen.shown) == sorted(
            [jobs["running"], jobs["lost"]]), 5, "the filter to narrow the list")
        await pilot.press("enter")  # keeps the filter, back to the table
        assert isinstance(app.focused, type(screen.table))
        screen.table.move_cursor(row=screen.shown.index(jobs["running"]))
        await pilot.press("enter")
        await on_screen(app, JobsScreen, shown=False)
        assert app.job_id == jobs["running"]
        await loaded(app, ranks=2)
        view = app.view
        # esc: back to the list, the job still selected; enter on it: the same view, no reload.
        await pilot.press("escape")
        await on_screen(app, JobsScreen)
        again = home(app)
        await wait_until_async(lambda: again.listed, 10, "the list again")
        assert again.shown[again.table.cursor_row] == jobs["running"]
        await pilot.press("enter")
        await on_screen(app, JobsScreen, shown=False)
        assert app.view is view and app.job_id == jobs["running"]
        # The list's keys do not reach the job behind it: r on the list opens no dialog.
        await pilot.press("escape")
        await on_screen(app, JobsScreen)
        await pilot.press("r")
        await pilot.pause()
        assert isinstance(app.screen, JobsScreen)
        # Another job: attached afresh.
        await pilot.press("slash", *jobs["hostile"], "enter", "enter")
        await on_screen(app, JobsScreen, shown=False)
        await wait_until_async(lambda: app.job_id == jobs["hostile"] and app.loaded
                               and app.view.lines_total >= 4, 20, "the other job's history")
        assert app.view is not view
        await pilot.press("escape")
        await on_screen(app, JobsScreen)
        await pilot.press("q")
        await wait_until_async(lambda: app.return_code is not None or not app.is_running, 5,
                               "q to quit from the list")

    run(app, body)


def test_attach_job_esc_opens_the_list(jobs, redis_url):
    """`attach JOB` goes straight to the job; esc (nothing to close) opens the list."""
    app = home_app(redis_url, jobs["running"])

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=2)
        assert not isinstance(app.screen, JobsScreen)
        await pilot.press("slash", *"tick", "enter")
        await pilot.press("escape")  # clears the filter first
        await pilot.pause()
        assert app.log_view.pattern is None and not isinstance(app.screen, JobsScreen)
        await pilot.press("escape")
        await on_screen(app, JobsScreen)

    run(app, body)


def test_malformed_job_records_do_not_break_the_list(redis_url, r):
    prefix = f"bad{uuid.uuid4().hex[:6]}"
    now = server_ms(r)
    write_job(r, f"{prefix}-good", state="succeeded", now_ms=now)
    # A meta key of the wrong type, a hash of garbage, hostile text, invalid ids in the index.
    r.set(JobKeys(f"{prefix}-wrongtype").meta, "not a hash")
    r.zadd(JOBS_INDEX, {f"{prefix}-wrongtype": now})
    k = JobKeys(f"{prefix}-garbage")
    r.hset(k.meta, mapping={"created_ms": "yesterday", "max_restarts": "\x1b[2Jmany",
                            "final_state": "\x1b]0;pwned\x07", "heartbeat_timeout_ms": "-5"})
    r.set(k.restarts, "NaN")
    r.set(k.rdzv_heartbeats, "not a zset")
    r.set(k.rdzv_round_info, "{not json")
    r.xadd(k.events, {"v": "999", "type": "\x1b[31mweird", "data": "[]"})
    r.zadd(JOBS_INDEX, {f"{prefix}-garbage": now, f"{prefix} bad{{id}}\x1b[2J": now,
                        "\xff\xfe": now})
    app = home_app(redis_url)

    async def body(pilot: Pilot[int], app: App) -> None:
        await on_screen(app, JobsScreen)
        screen = home(app)
        await wait_until_async(lambda: f"{prefix}-good" in screen.shown, 10, "the good job")
        await pilot.press("slash", *prefix)
        await wait_until_async(lambda: all(j.startswith(prefix) for j in screen.shown), 5,
                               "the filter")
        assert screen.error == "", screen.error
        assert f"{prefix}-good" in screen.shown
        drawn = [screen.table.render_line(y).text for y in range(len(screen.shown) + 1)]
        assert any(f"{prefix}-good" in line for line in drawn)
        assert not any(c in line for line in drawn for c in "\x1b\x07"), drawn
        assert not [n for n in app.notes if "internal error" in n[0] or "failed" in n[0]]
        assert all(" " not in job and "{" not in job for job in screen.shown)

    run(app, body)


# -- ctrl+s: save what you see --------------------------------------------------------------------


def test_ctrl_s_saves_the_filtered_view_without_escapes(jobs, redis_url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = home_app(redis_url, jobs["hostile"])

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=1)
        await wait_until_async(lambda: app.view.lines_total >= 5, 10, "the lines")
        log = app.log_view
        if not log.show_timestamps:
            await pilot.press("t")
        assert log.show_timestamps
        await pilot.press("slash", *"title|markup|utf8", "enter")
        await wait_until_async(lambda: log.line_count == 3 and not log.scanning, 5, "the filter")
        shown = [log.render_line(y).text.rstrip()
                 for y in range(log.scrollable_content_region.height)]
        shown = [line for line in shown if line]
        # The title's OSC shows as a visible escape, or is consumed as a terminal would when
        # the same read holds the next line's cursor movement (agent/supervision/records/screen.py).
        assert len(shown) == 3 and (r"] \x1b]0;pwned\x07title" in shown[0]
                                    or shown[0].endswith("] title")), shown
        assert all(re.match(r"\d\d:\d\d:\d\d\.\d{3} \[ +0\] ", line) for line in shown), shown
        await pilot.press("ctrl+s")
        await wait_until_async(lambda: list(tmp_path.glob("*.log")), 10, "the saved file")
        files = list(tmp_path.glob("*.log"))
        assert len(files) == 1 and files[0].name.startswith(f"{jobs['hostile']}-")
        data = files[0].read_bytes()
        assert b"\x1b" not in data and b"\x07" not in data and b"\r" not in data
        assert data.decode().splitlines() == shown
        await wait_until_async(lambda: any(f"saved 3 lines to {files[0]}" in m
                                           for m, _ in app.notes), 5, "the notification")
        # Again: a second file, the first one untouched.
        await pilot.press("ctrl+s")
        await wait_until_async(lambda: len(list(tmp_path.glob("*.log"))) == 2, 10, "file 2")
        assert files[0].read_bytes() == data

    run(app, body)


def test_save_never_overwrites_and_refuses_symlinks(tmp_path):
    now = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / f"job-{stamp}.log").symlink_to(victim)  # planted at the first name
    (tmp_path / f"job-{stamp}-1.log").write_text("older save")
    (tmp_path / f"job-{stamp}-2.log").symlink_to(tmp_path / "nowhere")  # dangling
    path, fd = new_log_file("job", tmp_path, now)
    os.close(fd)
    assert path.name == f"job-{stamp}-3.log"
    assert victim.read_text() == "keep me" and not (tmp_path / "nowhere").exists()
    assert (tmp_path / f"job-{stamp}-1.log").read_text() == "older save"


def test_save_in_an_unwritable_place_is_one_notification(jobs, redis_url, tmp_path):
    from elastic_console.job.save import save_log_view

    app = home_app(redis_url, jobs["hostile"])

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=1)
        result = await save_log_view(app, tmp_path / "no" / "such" / "dir")
        assert result is None
        assert any(m.startswith("cannot save the log view in") and sev == "error"
                   for m, sev in app.notes), app.notes

    run(app, body)


def test_no_subcommand_and_attach_without_a_job_open_the_list(redis_url):
    from elastic_console.cli import build_parser, main

    assert build_parser().parse_args([]).command is None
    assert build_parser().parse_args(["attach"]).job is None
    # No terminal under pytest: one line, status 2, as `attach JOB`.
    assert main(["--redis", redis_url]) == 2
    assert main(["--redis", redis_url, "attach"]) == 2

