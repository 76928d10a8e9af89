"""Earlier attempts (issue 22, part 4): ``logs --attempt N`` and the console's ``p`` (and a
restart in the timeline) show the lines of one earlier attempt only. A real job that crashed
once, a real redis-server, the console driven by Textual's Pilot."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.pilot import Pilot

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire.event_records import EventType
from elastic_console.tui.widgets.attempt_logs import AttemptLogsScreen
from tests.agents import SCRIPTS, Agent
from tests.test_console_app import App, console, events_of, loaded, on_screen, run, screen_text
from tests.test_console_cli import console as cli
from tests.test_console_cli import one_error_line
from tests.waiting import wait_until, wait_until_async


def test_read_attempt_keeps_that_attempt_bounded_and_skips_bad_entries(redis_url, r, job_id):
    """Two nodes' streams with attempts 0, 1, 2: attempt 1 only, the rank filter, the newest
    lines when the bound cuts, and an entry that does not decode skipped."""
    import asyncio

    from elastic_agent.coordination.transport.connection import make_async_client
    from elastic_agent.coordination.wire.log_records import (
        LogBatch,
        decode_log_entries,
        encode_node_log_entry,
    )
    from elastic_console.job.attempts import read_attempt

    streams = [f"elastic:log:{{{job_id}/0}}:n{i}" for i in range(2)]
    for i, stream in enumerate(streams):
        for attempt in range(3):
            for k in range(3):
                lines = [f"n{i} a{attempt} line {k}.{j}" for j in range(2)]
                r.xadd(stream, encode_node_log_entry(f"n{i}", [LogBatch(
                    f"n{i}", i, 0, attempt, "out", k + 1, lines)]))
            if attempt == 1:
                r.xadd(stream, {"v": "1", "node": "x", "parts": "[[[[", "lines": "junk"})

    def decode(entries):
        return [b for eid, f in entries for b in decode_log_entries(eid, f) or ()]

    async def read(rank, max_lines):
        client = make_async_client(redis_url)
        try:
            return await read_attempt(client, streams, 1, rank, max_lines, decode)
        finally:
            await client.aclose()

    every = asyncio.run(read(None, 1000))
    lines = [line for b in every.batches for line in b.lines]
    assert len(lines) == 12 and all(" a1 " in line for line in lines) and not every.partial
    assert lines[:2] == ["n0 a1 line 0.0", "n0 a1 line 0.1"]  # oldest first, by server time
    one = asyncio.run(read(1, 1000))
    assert {b.rank for b in one.batches} == {1} and one.lines == 6
    cut = asyncio.run(read(0, 3))  # the newest 3 lines of the attempt (whole batches)
    assert cut.partial and [line for b in cut.batches for line in b.lines][-1] == "n0 a1 line 2.1"
    assert cut.lines <= 4


@pytest.fixture(scope="module")
def crashed_once(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A job whose rank 0 failed in attempt 0; attempt 1 runs on (2 ranks, one node)."""
    job_id = f"att-{uuid.uuid4().hex[:8]}"
    agent = Agent(["--redis", redis_url, "--job-id", job_id, "--local-addr", "127.0.0.1",
                   "--nproc-per-node", "2", "--max-restarts", "2", "--shutdown-timeout", "3",
                   str(SCRIPTS / "sleeper.py"), "--fail-rank", "0", "--fail-after", "0.5"],
                  tmp_path_factory.mktemp("att"), "agent")
    r = make_client(redis_url)
    try:
        wait_until(lambda: any(e.data.get("round") == 1 for e in
                               events_of(r, job_id, EventType.WORKERS_STARTED)), 60,
                   "attempt 1's workers")
        wait_until(lambda: all(f"worker rank={k} world=2 restart=1" in cli(
            "logs", job_id, "--tail", "100000", redis_url=redis_url).stdout for k in (0, 1)),
            30, "both ranks' first lines of attempt 1")
        yield job_id
    finally:
        r.close()
        if agent.proc.poll() is None:
            agent.kill()
        agent.wait(30)


def test_logs_attempt_shows_that_attempt_only(crashed_once: str, redis_url: str):
    first = cli("logs", crashed_once, "--attempt", "0", "--tail", "100000", redis_url=redis_url)
    assert first.returncode == 0, first.stderr
    out = first.stdout
    assert "[rank 0] worker rank=0 world=2 restart=0" in out
    assert "[rank 1] worker rank=1 world=2 restart=0" in out
    assert "[rank 0] rank 0 failing on purpose" in out
    assert "restart=1" not in out, out[-2000:]
    later = cli("logs", crashed_once, "--attempt", "1", "--rank", "1", "--tail", "100000",
                redis_url=redis_url)  # the first line: a loaded run prints more than the default tail
    assert "[rank 1] worker rank=1 world=2 restart=1" in later.stdout
    assert "restart=0" not in later.stdout and "failing" not in later.stdout
    assert "[rank 0]" not in later.stdout
    # the current logs are not the first attempt's only
    assert "restart=1" in cli("logs", crashed_once, "--tail", "100000",
                              redis_url=redis_url).stdout
    none = cli("logs", crashed_once, "--attempt", "7", redis_url=redis_url)
    assert none.returncode == 0 and none.stdout == ""
    assert "no lines of attempt 7" in none.stderr
    follow = cli("logs", crashed_once, "--attempt", "0", "-f", redis_url=redis_url)
    assert follow.returncode == 2 and "cannot be followed" in one_error_line(follow)


def test_console_p_and_a_restart_in_the_timeline_show_the_earlier_attempt(crashed_once: str,
                                                                          redis_url: str):
    app: App = console(redis_url, crashed_once)

    async def body(pilot: Pilot[int], app: App) -> None:
        await loaded(app, ranks=2)
        await wait_until_async(lambda: app.view.round == 1, 10, "round 1")
        app.rank_table.focus()
        await pilot.pause()
        selected = app.selected_rank
        assert selected is not None
        if app.all_ranks:
            await pilot.press("a")  # the selected rank's logs: p shows its earlier attempt
            await wait_until_async(lambda: not app.all_ranks, 5, "the rank's logs")
        await pilot.press("p")
        await on_screen(app, AttemptLogsScreen)
        screen = app.screen
        assert isinstance(screen, AttemptLogsScreen)
        assert (screen.attempt, screen.rank) == (0, selected)
        await wait_until_async(lambda: screen.result is not None, 15, "attempt 0's lines")
        assert any(line.startswith(f"worker rank={selected} world=2 restart=0 ")
                   for line in screen.lines), screen.lines[:5]
        await pilot.pause()
        assert f"worker rank={selected} world=2 restart=0" in screen_text(app)  # on screen
        assert not any("restart=1" in line for line in screen.lines)
        await pilot.press("a")  # every rank of that attempt
        await wait_until_async(lambda: screen.result is not None and screen.rank is None, 15,
                               "every rank")
        assert "[rank 0] rank 0 failing on purpose" in screen.lines
        await pilot.press("n")  # the attempt after it: the one running now
        await wait_until_async(lambda: screen.attempt == 1 and screen.result is not None, 15,
                               "attempt 1")
        assert any("restart=1" in line for line in screen.lines)
        assert not any("restart=0" in line for line in screen.lines)
        await pilot.press("escape")
        await on_screen(app, AttemptLogsScreen, shown=False)
        # The timeline: enter on the restart leads to the logs of the attempt it ended.
        restart = next(i for i, e in enumerate(app.timeline.entries) if e.kind == "restart")
        app.timeline.focus()
        await pilot.pause()
        app.timeline.highlighted = restart
        await pilot.press("enter")
        await on_screen(app, AttemptLogsScreen)
        screen = app.screen
        assert isinstance(screen, AttemptLogsScreen) and screen.attempt == 0
        await wait_until_async(lambda: screen.result is not None, 15, "attempt 0's lines")
        assert screen.rank == selected
        assert any(f"worker rank={selected} world=2 restart=0" in line for line in screen.lines)
        assert not any("restart=1" in line for line in screen.lines)

    run(app, body)


def test_p_in_the_first_round_says_there_is_no_earlier_attempt(redis_url: str, tmp_path: Path):
    from tests.test_console_app import sleeper_job, stop_agent

    job_id = f"att1-{uuid.uuid4().hex[:8]}"
    agent = sleeper_job(redis_url, job_id, tmp_path)
    try:
        app: App = console(redis_url, job_id)

        async def body(pilot: Pilot[int], app: App) -> None:
            await loaded(app, ranks=2)
            await pilot.press("p")
            await pilot.pause()
            assert not isinstance(app.screen, AttemptLogsScreen)
            assert any("no earlier attempt" in m for m, _ in app.notes)

        run(app, body)
    finally:
        stop_agent(agent)
