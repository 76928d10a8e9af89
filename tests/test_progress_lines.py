"""Progress bars as a terminal shows them (lines redrawn with ``\\r``).

A real worker's bar reaches Redis while it is drawn, as whole frames, at a few entries a
second; the line's final state replaces its frames for every reader (JobView, the log view,
the attach console, ``elastic-console logs``); the log file keeps the raw bytes. Hostile
``live`` records are skipped or bounded like any other record.
"""

from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import NamedTuple

import pytest
import redis

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire import log_records
from elastic_agent.coordination.wire.event_records import EventType, encode_event
from elastic_agent.coordination.wire.keyspace import JOBS_INDEX, JobKeys
from elastic_agent.coordination.wire.log_records import (
    MAX_LOG_ENTRY_BYTES,
    LogBatch,
    decode_log_batch,
    decode_log_entries,
    encode_log_batch,
)
from elastic_agent.supervision.records.log_config import LogConfig, Std
from elastic_agent.supervision.records.log_shipping import LIVE_DELAY, LIVE_INTERVAL
from elastic_agent.supervision.records.logs import NodeLogs
from elastic_agent.supervision.records.publisher import StreamPublisher
from elastic_console.job.inplace import MAX_ROWS, InPlaceRows
from elastic_console.job.logbuffer import LogBuffer, LogLine
from elastic_console.job.state import JobView
from tests.agents import SCRIPTS, Agent, wait_until
from tests.test_agent import agent_args
from tests.test_console_app import App, loaded, screen_text
from tests.test_console_app import console as console_app
from tests.test_console_app import run as run_app
from tests.test_console_cli import CONSOLE
from tests.test_console_cli import console as console_cli
from tests.test_log_view import LogApp
from tests.test_log_view import run as run_view
from tests.test_log_view import screen_text as view_text
from tests.waiting import wait_until_async

OUT = log_records.STDOUT
SECONDS = 2.0  # how long the real worker draws its bar, ~1,000 frames a second
FRAME = re.compile(r"step +(\d+) t=(\d+\.\d{3}) \|#* *\|")
FINAL = re.compile(r"done (\d+) frames +\|#{40}\|")


def texts(buf: LogBuffer) -> list[str]:
    return [line[3] for line in buf]


# -- a real worker drawing a bar through a real agent --------------------------------------------


class BarRun(NamedTuple):
    job_id: str
    redis_url: str
    entries: list[LogBatch]  # every log entry of the job, in stream order
    written: bytes  # what the worker wrote to its stdout (its own copy)
    log_file: bytes  # the agent's stdout.log of the worker


@pytest.fixture(scope="module")
def bar_run(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> BarRun:
    tmp = tmp_path_factory.mktemp("bar")
    job_id = f"bar-{uuid.uuid4().hex[:8]}"
    copy = tmp / "written"
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "1", "--max-restarts", "0",
                             "--log-dir", str(tmp / "logs"), str(SCRIPTS / "progress_bar.py"),
                             "--seconds", str(SECONDS), "--copy", str(copy)), tmp, "agent")
    assert agent.wait(90) == 0, agent.output[-3000:]
    r = make_client(redis_url)
    try:
        entries = []
        for stream in r.smembers(JobKeys(job_id).log_streams):
            for entry_id, fields in r.xrange(stream):
                decoded = decode_log_entries(entry_id, fields)
                assert decoded is not None, fields
                entries += decoded
    finally:
        r.close()
    (log_file,) = (tmp / "logs").glob("**/attempt_0/0/stdout.log")
    return BarRun(job_id, redis_url, entries, copy.read_bytes(), log_file.read_bytes())


def test_a_bar_reaches_redis_while_it_is_drawn_at_a_few_entries_a_second(bar_run: BarRun):
    frames = FRAME.findall(bar_run.written.decode())
    assert len(frames) > 500 * SECONDS, "the worker drew its bar about 1,000 times a second"
    first_drawn_ms = float(frames[0][1]) * 1000
    live = [b for b in bar_run.entries if b.rank == 0 and b.stream == OUT and b.live]
    assert live, "no frame reached Redis before the newline"
    # Whole frames, each the line's latest state: what a terminal shows, never "\r" data.
    steps = []
    for b in live:
        m = FRAME.fullmatch(b.lines[-1])
        assert m, b.lines[-1]
        steps.append(int(m.group(1)))
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert not any("\r" in line for b in bar_run.entries for line in b.lines)
    # In Redis within 0.5 s of the first frame, and again at least every 0.5 s while it moves
    # (entry ids are the Redis server's clock; the worker's runs on the same host).
    assert live[0].server_ms - first_drawn_ms <= 500, live[0].server_ms - first_drawn_ms
    gaps = [b.server_ms - a.server_ms for a, b in pairwise(live)]
    assert max(gaps) <= 500, gaps
    # Bounded: ~2,000 redraws cost a few entries a second, not one per frame.
    assert len(live) <= SECONDS / LIVE_INTERVAL + 2, len(live)
    assert len(bar_run.entries) <= SECONDS / LIVE_INTERVAL + 4, len(bar_run.entries)
    mine = [b.seq for b in bar_run.entries if b.rank == 0 and b.stream == OUT]
    assert mine == list(range(1, len(mine) + 1))


def test_the_final_state_replaces_the_frames_and_the_file_keeps_the_raw_bytes(bar_run: BarRun):
    assert bar_run.log_file == bar_run.written  # byte for byte, every "\r" frame included
    assert bar_run.written.count(b"\r") > 500 * SECONDS
    view = JobView("bar")
    after_first_frames = None
    for i, b in enumerate(bar_run.entries):
        view.apply_logs(b)
        if i == 2 and b.live:
            after_first_frames = texts(view.logs_for(0))
    assert after_first_frames is not None and len(after_first_frames) == 1  # one updating row
    final = [b for b in bar_run.entries if any(FINAL.fullmatch(line) for line in b.lines)]
    assert len(final) == 1 and not final[0].live and FINAL.fullmatch(final[0].lines[0])
    shown = texts(view.logs_for(0))
    assert len(shown) == 2 and FINAL.fullmatch(shown[0]) and shown[1] == "after the bar", shown
    assert texts(view.all_logs) == shown and view.lines_total == 2


def test_logs_prints_the_final_state_only(bar_run: BarRun):
    p = console_cli("logs", bar_run.job_id, redis_url=bar_run.redis_url)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 2, lines
    assert FINAL.fullmatch(lines[0].removeprefix("[rank 0] ")) and lines[1] == "[rank 0] after the bar"


# -- the agent's shipper, fed directly -----------------------------------------------------------


def entries_of(r: redis.Redis, job_id: str, node: str) -> list[LogBatch]:
    out = []
    for entry_id, fields in r.xrange(JobKeys(job_id).logs(node)):
        decoded = decode_log_entries(entry_id, fields)
        assert decoded is not None
        out += decoded
    return out


def fold(entries: list[LogBatch]) -> list[str]:
    view = JobView("j")
    for b in entries:
        view.apply_logs(b)
    return texts(view.all_logs)


def open_worker(pub: StreamPublisher, job_id: str, tmp: Path, cap: int = 16 * 1024):
    logs = NodeLogs(LogConfig(redirects=Std.ALL, max_line_bytes=cap), publisher=pub,
                    job_id=job_id, node_id="n")
    return logs.open_worker(directory=tmp, role="r", rank=0, local_rank=0, attempt=0)


@pytest.mark.asyncio
async def test_lines_are_shipped_as_a_terminal_shows_them(redis_url, r, job_id, tmp_path):
    pub = StreamPublisher(redis_url)
    await pub.start()
    try:
        w = open_worker(pub, job_id, tmp_path, cap=40)
        chunks = [b"plain\n", b"crlf\r\n", b"a\rb\rlast frame\n", b"split cr\r", b"\n",
                  b"\r 1%\r 2%", b"\r 3%\r", b"\n", b"pad\r\r\n",
                  # A bar 10 MB long without a newline: only its last frame is kept.
                  *([(b"\r" + b"x" * 99) * 1000] * 100), b"\rthe end", b"\n",
                  b"no newline at the end\r"]
        for chunk in chunks:
            w.feed(OUT, chunk)  # all at once: no bar lasts LIVE_DELAY, so no live entry
        w.close()
        await asyncio.wait_for(pub.flush(), 10)
    finally:
        await pub.close()
    entries = entries_of(r, job_id, "n")
    assert not any(b.live for b in entries)
    assert [line for b in entries for line in b.lines] == [
        "plain", "crlf", "last frame", "split cr", " 3%", "pad", "the end",
        "no newline at the end"]
    assert (tmp_path / "stdout.log").read_bytes() == b"".join(chunks)


@pytest.mark.asyncio
async def test_a_redrawn_line_is_shipped_live_then_replaced_by_its_final_state(
        redis_url, r, job_id, tmp_path):
    pub = StreamPublisher(redis_url)
    await pub.start()
    try:
        w = open_worker(pub, job_id, tmp_path)
        w.feed(OUT, b"before\n\r  0%")
        started = time.monotonic()
        for i in range(1, 41):  # ~0.8 s of redraws (longer on a loaded machine)
            await asyncio.sleep(0.02)  # a bar's pace, not a wait: the redraws under test
            w.feed(OUT, f"\r{i:3d}%".encode())
        w.feed(OUT, b"\r100%\r\nafter\n")
        redrawing_s = time.monotonic() - started
        w.close()
        await asyncio.wait_for(pub.flush(), 10)
    finally:
        await pub.close()
    entries = entries_of(r, job_id, "n")
    live = [b for b in entries if b.live]
    # Paced: one frame per LIVE_INTERVAL of the time the redrawing really took, whatever
    # the machine's load made of its 0.8 s.
    assert 2 <= len(live) <= redrawing_s / LIVE_INTERVAL + 2, (redrawing_s,
                                                                [b.lines for b in entries])
    shown = [int(b.lines[-1].rstrip("%")) for b in live]
    assert shown == sorted(shown) and all(0 <= p < 100 for p in shown)
    assert entries[-1].lines[-2:] == ["100%", "after"] and not entries[-1].live
    assert [b.seq for b in entries] == list(range(1, len(entries) + 1))
    assert fold(entries) == ["before", "100%", "after"]


@pytest.mark.asyncio
@pytest.mark.parametrize("finished", [False, True])
async def test_frames_waiting_in_an_outage_collapse_into_the_latest_state(
        redis_url, r, job_id, tmp_path, finished):
    pub = StreamPublisher(redis_url)  # not started yet: what is shipped waits in its queue
    w = open_worker(pub, job_id, tmp_path)
    w.feed(OUT, b"\r  0%")
    # Sleeps, not waits: the frame timers firing while Redis is away is what is under test,
    # and a frame shipped into a waiting entry has no sign outside the log module.
    await asyncio.sleep(LIVE_DELAY + 0.1)  # its frame is shipped (and waits)
    w.feed(OUT, b"\r 50%")
    await asyncio.sleep(LIVE_INTERVAL + 0.1)  # this one too, in the same waiting entry
    if finished:
        w.feed(OUT, b"\r100%\n")  # the line ends before Redis is back
    await pub.start()
    try:
        await asyncio.wait_for(pub.flush(), 10)
        got = [(b.lines, b.live) for b in entries_of(r, job_id, "n")]
    finally:
        w.close()
        await pub.close()
    assert got == ([(["100%"], False)] if finished else [([" 50%"], True)])


# -- the console: JobView, the log view, the attach app -----------------------------------------


def batch(seq: int, lines: list[str], live: bool = False, *, rank: int = 0, stream: str = OUT,
          attempt: int = 0, ms: int = 1_000) -> LogBatch:
    return LogBatch("n", rank, rank, attempt, stream, seq, lines, id=f"{ms + seq}-0", live=live)


def test_jobview_keeps_a_redrawn_line_in_one_row_of_its_rank_and_of_all_ranks():
    v = JobView("j")
    v.apply_logs(batch(1, ["start", " 10%"], live=True))
    v.apply_logs(batch(1, ["rank 1 says hi"], rank=1))
    v.apply_logs(batch(1, ["an error"], stream=log_records.STDERR))
    v.apply_logs(batch(2, [" 50%"], live=True))
    assert texts(v.logs_for(0)) == ["start", " 50%", "an error"]
    assert texts(v.all_logs) == ["start", " 50%", "rank 1 says hi", "an error"]
    v.apply_logs(batch(3, ["100%", "next", "  0%"], live=True))  # done; a second bar starts
    v.apply_logs(batch(3, ["100%", "next", "  0%"], live=True))  # a retried XADD: ignored
    v.apply_logs(batch(4, ["  7%"], live=True))
    assert texts(v.logs_for(0)) == ["start", "100%", "an error", "next", "  7%"]
    assert texts(v.all_logs) == ["start", "100%", "rank 1 says hi", "an error", "next", "  7%"]
    assert v.lines_total == 6 and v.all_logs.edits == 3
    # A gap in the sequence (entries trimmed or dropped) or a new attempt: the row stays as
    # it was last drawn, and what follows is new rows.
    v.apply_logs(batch(6, ["later"]))
    v.apply_logs(batch(7, [" 1%"], live=True))
    v.apply_logs(batch(1, ["attempt 1"], attempt=1))
    assert texts(v.logs_for(0))[-4:] == ["  7%", "later", " 1%", "attempt 1"]


def test_jobview_in_place_rows_are_bounded_and_follow_only_numbered_batches():
    rows: InPlaceRows[int] = InPlaceRows(limit=100)
    for i in range(1000):
        rows.hold(LogBatch(f"n{i}", 0, 0, 0, OUT, 1, ["x"], live=1), [i])
    assert len(rows) <= 100
    rows.hold(LogBatch("big", 0, 0, 0, OUT, 1, ["x"], live=1), list(range(10_000)))
    held = rows.take(LogBatch("big", 0, 0, 0, OUT, 2, ["y"]))
    assert held is not None and len(held) == MAX_ROWS  # one stream's block is bounded too
    v = JobView("j")
    v.apply_logs(batch(0, ["a"], live=True))  # no seq: nothing can follow it
    v.apply_logs(batch(1, ["b"], live=True))
    assert texts(v.logs_for(0)) == ["a", "b"]


def drawn(view) -> str:
    """What the terminal shows (the compositor's strips, not a fresh render_line)."""
    return "\n".join(strip.text for strip in view.app.screen._compositor.render_strips())


def test_the_log_view_redraws_a_row_replaced_in_place_wrapped_and_filtered():
    buf = LogBuffer(100)
    buf.extend([LogLine(1_700_000_000_000, 0, OUT, "hello"), LogLine(1_700_000_000_001, 0, OUT,
                                                                     "bar 10%")])

    async def body(pilot, view) -> None:
        assert "bar 10%" in drawn(view)
        buf.replace(1, LogLine(1_700_000_000_002, 0, OUT, "bar 20%"))
        view.on_new_lines()  # the same rows, one of them new: it must be drawn again
        await pilot.pause()
        assert "bar 20%" in drawn(view) and "10%" not in drawn(view)
        buf.replace(1, LogLine(1_700_000_000_002, 0, OUT, "bar 50% " + "#" * 150))
        view.on_new_lines()
        await pilot.pause()
        shown = view_text(view)
        assert not any("10%" in row for row in shown) and any("bar 50%" in row for row in shown)
        assert view.line_count == 2 and view.row_count == 4  # the new state takes 3 rows
        view.pattern = re.compile("done")
        await pilot.pause()
        assert view.line_count == 0
        buf.replace(1, LogLine(1_700_000_000_003, 0, OUT, "bar done"))
        view.on_new_lines()  # it matches now: it shows up
        await pilot.pause()
        assert view.line_count == 1 and any("bar done" in row for row in view_text(view))

    run_view(LogApp(buf, wrap=True), body)


def test_a_line_added_to_a_view_that_is_not_full_is_drawn():
    """(A view with fewer lines than rows had the same screen key before and after a line was
    added below them, so the new line waited for some other repaint.)"""
    buf = LogBuffer(100)
    buf.append(LogLine(1_700_000_000_000, 0, OUT, "first"))

    async def body(pilot, view) -> None:
        await pilot.pause()
        buf.append(LogLine(1_700_000_000_001, 0, OUT, "second"))
        view.on_new_lines()
        await pilot.pause()
        assert "first" in drawn(view) and "second" in drawn(view), drawn(view)

    run_view(LogApp(buf), body)


def write_job(r: redis.Redis, job_id: str) -> None:
    """A job of two ranks for the console to attach to (hand-written, no agent)."""
    keys = JobKeys(job_id)
    r.zadd(JOBS_INDEX, {job_id: 1})
    r.xadd(keys.events, encode_event(EventType.NODE_JOINED, "n", {"host": "h", "nproc": 2}, 1))
    r.xadd(keys.events, encode_event(EventType.WORKERS_STARTED, "n", {
        "ranks": [0, 1], "local_ranks": [0, 1], "pids": [10, 11], "host": "h"}, 2))
    r.sadd(keys.log_streams, keys.logs("n"))


def xadd(r: redis.Redis, job_id: str, b: LogBatch) -> None:
    r.xadd(JobKeys(job_id).logs("n"), encode_log_batch(b))


def test_the_console_shows_one_updating_row(redis_url, r, job_id):
    write_job(r, job_id)
    xadd(r, job_id, batch(1, ["rank 1 first"], rank=1))
    xadd(r, job_id, batch(1, ["epoch 1", "bar   0%"], live=True))
    app = console_app(redis_url, job_id)

    async def body(pilot, app: App) -> None:
        await loaded(app, ranks=2)
        await wait_until_async(lambda: "bar   0%" in screen_text(app), 30, "the first frame")
        assert app.log_view.line_count == 3
        xadd(r, job_id, batch(2, ["bar  50%"], live=True))
        xadd(r, job_id, batch(2, ["rank 1 second"], rank=1))
        await wait_until_async(lambda: "bar  50%" in screen_text(app), 30, "the new frame")
        await wait_until_async(lambda: "rank 1 second" in screen_text(app), 30, "rank 1")
        text = screen_text(app)
        assert "bar   0%" not in text and app.log_view.line_count == 4
        xadd(r, job_id, batch(3, ["bar 100% done", "epoch 2"]))
        await wait_until_async(lambda: "epoch 2" in screen_text(app), 30, "the final state")
        text = screen_text(app)
        assert "bar 100% done" in text and "bar  50%" not in text
        assert app.log_view.line_count == 5
        assert texts(app.view.logs_for(0)) == ["epoch 1", "bar 100% done", "epoch 2"]

    run_app(app, body)


# -- elastic-console logs -----------------------------------------------------------------------


def test_logs_prints_an_unfinished_line_in_its_latest_state(redis_url, r, job_id):
    write_job(r, job_id)
    xadd(r, job_id, batch(1, ["epoch 1", "bar  10%"], live=True))
    xadd(r, job_id, batch(2, ["bar  20%"], live=True))
    p = console_cli("logs", job_id, redis_url=redis_url)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["[rank 0] epoch 1", "[rank 0] bar  20%"]


@pytest.fixture
def follow_job(redis_url: str, r: redis.Redis, job_id: str) -> Iterator[str]:
    write_job(r, job_id)
    xadd(r, job_id, batch(1, ["epoch 1", "bar  10%"], live=True))
    yield job_id


def feed_the_rest(r: redis.Redis, job_id: str) -> None:
    xadd(r, job_id, batch(2, ["bar  20%"], live=True))
    xadd(r, job_id, batch(1, ["rank 1 line"], rank=1))
    xadd(r, job_id, batch(3, ["bar  30%"], live=True))
    xadd(r, job_id, batch(4, ["bar 100%", "epoch 2"]))


def test_logs_follow_into_a_pipe_prints_finished_lines_only(redis_url, r, follow_job, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "ELASTIC_REDIS_URL": redis_url}
    with open(out, "w") as f:
        proc = subprocess.Popen([*CONSOLE, "logs", follow_job, "-f"], stdout=f,
                                stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_until(lambda: "epoch 1" in out.read_text(), 20, "the history")
        feed_the_rest(r, follow_job)
        wait_until(lambda: "epoch 2" in out.read_text(), 20, "the finished bar")
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    assert out.read_text().splitlines() == ["[rank 0] epoch 1", "[rank 1] rank 1 line",
                                            "[rank 0] bar 100%", "[rank 0] epoch 2"]


def test_logs_follow_on_a_terminal_rewrites_the_unfinished_line(redis_url, r, follow_job):
    import pty

    controller, terminal = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_REDIS_URL"}
    env["COLUMNS"] = "60"
    proc = subprocess.Popen([*CONSOLE, "logs", follow_job, "-f", "--redis", redis_url],
                            stdout=terminal, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env=env)
    os.close(terminal)
    got = b""

    def read_until(marker: bytes, timeout: float = 20) -> None:
        nonlocal got
        deadline = time.monotonic() + timeout
        while marker not in got:
            left = deadline - time.monotonic()
            assert left > 0 and select.select([controller], [], [], left)[0], (marker, got)
            got += os.read(controller, 65536)

    try:
        read_until(b"bar  10%")
        feed_the_rest(r, follow_job)
        read_until(b"epoch 2\r\n")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=15)
        os.close(controller)
    assert proc.returncode == 0
    screen = got.decode()
    # The unfinished line is drawn without a newline and erased before each redraw.
    assert "[rank 0] epoch 1\r\n[rank 0] bar  10%" in screen
    assert "\r\x1b[K[rank 0] bar  20%" in screen
    assert "\r\x1b[K[rank 1] rank 1 line\r\n[rank 0] bar  20%" in screen
    assert "\r\x1b[K[rank 0] bar 100%\r\n[rank 0] epoch 2\r\n" in screen
    assert screen.count("bar 100%") == 1


# -- hostile records ----------------------------------------------------------------------------


def log_fields(**extra: bytes) -> dict[bytes, bytes]:
    return {b"v": b"1", b"node": b"n", b"rank": b"0", b"s": b"out", b"seq": b"1",
            b"lines": b"x", **{k.encode(): v for k, v in extra.items()}}


@pytest.mark.parametrize("live", [b"2", b"true", b"", b"1 ", b"\x00", b"1" * 100_000])
def test_a_log_entry_with_a_bad_live_field_is_skipped(live: bytes):
    assert decode_log_batch("1-0", log_fields(live=live)) is None
    as_str = {k.decode(): v.decode() for k, v in log_fields(live=live).items()}
    assert decode_log_batch("1-0", as_str) is None


def test_live_entries_decode_and_an_old_reader_shows_the_frame_as_a_line():
    fields = encode_log_batch(batch(5, ["done", " 50%"], live=True))
    assert fields["live"] == "1" and "live" not in encode_log_batch(batch(5, ["done"]))
    b = decode_log_batch("9-0", {k.encode(): v.encode() for k, v in fields.items()})
    assert b is not None and b.live and b.lines == ["done", " 50%"]
    old = dict(fields)
    del old["live"]  # a reader that never heard of the field: the same lines, not live
    b = decode_log_batch("9-0", old)
    assert b is not None and not b.live and b.lines == ["done", " 50%"]
    huge = log_fields(live=b"1", lines=b"x" * (MAX_LOG_ENTRY_BYTES + 1))
    assert decode_log_batch("1-0", huge) is None


def test_hostile_live_records_are_bounded_for_every_reader(redis_url, r, job_id):
    write_job(r, job_id)
    key = JobKeys(job_id).logs("n")
    r.xadd(key, log_fields(live=b"yes", lines=b"bad live"))
    for i in range(300):  # many streams redrawn at once: held rows are bounded
        r.xadd(key, {**log_fields(live=b"1", lines=b"\x1b]0;pwn\x07 %d" % i),
                     b"node": b"n%d" % i})
    r.xadd(key, log_fields(live=b"1", seq=b"1", lines=b"y" * (1 << 20)))
    r.xadd(key, log_fields(live=b"1", seq=b"2", lines=b"z" * (1 << 20)))
    p = console_cli("logs", job_id, "--tail", "1000", redis_url=redis_url)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "bad live" not in p.stdout and "\x1b" not in p.stdout and "\x07" not in p.stdout
    assert p.stdout.count("pwn") == 300 and "y" * 100 not in p.stdout
    assert p.stdout.count("z" * (1 << 20)) == 1
    view = JobView("j")
    for entry_id, fields in r.xrange(key):
        b = decode_log_batch(entry_id, fields)
        if b is not None:
            view.apply_logs(b)
    assert view.lines_total == 301 and texts(view.logs_for(0))[-1] == "z" * (1 << 20)
