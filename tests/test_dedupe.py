"""Identical output of many ranks shown once: the rule (console/job/dedupe.py), the console's ``u``
toggle (Pilot, no tmux) and ``elastic-console logs --dedupe`` against a real Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading

import redis

from elastic_agent.coordination.wire.keyspace import JobKeys, console_client_name
from elastic_agent.coordination.wire.log_records import LogBatch, encode_log_batch
from elastic_console.job.dedupe import Collapser, UniqueLogs, format_ranks
from elastic_console.job.logbuffer import LogBuffer
from elastic_console.job.state import JobView
from elastic_console.tui.app import ConsoleApp
from elastic_console.tui.navigation import KEY_HELP
from tests.waiting import blocked_in, wait_until, wait_until_async

T0 = 1_700_000_000_000
TRACEBACK = ["Traceback (most recent call last):",
             '  File "/workspace/train.py", line 41, in <module>',
             "    dist.all_reduce(t)",
             "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed"]


def texts(buf: LogBuffer) -> list[str]:
    return [line[3] for line in buf]


def plain(text: str) -> str:
    return text.replace("\x1b[2m", "").replace("\x1b[0m", "")


# -- the rule ---------------------------------------------------------------------------------

def test_format_ranks():
    assert format_ranks([]) == ""
    assert format_ranks([5]) == "5"
    assert format_ranks([3, 0, 1, 2, 4, 6, 7, 7, 63, 9, 8]) == "0-4,6-9,63"


def test_512_identical_tracebacks_become_one_block_whose_counts_grow():
    src = LogBuffer(200_000)
    unique = UniqueLogs(src)
    for rank in range(512):
        # Interleaved as they arrive: each rank's copy a few ms after the previous one's.
        src.extend([(T0 + rank, rank, "err", t) for t in TRACEBACK])
        if rank == 99:
            unique.sync()
            assert [plain(t) for t in texts(unique.buffer)] == [
                f"×100 ranks [0-99] {t}" for t in TRACEBACK]
    unique.sync()
    assert len(src) == 512 * len(TRACEBACK)
    assert [plain(t) for t in texts(unique.buffer)] == [
        f"×512 ranks [0-511] {t}" for t in TRACEBACK]
    assert all(line[1] == 0 for line in unique.buffer)  # the first rank that printed it


def test_what_counts_as_identical():
    src = LogBuffer(1000)
    unique = UniqueLogs(src)
    src.extend([
        (T0, 0, "out", "epoch 1"),
        (T0 + 1, 1, "out", "epoch 1"),
        (T0 + 2, 1, "out", "epoch 1"),  # rank 1 again: a new thing happening, a new row
        (T0 + 3, 2, "err", "epoch 1"),  # another stream: another line
        (T0 + 4, 3, "out", "loss=0.5"),
        (T0 + 5, 0, "out", "loss=0.4"),  # another text
        (T0 + 20_000, 2, "out", "epoch 1"),  # after the window: a new row (joins rank 1's)
    ])
    unique.sync()
    assert [(line[1], line[2], plain(line[3])) for line in unique.buffer] == [
        (0, "out", "×2 ranks [0-1] epoch 1"),
        (1, "out", "epoch 1"),
        (2, "err", "epoch 1"),
        (3, "out", "loss=0.5"),
        (0, "out", "loss=0.4"),
        (2, "out", "epoch 1"),
    ]


def test_memory_is_bounded_by_the_open_groups():
    c = Collapser(open_limit=100, member_limit=1_000)
    for i in range(10_000):
        c.add(T0, i % 7, "out", f"line {i}")
    assert len(c) <= 200
    for rank in range(5_000):  # one huge group: the rank sets are bounded too
        c.add(T0, rank, "out", "same")
    assert c._members <= 1_000


def test_a_line_redrawn_in_place_replaces_its_row_or_leaves_its_group():
    src = LogBuffer(1000)
    unique = UniqueLogs(src)
    src.extend([(T0, 0, "err", "train  10%"), (T0, 1, "err", "train  10%"),
                (T0, 2, "err", "eval   0%")])
    unique.sync()
    assert [plain(t) for t in texts(unique.buffer)] == ["×2 ranks [0-1] train  10%", "eval   0%"]
    src.replace(2, (T0 + 5, 2, "err", "eval  50%"))  # rank 2's own row: redrawn
    src.replace(1, (T0 + 5, 1, "err", "train  20%"))  # rank 1 moved on: it leaves the group
    unique.sync()
    assert [plain(t) for t in texts(unique.buffer)] == [
        "train  10%", "eval  50%", "train  20%"]
    src.replace(1, (T0 + 9, 1, "err", "train  30%"))  # ... and its own row is redrawn now
    unique.sync()
    assert [plain(t) for t in texts(unique.buffer)] == ["train  10%", "eval  50%", "train  30%"]


# -- the console's `u` ---------------------------------------------------------------------------

def _logs(view: JobView, ms: int, rank: int, seq: int, lines: list[str], stream: str = "err") -> None:
    view.apply_logs(LogBatch(f"node-{rank // 4}", rank, rank % 4, 0, stream, seq, lines,
                             id=f"{ms}-0"))


def test_u_collapses_the_all_ranks_view_and_counts_grow_live():
    view = JobView("job-u", all_scrollback=10_000)
    for rank in range(6):
        _logs(view, T0 + rank, rank, 1, [f"rank {rank} step 1"], "out")
        _logs(view, T0 + 10 + rank, rank, 2, TRACEBACK)
    app = ConsoleApp("job-u", view=view, utc=True, clock=lambda: T0 + 5000, cursor_blink=False)
    assert ("Logs", "u") in {(section, keys) for section, keys, _, _ in KEY_HELP}

    async def main() -> None:
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause()
            shown = lambda: [plain(line[3]) for line in app.log_view.visible_lines()]  # noqa: E731
            assert len(shown()) == 6 + 6 * len(TRACEBACK)
            await pilot.press("u")
            assert app.unique_lines
            await wait_until_async(lambda: len(shown()) == 6 + len(TRACEBACK), 10, "collapsed")
            # In order of first appearance: rank 0's step line, the traceback, the others.
            assert shown() == ["rank 0 step 1", *[f"×6 ranks [0-5] {t}" for t in TRACEBACK],
                               *[f"rank {r} step 1" for r in range(1, 6)]]
            assert "identical lines once" in str(app.log_title.render())
            # Two more ranks print the same traceback: the rows count them (no new rows).
            for rank in (6, 7):
                _logs(view, T0 + 30 + rank, rank, 1, TRACEBACK)
            app._tick(force=True)
            await pilot.pause()
            assert shown()[1:1 + len(TRACEBACK)] == [f"×8 ranks [0-7] {t}" for t in TRACEBACK]
            assert len(shown()) == 6 + len(TRACEBACK)
            await pilot.press("u")
            assert not app.unique_lines and app.log_view.source is view.all_logs
            await wait_until_async(lambda: len(shown()) == 6 + 8 * len(TRACEBACK), 10, "expanded")

    asyncio.run(asyncio.wait_for(main(), 60))


# -- elastic-console logs --dedupe ---------------------------------------------------------------

CONSOLE = [sys.executable, "-m", "elastic_console.cli"]


def _write_batches(r: redis.Redis, job: str, ranks: range, lines: list[str], seq: int) -> None:
    keys = JobKeys(job)
    r.hset(keys.meta, mapping={"min_nodes": 1, "max_nodes": 1, "max_restarts": 0})
    for rank in ranks:
        node = f"node-{rank // 4}"
        r.sadd(keys.log_streams, keys.logs(node))
        r.xadd(keys.logs(node), encode_log_batch(LogBatch(node, rank, rank % 4, 0, "err", seq,
                                                          lines)))


def test_logs_dedupe_prints_a_line_of_many_ranks_once(redis_url: str, r: redis.Redis, job_id: str):
    _write_batches(r, job_id, range(8), TRACEBACK, 1)
    _write_batches(r, job_id, range(3, 4), ["only rank 3 says this"], 2)
    env = {**os.environ, "ELASTIC_REDIS_URL": redis_url}
    p = subprocess.run([*CONSOLE, "logs", job_id, "--dedupe"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [f"×8 ranks [0-7] {t}" for t in TRACEBACK] + [
        "[rank 3] only rank 3 says this"]
    p = subprocess.run([*CONSOLE, "logs", job_id], capture_output=True, text=True, timeout=60,
                       env=env)
    assert len(p.stdout.splitlines()) == 8 * len(TRACEBACK) + 1  # without it: every copy

    # Following: a row is printed once the other ranks' copies had their time to come
    # (DEDUPE_HOLD_S). A round written while the follower reads the history would be split
    # between the history (not printed: --tail 0) and the follow; so the round is written
    # once the follower waits in its XREAD, and is then read whole.
    f = subprocess.Popen([*CONSOLE, "logs", job_id, "--dedupe", "-f", "--tail", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    out: list[str] = []
    assert f.stdout is not None
    reader = threading.Thread(target=lambda: out.extend(line.rstrip("\n") for line in f.stdout),
                              daemon=True)
    reader.start()
    try:
        wait_until(lambda: blocked_in(r, "xread", console_client_name(job_id)), 30,
                   "the follower to wait for new lines")
        for rank in range(8):
            _write_batches(r, job_id, range(rank, rank + 1), ["NCCL watchdog: timeout"], 10)
        wait_until(lambda: out, 15, "the collapsed row")
        assert out == ["×8 ranks [0-7] NCCL watchdog: timeout"], out
    finally:
        f.send_signal(signal.SIGINT)
        f.wait(30)
    assert f.returncode == 0, f.stderr.read() if f.stderr else ""
    reader.join(10)
    assert out == ["×8 ranks [0-7] NCCL watchdog: timeout"], out  # and nothing after it
