"""Worker output that reads as it would in a terminal.

* ``--worker-tty``: a worker's stdout and stderr are terminals (ptys) when the agent's is one
  (or ``on``), on both launch paths (exec'd, and forked from a zygote with parked workers).
* Output that moves the cursor (Rich's live display) is rendered by a terminal emulator:
  finished lines once, the redrawn rows shipped as the stream's live block, replaced by the
  next batch (the agent's terminal redraws it in place).
* A bar's frame is never glued to the next write.
* A line is stamped with its first byte's time (ages on the wire, durations only).

Real Redis, real workers; the recorded framework output (tests/fixtures/frameworks/) is
replayed at its recorded pace.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pyte
import pytest
import pytest_asyncio
import redis

from elastic_agent.coordination.wire import log_records
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.log_records import (
    LogBatch,
    LogEntryDecoder,
    decode_log_entries,
    encode_node_log_entry,
)
from elastic_agent.supervision.config import UsageError, parse_args
from elastic_agent.supervision.launch import ptys
from elastic_agent.supervision.launch.exits import WorkerState
from elastic_agent.supervision.launch.worker_env import RankAssignment, WorkerSpec
from elastic_agent.supervision.launch.workers import WorkerGroup
from elastic_agent.supervision.records.live_area import LiveArea
from elastic_agent.supervision.records.log_config import LogConfig, Std
from elastic_agent.supervision.records.log_shipping import LIVE_INTERVAL
from elastic_agent.supervision.records.logs import NodeLogs
from elastic_agent.supervision.records.publisher import StreamPublisher
from elastic_agent.supervision.records.screen import StreamScreen, moves_cursor
from elastic_console.job.state import JobView
from tests.test_progress_lines import console_cli, write_job
from tests.waiting import wait_until_async

FIXTURES = Path(__file__).parent / "fixtures" / "frameworks"
OUT, ERR = log_records.STDOUT, log_records.STDERR
NODE = "n"


def chunks(name: str) -> list[tuple[float, str, bytes]]:
    """A recorded run: (seconds since its first chunk, stream, bytes) per read."""
    rows = [json.loads(line) for line in (FIXTURES / f"{name}.jsonl").read_text().splitlines()]
    t0 = rows[0]["t"]
    return [(row["t"] - t0, row["s"], row["d"].encode("latin-1")) for row in rows]


def entries_of(r: redis.Redis, job_id: str) -> list[LogBatch]:
    out = []
    for entry_id, fields in r.xrange(JobKeys(job_id).logs(NODE)):
        decoded = decode_log_entries(entry_id, fields)
        assert decoded is not None, fields
        out += decoded
    return out


def texts(ring) -> list[str]:
    return [line[3] for line in ring]


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


async def replay(pub: StreamPublisher, job_id: str, tmp: Path, name: str,
                 size: tuple[int, int] = (100, 30), **kw) -> NodeLogs:
    """Feed a recorded run to one worker's log pipeline at its recorded pace."""
    logs = NodeLogs(LogConfig(redirects=Std.ALL), publisher=pub, job_id=job_id, node_id=NODE,
                    **kw)
    logs.screen_size = size
    w = logs.open_worker(directory=tmp, role="r", rank=0, local_rank=0, attempt=0)
    start = time.monotonic()
    for at, stream, data in chunks(name):
        # The recorded pace is the input under test (frames a few ms apart, seconds long).
        await asyncio.sleep(max(0.0, at - (time.monotonic() - start)))
        w.feed(stream, data)
    w.close()
    await asyncio.wait_for(pub.flush(), 10)
    return logs


@pytest_asyncio.fixture
async def pub(redis_url: str):
    publisher = StreamPublisher(redis_url)
    await publisher.start()
    yield publisher
    await publisher.close()


# -- the Lightning Rich bar, recorded on a terminal ---------------------------------------------


@pytest.mark.asyncio
async def test_a_rich_bar_is_shipped_live_while_it_changes_and_kept_once(
        pub, r, redis_url, job_id, tmp_path):
    write_job(r, job_id)
    r.sadd(JobKeys(job_id).log_streams, JobKeys(job_id).logs(NODE))
    started = time.monotonic()
    await replay(pub, job_id, tmp_path, "lightning_rich_tty")
    took = time.monotonic() - started
    entries = [b for b in entries_of(r, job_id) if b.stream == OUT]
    frames = [plain(b.lines[-1]) for b in entries if b.live]
    # While it moves: its live block reaches Redis, a few times a second, never a \r or ESC
    # other than colours.
    assert len(frames) >= 3, [b.lines for b in entries]
    assert len(frames) <= took / LIVE_INTERVAL + 3, (took, frames)
    assert any(re.search(r"Epoch 0/1 .* [1-9]/10", f) for f in frames), frames
    assert not any(re.search(r"\x1b(?!\[[0-9;]*m)|\r", line) for b in entries for line in b.lines)
    # Its end: the final bar once (two rows: Rich wrapped it at the terminal's 100 columns).
    view = JobView("j")
    for b in entries_of(r, job_id):
        view.apply_logs(b)
    shown = [plain(t) for t in texts(view.logs_for(0)) if "Epoch" in t or "0.010" in t]
    assert len(shown) == 2, shown
    assert re.fullmatch(r"Epoch 1/1 +━+ 10/10 .*train_loss: 14\.234 lr:", shown[0]), shown
    assert shown[1].strip() == "0.010"
    assert "\x1b[35m━" in "".join(texts(view.logs_for(0)))  # its colours kept
    # ... and `logs` prints the same: the final state, not 30 frames.
    p = console_cli("logs", job_id, redis_url=redis_url)
    assert p.returncode == 0, p.stderr
    bars = [line for line in p.stdout.splitlines() if "Epoch" in line]
    assert len(bars) == 1 and "10/10" in bars[0], p.stdout
    assert p.stdout.count("0.010") == 1
    assert "`Trainer.fit` stopped" in p.stdout


@pytest.mark.asyncio
async def test_the_agents_terminal_redraws_the_live_block_in_place(pub, job_id, tmp_path):
    """The agent's own terminal (a tty writer) shows the bar where it is, redrawn; what it
    shows at the end, read back through a terminal emulator, is the final bar once."""
    written = io.BytesIO()

    class Tty:
        def write(self, data: bytes) -> int:
            return written.write(data)

        def flush(self) -> None:
            pass

        def isatty(self) -> bool:
            return True

    tty = Tty()
    logs = NodeLogs(LogConfig(tee=Std.ALL), publisher=pub, job_id=job_id, node_id=NODE,
                    stdout=tty, stderr=tty)
    logs._areas[id(tty)] = LiveArea(tty, size=(160, 40))  # the terminal's size, fixed
    logs.screen_size = (100, 30)
    w = logs.open_worker(directory=tmp_path, role="r", rank=0, local_rank=0, attempt=0)
    start = time.monotonic()
    for at, stream, data in chunks("lightning_rich_tty"):
        await asyncio.sleep(max(0.0, at - (time.monotonic() - start)))  # the recorded pace
        w.feed(stream, data)
    w.close()
    raw = written.getvalue()
    assert raw.count(b"\x1b[J") >= 3  # redrawn in place several times while it moved
    screen = pyte.Screen(160, 40)
    screen.set_mode(pyte.modes.LNM)
    pyte.ByteStream(screen).feed(raw)
    rows = [row.rstrip() for row in screen.display if row.strip()]
    bars = [row for row in rows if "Epoch" in row]
    assert len(bars) == 1 and "10/10" in bars[0], rows
    assert bars[0].startswith("[r0]:Epoch 1/1"), rows
    assert sum("0.010" in row for row in rows) == 1, rows
    assert any("`Trainer.fit` stopped" in row for row in rows), rows


# -- a Rich display of two bars, drawn by a real worker on a pty ---------------------------------

TWO_BARS = """
    import time
    from rich.progress import Progress
    with Progress(auto_refresh=False) as progress:
        a = progress.add_task("alpha", total=20)
        b = progress.add_task("beta", total=20)
        for i in range(20):
            time.sleep(0.05)
            progress.advance(a)
            progress.advance(b, 0.5)
            progress.refresh()
        progress.update(b, completed=20)
        progress.refresh()
    print("after the bars")
"""


async def run_group(tmp: Path, logs: NodeLogs, code: str, *, worker_tty, preload=(),
                    attempts: int = 1, nproc: int = 1) -> WorkerGroup:
    spec = WorkerSpec(nproc=nproc, entrypoint=[sys.executable, "-u", "-c", textwrap.dedent(code)],
                      run_id="r", job_id="j", log_dir=tmp, preload=preload, shutdown_timeout=5,
                      worker_tty=worker_tty)
    group = WorkerGroup(spec, logs=logs)
    try:
        await group.prepare()
        for attempt in range(attempts):
            await group.start(RankAssignment(
                group_rank=0, group_world_size=1, world_size=nproc, base_rank=0,
                master_addr="127.0.0.1", master_port=1, attempt=attempt, restart_count=attempt))
            result = await asyncio.wait_for(group.wait(), 60)
            assert result.state is WorkerState.SUCCEEDED, result
            await group.stop()
    finally:
        await group.stop()
        await group.close()
    return group


@pytest.mark.asyncio
async def test_a_rich_display_of_two_bars_is_two_live_lines_then_two_finished(
        pub, r, redis_url, job_id, tmp_path):
    write_job(r, job_id)
    r.sadd(JobKeys(job_id).log_streams, JobKeys(job_id).logs(NODE))
    logs = NodeLogs(LogConfig(redirects=Std.ALL), publisher=pub, job_id=job_id, node_id=NODE)
    await run_group(tmp_path, logs, TWO_BARS, worker_tty=(100, 30))
    await asyncio.wait_for(pub.flush(), 10)
    raw = (tmp_path / "attempt_0" / "0" / "stdout.log").read_bytes()
    assert b"\x1b[1A" in raw  # Rich moved the cursor up: it drew live on its terminal
    entries = [b for b in entries_of(r, job_id) if b.stream == OUT]
    blocks = [[plain(t) for t in b.lines[-b.live:]] for b in entries if b.live]
    two = [blk for blk in blocks if len(blk) == 2]
    assert two, blocks
    assert all("alpha" in blk[0] and "beta" in blk[1] for blk in two), two
    view = JobView("j")
    for b in entries_of(r, job_id):
        view.apply_logs(b)
    shown = [plain(t).rstrip() for t in texts(view.logs_for(0))]
    alpha = [t for t in shown if "alpha" in t]
    beta = [t for t in shown if "beta" in t]
    assert len(alpha) == 1 and len(beta) == 1 and shown[-1] == "after the bars", shown
    assert "100%" in alpha[0] and "100%" in beta[0], shown
    p = console_cli("logs", job_id, redis_url=redis_url)
    assert p.stdout.count("alpha") == 1 and p.stdout.count("beta") == 1, p.stdout


# -- a bar's frame is never glued to the next write ------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("bar, after", [
    (b"\r  0%|          | 0/40 [00:00<?, ?it/s]",
     b"[transformers] `loss_type=None` was set in the config but it is unrecognized.\n"),
    (b"\r 10%|#         | 4/40 [00:01<00:09, 3.77it/s, loss=4.7, lr=0]",
     b"11/27/2026 07:01:09 - INFO - __main__ - saving\n"),
])
async def test_a_bar_frame_is_ended_before_the_next_write(pub, r, job_id, tmp_path, bar, after):
    logs = NodeLogs(LogConfig(redirects=Std.ALL), publisher=pub, job_id=job_id, node_id=NODE)
    w = logs.open_worker(directory=tmp_path, role="r", rank=0, local_rank=0, attempt=0)
    w.feed(ERR, b"before\n")
    w.feed(ERR, bar)
    w.feed(ERR, after)
    w.feed(ERR, b"\rnot a bar: " + bar.lstrip(b"\r") + b"\n")
    w.close()
    await asyncio.wait_for(pub.flush(), 10)
    lines = [line for b in entries_of(r, job_id) for line in b.lines]
    assert lines == ["before", bar.decode().lstrip("\r"), after.decode().rstrip("\n"),
                     "not a bar: " + bar.decode().lstrip("\r")]
    assert (tmp_path / "stderr.log").read_bytes() == (  # the file keeps the bytes
        b"before\n" + bar + after + b"\rnot a bar: " + bar.lstrip(b"\r") + b"\n")


@pytest.mark.asyncio
async def test_the_hf_trainer_tty_run_has_no_glued_line(pub, r, job_id, tmp_path):
    logs = NodeLogs(LogConfig(redirects=Std.ALL), publisher=pub, job_id=job_id, node_id=NODE)
    w = logs.open_worker(directory=tmp_path, role="r", rank=0, local_rank=0, attempt=0)
    for _, stream, data in chunks("hf_trainer_tty"):
        w.feed(stream, data)
    w.close()
    await asyncio.wait_for(pub.flush(), 10)
    err = [line for b in entries_of(r, job_id) if b.stream == ERR for line in b.lines]
    assert any(line.startswith("[transformers] `loss_type=None`") for line in err), err
    assert not any(re.search(r"it/s\]\S", line) or re.search(r"\|.*\[transformers\]", line)
                   for line in err), err


# -- a line's time is its first byte's --------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_bar_redrawn_for_3_s_keeps_its_first_bytes_time_and_place(
        pub, r, job_id, tmp_path):
    logs = NodeLogs(LogConfig(redirects=Std.ALL), publisher=pub, job_id=job_id, node_id=NODE)
    w = logs.open_worker(directory=tmp_path, role="r", rank=0, local_rank=0, attempt=0)
    w.feed(OUT, b"before\n")
    await asyncio.wait_for(pub.flush(), 10)
    w.feed(ERR, b"\r  0%")
    started = time.monotonic()
    i = 0
    while time.monotonic() - started < 3.0:  # the bar's redraws over 3 s: the input
        await asyncio.sleep(0.1)
        i += 1
        w.feed(ERR, f"\r{min(i, 99):3d}%".encode())
        if i == 10:
            w.feed(OUT, b"printed while the bar moves\n")
    w.feed(ERR, b"\r100%\n")
    w.feed(OUT, b"after\n")
    w.close()
    await asyncio.wait_for(pub.flush(), 10)
    entries = entries_of(r, job_id)
    before_ms = entries[0].server_ms
    first_live = next(b for b in entries if b.live)
    final = next(b for b in entries if b.stream == ERR and "100%" in b.lines)
    assert final.server_ms - before_ms >= 2900  # its last frame came 3 s later
    view = JobView("j")
    for b in entries:
        view.apply_logs(b)
    rows = [(line[3], line[0]) for line in view.all_logs]
    assert [t for t, _ in rows] == ["before", "100%", "printed while the bar moves", "after"]
    times = dict(rows)
    # Stamped with its first byte, in the first live entry's 0.1-0.4 s (not its last frame's).
    assert first_live.server_ms - 500 <= times["100%"] <= first_live.server_ms, (
        times, first_live.server_ms)
    assert times["100%"] - before_ms < 600
    assert [t for _, t in rows] == sorted(t for _, t in rows)  # in the order of first bytes
    fast = JobView("j")  # the console's reader folds entries through apply_many: the same
    fast.apply_many(entries)
    assert list(fast.all_logs) == list(view.all_logs)
    # The wire carries durations: the age of the final line's first byte.
    assert final.age >= 2900 and final.lines[0] == "100%"


# -- the wire ------------------------------------------------------------------------------------


def test_live_blocks_and_ages_round_trip_and_old_readers_read_one_live_line():
    batches = [LogBatch("n", 0, 0, 0, OUT, 7, ["done", "bar a", "bar b"], live=2, age=3000,
                        live_age=1200),
               LogBatch("n", 1, 1, 0, ERR, 3, ["plain"])]
    fields = encode_node_log_entry("n", batches)
    assert json.loads(fields["parts"])[0][6] == 1  # what an older reader sees: one live line
    assert json.loads(fields["ext"]) == [[2, 3000, 1200], [0, 0, 0]]
    got = decode_log_entries("5000-0", {k.encode(): v.encode() for k, v in fields.items()})
    assert got is not None
    assert [(b.live, b.age, b.live_age, b.lines) for b in got] == [
        (2, 3000, 1200, ["done", "bar a", "bar b"]), (0, 0, 0, ["plain"])]
    assert got[0].line_times() == [2000, 3800, 3800] and got[1].line_times() == [5000]
    flat = [x for kv in fields.items() for x in (kv[0].encode(), kv[1].encode())]
    fast, refused = LogEntryDecoder().decode([(b"5000-0", flat)])
    assert refused == 0 and fast == got
    # No ext (an older agent): live=1 reads as one line, no ages.
    del fields["ext"]
    old = decode_log_entries("5000-0", fields)
    assert old is not None and (old[0].live, old[0].age) == (1, 0)
    assert "ext" not in encode_node_log_entry("n", [batches[1]])  # nothing to say: no field


@pytest.mark.parametrize("ext", ['[[2,0,0]]', '[[5,0,0],[0,0,0]]', '[[1,-5,0],[0,0,0]]',
                                 '[[0,0,0],[0,0,0]]', '"x"', '[[1,0,0],[0,0]]', "{",
                                 '[[1,0,1e99],[0,0,0]]', '[[1,0,99999999999999],[0,0,0]]'])
def test_a_malformed_ext_is_ignored(ext):
    fields = encode_node_log_entry("n", [
        LogBatch("n", 0, 0, 0, OUT, 7, ["a", "b"], live=1, age=5),
        LogBatch("n", 1, 1, 0, ERR, 3, ["c"])])
    fields["ext"] = ext
    got = decode_log_entries("5000-0", fields)
    assert got is not None and [(b.live, b.age) for b in got] == [(1, 0), (0, 0)]
    flat = [x for kv in fields.items() for x in (kv[0].encode(), kv[1].encode())]
    assert LogEntryDecoder().decode([(b"5000-0", flat)]) == (got, 0)


def test_the_console_replaces_a_block_that_grows_and_shrinks():
    view = JobView("j")

    def feed(seq: int, lines: list[str], live: int = 0, rank: int = 0) -> None:
        view.apply_logs(LogBatch("n", rank, rank, 0, OUT, seq, lines, id=f"{1000 + seq}-0",
                                 live=live))

    feed(1, ["start", "a 1", "b 1"], live=2)
    feed(1, ["other rank"], rank=1)
    feed(2, ["a 2", "b 2", "c 2"], live=3)  # grew: the new row after the others
    assert texts(view.logs_for(0)) == ["start", "a 2", "b 2", "c 2"]
    assert texts(view.all_logs) == ["start", "a 2", "b 2", "other rank", "c 2"]
    feed(3, ["a 3"], live=1)  # shrank: the rows below it blank, still the block's
    assert texts(view.logs_for(0)) == ["start", "a 3", "", ""]
    feed(4, ["log line", "a 4", "b 4"], live=1)  # fills the blank rows first
    assert texts(view.logs_for(0)) == ["start", "log line", "a 4", "b 4"]
    feed(5, ["b 5 done", "the end"])  # the block was "b 4" alone: its row takes the first
    assert texts(view.logs_for(0)) == ["start", "log line", "a 4", "b 5 done", "the end"]
    feed(7, ["x"], live=1)
    feed(9, ["y"])  # not the next batch (a gap): appended, the row stays as it was drawn
    assert texts(view.logs_for(0))[-2:] == ["x", "y"]


# -- the emulator on hostile output --------------------------------------------------------------


def test_the_emulator_is_bounded_and_shows_controls_as_text():
    screen = StreamScreen(80, 24)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    screen.feed(b"\x1b[2K", 0.0)  # a display
    screen.feed(b"\x1b]0;" + b"t" * 5_000_000, 0.1)  # a title that never ends
    screen.feed(b"\x07\x1b\\\x1b7" * 20_000, 0.2)  # saved cursors without end
    screen.feed(b"\x1b[" + b"9" * 100_000 + b"A", 0.3)  # a sequence without end
    screen.feed(b"\x1b[99999999;99999999H\x1b[5K\x1b[9J\x1b[?3h\x1b[?5m\x1b[<1m", 0.4)
    screen.feed(b"\nok \x01 \xc2\x9b31m \xe2\x80\xae \x1b[31mred\x1b[0m \xe2\x80\x8dx\n", 0.5)
    grew = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grew < 2_000_000, grew
    assert len(screen._screen.savepoints) <= 16 and screen._screen.columns == 80
    lines = [text for text, _ in screen.close()]
    got = [line for line in lines if "ok" in line]
    assert max(map(len, lines)) < 70_000  # a line without end is kept to its head
    assert got == ["ok \\x01 \\x9b31m \\u202e \x1b[31mred\x1b[0m \\u200dx"], lines


def test_only_output_that_moves_the_cursor_is_emulated():
    assert not moves_cursor(b"plain \x1b[31mred\x1b[0m\r 50%\n")
    assert moves_cursor(b"\r\x1b[2K\x1b[1A\x1b[2Kbar") and moves_cursor(b"\x1b[?25l")
    assert moves_cursor(b"x\x1b[10;1H")


# -- --worker-tty ---------------------------------------------------------------------------------

PROBE = """
    import json, os, sys
    report = {"out": sys.stdout.isatty(), "err": sys.stderr.isatty()}
    if report["out"]:
        report["size"] = list(os.get_terminal_size(1))
        report["err_size"] = list(os.get_terminal_size(2))
    print(json.dumps(report))
    print("to stderr", file=sys.stderr)
"""


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["exec", "forked"])
async def test_with_worker_tty_on_both_streams_are_terminals(tmp_path, how):
    logs = NodeLogs(LogConfig(redirects=Std.ALL))
    preload = ("json",) if how == "forked" else ()
    # Two attempts: the second one's workers were parked ahead (forked) or its keeper
    # started ahead (exec).
    await run_group(tmp_path, logs, PROBE, worker_tty=(132, 43), preload=preload, attempts=2,
                    nproc=2)
    for attempt in range(2):
        for rank in range(2):
            d = tmp_path / f"attempt_{attempt}" / str(rank)
            first, _, rest = (d / "stdout.log").read_bytes().partition(b"\n")
            report = json.loads(first)
            assert report == {"out": True, "err": True, "size": [132, 43],
                              "err_size": [132, 43]}, report
            assert rest == b""  # raw: "\n" stays "\n" (no "\r\n")
            assert (d / "stderr.log").read_bytes() == b"to stderr\n"  # the streams apart


@pytest.mark.asyncio
async def test_without_worker_tty_the_streams_are_pipes(tmp_path):
    logs = NodeLogs(LogConfig(redirects=Std.ALL))
    await run_group(tmp_path, logs, PROBE, worker_tty=ptys.window_for("auto", io.StringIO()))
    report = json.loads((tmp_path / "attempt_0" / "0" / "stdout.log").read_text().split("\n")[0])
    assert report == {"out": False, "err": False}


def test_worker_tty_modes():
    script = str(Path(__file__))
    assert parse_args(["--standalone", script]).worker_tty == "auto"
    assert parse_args(["--standalone", "--worker-tty", "on", script]).worker_tty == "on"
    with pytest.raises(UsageError, match="worker-tty"):
        parse_args(["--standalone", "--worker-tty", "yes", script])
    assert ptys.window_for("off", sys.stdout) is None
    assert ptys.window_for("auto", io.StringIO()) is None
    assert ptys.window_for("on", io.StringIO()) == ptys.DEFAULT_SIZE
    master, slave, name = ptys.open_pty((90, 20))
    try:
        assert os.get_terminal_size(slave) == os.terminal_size((90, 20))
        assert name.startswith("/dev/pts/") or name.startswith("/dev/tty")
        with open(os.devnull) as f:
            assert ptys.window_for("auto", f) is None
        term = os.fdopen(os.dup(slave), "w")
        try:
            assert ptys.window_for("auto", term) == (90, 20)  # the agent's terminal's size
        finally:
            term.close()
    finally:
        os.close(master)
        os.close(slave)


def test_logs_follow_on_a_terminal_redraws_a_block_of_rows_in_place(capsys, monkeypatch):
    import argparse

    from elastic_console.commands.logs import _LogPrinter

    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("LINES", "24")
    args = argparse.Namespace(rank=None, stderr=False, grep=None, dedupe=False)
    printer = _LogPrinter(args, tty=True)

    def batch(seq: int, lines: list[str], live: int = 0) -> LogBatch:
        return LogBatch("n", 0, 0, 0, OUT, seq, lines, id=f"{seq}-0", live=live)

    printer.follow(batch(1, ["start", "a 1", "b 1"], live=2))
    printer.follow(batch(2, ["a 2", "b 2"], live=2))
    printer.follow(batch(3, ["a done", "b done", "end"]))
    printer.close()
    out = capsys.readouterr().out
    screen = pyte.Screen(80, 24)
    screen.set_mode(pyte.modes.LNM)
    pyte.Stream(screen).feed(out)
    rows = [row.rstrip() for row in screen.display if row.strip()]
    assert rows == ["[rank 0] start", "[rank 0] a done", "[rank 0] b done", "[rank 0] end"], out
    assert "\r\x1b[K\x1b[1A\x1b[K" in out  # both rows erased before each redraw


@pytest.mark.asyncio
async def test_a_line_waiting_for_its_newline_is_shown_live_where_it_started(
        pub, r, job_id, tmp_path):
    logs = NodeLogs(LogConfig(redirects=Std.ALL), publisher=pub, job_id=job_id, node_id=NODE)
    w = logs.open_worker(directory=tmp_path, role="r", rank=0, local_rank=0, attempt=0)
    w.feed(OUT, b"Loading the model...")

    def shipped() -> list[LogBatch]:
        return entries_of(r, job_id)

    await wait_until_async(shipped, 10, "the unfinished line, live")
    w.feed(ERR, b"a warning meanwhile\n")
    await asyncio.wait_for(pub.flush(), 10)
    w.feed(OUT, b" done\n")
    w.close()
    await asyncio.wait_for(pub.flush(), 10)
    entries = shipped()
    assert entries[0].live == 1 and entries[0].lines == ["Loading the model..."]
    view = JobView("j")
    for b in entries:
        view.apply_logs(b)
    assert texts(view.all_logs) == ["Loading the model... done", "a warning meanwhile"]


def test_a_process_holding_a_workers_terminal_is_found_by_it():
    """The drain's last resort finds whoever still holds a worker's output by the pty's path,
    as it finds a pipe's holder by the pipe's inode."""
    import subprocess

    from elastic_agent.supervision.launch.strays import pipe_holders

    master, slave, name = ptys.open_pty((80, 24))
    holder = subprocess.Popen(["sleep", "30"], stdout=slave, stdin=subprocess.DEVNULL)
    try:
        assert holder.pid in pipe_holders(set(), {name})
        assert holder.pid not in pipe_holders(set(), {"/dev/pts/no-such"})
    finally:
        holder.kill()
        holder.wait()
        os.close(master)
        os.close(slave)
