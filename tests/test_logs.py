"""The worker output pipeline: files, terminal (redirects/tee/filter/prefix), Redis batches."""

from __future__ import annotations

import asyncio
import io
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
import redis

from elastic_agent.coordination.wire import event_records, log_records
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.log_records import LogBatch
from elastic_agent.supervision.launch.exits import WorkerState
from elastic_agent.supervision.launch.worker_env import RankAssignment, WorkerSpec
from elastic_agent.supervision.launch.workers import WorkerGroup
from elastic_agent.supervision.records.log_config import (
    LogConfig,
    Std,
    line_prefix,
    parse_local_ranks_filter,
    parse_std_spec,
)
from elastic_agent.supervision.records.log_shipping import make_logs_drop_marker
from elastic_agent.supervision.records.logs import NodeLogs
from elastic_agent.supervision.records.publisher import StreamPublisher
from tests.waiting import wait_until_async

NODE = "node-a"


@pytest_asyncio.fixture
async def publisher(redis_url: str, job_id: str) -> AsyncIterator[StreamPublisher]:
    pub = StreamPublisher(redis_url, make_drop_marker=make_logs_drop_marker(job_id, NODE))
    await pub.start()
    yield pub
    await pub.close()


@pytest.fixture
def term() -> Iterator[tuple[io.BytesIO, io.BytesIO]]:
    yield io.BytesIO(), io.BytesIO()


def batches(r: redis.Redis, job_id: str) -> list[LogBatch]:
    out = []
    for entry_id, fields in r.xrange(JobKeys(job_id).logs(NODE)):
        decoded = log_records.decode_log_entries(entry_id, fields)
        assert decoded is not None
        out += decoded
    return out


def lines_of(bs: list[LogBatch], rank: int, stream: str = log_records.STDOUT) -> list[str]:
    out: list[str] = []
    for b in bs:
        if b.rank == rank and b.stream == stream:
            # finished lines: a live block's rows come again, final, in a later batch
            out.extend(b.lines[:len(b.lines) - b.live])
    return out


async def run_workers(tmp_path: Path, logs: NodeLogs, code: str, nproc: int = 1,
                      attempt: int = 0) -> WorkerGroup:
    """Run ``code`` in ``nproc`` real worker processes to the end, output drained."""
    spec = WorkerSpec(nproc=nproc, entrypoint=[sys.executable, "-u", "-c",
                                               textwrap.dedent(code)],
                      run_id="run", job_id="job", log_dir=tmp_path, shutdown_timeout=5)
    group = WorkerGroup(spec, logs=logs)
    await group.start(RankAssignment(group_rank=0, group_world_size=1, world_size=nproc,
                                     base_rank=0, master_addr="127.0.0.1", master_port=1,
                                     attempt=attempt))
    result = await asyncio.wait_for(group.wait(), 30)
    await group.stop()
    assert result.state is WorkerState.SUCCEEDED, result
    return group


# -- Redis and files -------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_lines_reach_files_and_redis(tmp_path: Path, publisher: StreamPublisher,
                                           r: redis.Redis, job_id: str, term) -> None:
    logs = NodeLogs(publisher=publisher, job_id=job_id, node_id=NODE,
                    stdout=term[0], stderr=term[1])
    await run_workers(tmp_path, logs, """
        import os, sys
        rank = os.environ["RANK"]
        for i in range(3000):
            print(f"r{rank} line {i}")
        print(f"r{rank} oops", file=sys.stderr)
        sys.stdout.write("crlf line\\r\\nno newline at the end")
    """, nproc=2)
    await asyncio.wait_for(publisher.flush(), 10)
    bs = batches(r, job_id)
    for rank in (0, 1):
        expected = [f"r{rank} line {i}" for i in range(3000)]
        expected += ["crlf line", "no newline at the end"]
        assert lines_of(bs, rank) == expected
        assert lines_of(bs, rank, log_records.STDERR) == [f"r{rank} oops"]
        mine = [b for b in bs if b.rank == rank and b.stream == log_records.STDOUT]
        assert [b.seq for b in mine] == list(range(1, len(mine) + 1))
        assert all(b.node == NODE and b.local_rank == rank and b.attempt == 0 for b in mine)
        # The files hold the raw bytes, in torchrun's per-rank layout.
        raw = (tmp_path / "attempt_0" / str(rank) / "stdout.log").read_bytes()
        assert raw.startswith(f"r{rank} line 0\n".encode())
        assert raw.endswith(b"crlf line\r\nno newline at the end")
        err = (tmp_path / "attempt_0" / str(rank) / "stderr.log").read_bytes()
        assert err == f"r{rank} oops\n".encode()
    # Several lines per entry: far fewer XADDs than lines.
    assert len(bs) < 2 * 3000 / 10
    assert r.smembers(JobKeys(job_id).log_streams) == {JobKeys(job_id).logs(NODE).encode()}


@pytest.mark.asyncio
async def test_a_1mb_line_is_capped_and_the_pipeline_survives(
        tmp_path: Path, publisher: StreamPublisher, r: redis.Redis, job_id: str, term) -> None:
    logs = NodeLogs(publisher=publisher, job_id=job_id, node_id=NODE,
                    stdout=term[0], stderr=term[1])
    await run_workers(tmp_path, logs, """
        import sys
        print("before")
        sys.stdout.write("A" * (1 << 20) + "\\n")
        print("after")
        sys.stdout.write("B" * (1 << 20))  # a giant unterminated last line
    """)
    await asyncio.wait_for(publisher.flush(), 10)
    got = lines_of(batches(r, job_id), 0)
    cap = 16 * 1024
    assert got[0] == "before" and got[2] == "after" and len(got) == 4
    assert got[1] == "A" * cap + f" …[truncated {(1 << 20) - cap} bytes]"
    assert got[3] == "B" * cap + f" …[truncated {(1 << 20) - cap} bytes]"
    # The file and the terminal (not capped) have everything.
    assert (tmp_path / "attempt_0" / "0" / "stdout.log").stat().st_size == 2 * (1 << 20) + 14
    assert term[0].getvalue().count(b"A") == 1 << 20


@pytest.mark.asyncio
async def test_escape_sequences_arrive_as_data_and_bad_utf8_is_replaced(
        tmp_path: Path, publisher: StreamPublisher, r: redis.Redis, job_id: str, term) -> None:
    logs = NodeLogs(publisher=publisher, job_id=job_id, node_id=NODE,
                    stdout=term[0], stderr=term[1])
    await run_workers(tmp_path, logs, """
        import sys
        out = sys.stdout.buffer
        out.write(b"\\x1b]0;title\\x07set the title\\n")
        out.write(b"\\x1b[2Jcleared\\n")
        out.write(b"\\x1b[31mred\\x1b[0m\\n")
        out.write(b"bad \\xff\\xfe end\\n")
        out.write("caf\\u00e9 \\u2603\\n".encode())
        out.flush()
    """)
    await asyncio.wait_for(publisher.flush(), 10)
    got = lines_of(batches(r, job_id), 0)
    # Read with the screen erase (one chunk), the title is rendered too, its sequence removed.
    assert got[0] in ("\x1b]0;title\x07set the title", "set the title"), got
    assert got[1:] == [
        "cleared",  # erasing the screen is rendered (records/screen.py), not data
        "\x1b[31mred\x1b[0m",
        "bad \ufffd\ufffd end",
        "café ☃",
    ]


@pytest.mark.asyncio
async def test_chunk_boundaries_and_multibyte_characters(
        tmp_path: Path, publisher: StreamPublisher, r: redis.Redis, job_id: str, term) -> None:
    """Lines and UTF-8 sequences split across reads come out whole."""
    logs = NodeLogs(LogConfig(max_line_bytes=20), publisher=publisher, job_id=job_id,
                    node_id=NODE, stdout=term[0], stderr=term[1])
    w = logs.open_worker(directory=tmp_path, role="default", rank=5, local_rank=1, attempt=2)
    data = "héllo wörld\n☃☃☃\r\n".encode() + b"x" * 30 + "é".encode() * 10 + b"\nend"
    for i in range(len(data)):  # one byte at a time: the worst case
        w.feed(log_records.STDOUT, data[i:i + 1])
    w.close()
    assert w.drained.is_set()
    await asyncio.wait_for(publisher.flush(), 10)
    bs = batches(r, job_id)
    assert all(b.rank == 5 and b.local_rank == 1 and b.attempt == 2 for b in bs)
    assert lines_of(bs, 5) == ["héllo wörld", "☃☃☃", "x" * 20 + " …[truncated 30 bytes]",
                               "end"]
    assert (tmp_path / "stdout.log").read_bytes() == data
    assert term[0].getvalue() == data + b"\n"


# -- terminal --------------------------------------------------------------------------------

def feed_all(logs: NodeLogs, tmp_path: Path, nproc: int = 2) -> None:
    for lr in range(nproc):
        w = logs.open_worker(directory=tmp_path / str(lr), role="trainer", rank=10 + lr,
                             local_rank=lr, attempt=0)
        w.feed(log_records.STDOUT, f"out {lr} a\nout {lr} b\n".encode())
        w.feed(log_records.STDERR, f"err {lr}\n".encode())
        w.close()


def test_tee_prefixes_every_line(tmp_path: Path, term) -> None:
    out, err = term
    feed_all(NodeLogs(LogConfig(tee=Std.ALL), stdout=out, stderr=err), tmp_path)
    assert out.getvalue() == (b"[trainer0]:out 0 a\n[trainer0]:out 0 b\n"
                              b"[trainer1]:out 1 a\n[trainer1]:out 1 b\n")
    assert err.getvalue() == b"[trainer0]:err 0\n[trainer1]:err 1\n"
    assert (tmp_path / "1" / "stdout.log").read_bytes() == b"out 1 a\nout 1 b\n"


def test_tee_with_a_prefix_template(tmp_path: Path, term) -> None:
    out, err = term
    cfg = LogConfig(tee=Std.OUT, log_line_prefix_template="${role_name}/${rank}/${local_rank}| ")
    feed_all(NodeLogs(cfg, stdout=out, stderr=err), tmp_path)
    assert out.getvalue().splitlines()[0] == b"trainer/10/0| out 0 a"
    assert out.getvalue().splitlines()[3] == b"trainer/11/1| out 1 b"
    assert err.getvalue() == b"err 0\nerr 1\n"  # not teed, not redirected: as is


def test_tee_partial_lines_continue_without_a_new_prefix(tmp_path: Path, term) -> None:
    out, _ = term
    logs = NodeLogs(LogConfig(tee=Std.ALL), stdout=out, stderr=term[1])
    w = logs.open_worker(directory=tmp_path, role="r", rank=0, local_rank=0, attempt=0)
    for piece in (b"he", b"llo\nwor", b"ld\n", b"tail"):
        w.feed(log_records.STDOUT, piece)
    w.close()
    assert out.getvalue() == b"[r0]:hello\n[r0]:world\n[r0]:tail\n"


def test_redirects_keep_lines_off_the_terminal(tmp_path: Path, term) -> None:
    out, err = term
    feed_all(NodeLogs(LogConfig(redirects=Std.ALL), stdout=out, stderr=err), tmp_path)
    assert out.getvalue() == b"" and err.getvalue() == b""
    assert (tmp_path / "0" / "stdout.log").read_bytes() == b"out 0 a\nout 0 b\n"
    assert (tmp_path / "0" / "stderr.log").read_bytes() == b"err 0\n"


def test_per_rank_redirects_and_the_local_ranks_filter(tmp_path: Path, term) -> None:
    out, err = term
    # rank 0: stdout to the file only; rank 1: stderr teed. Only rank 1 on the terminal.
    cfg = LogConfig(redirects=parse_std_spec("0:1"), tee=parse_std_spec("1:2"))
    feed_all(NodeLogs(cfg, stdout=out, stderr=err), tmp_path / "a")
    assert out.getvalue() == b"out 1 a\nout 1 b\n"
    assert err.getvalue() == b"err 0\n[trainer1]:err 1\n"
    out2, err2 = io.BytesIO(), io.BytesIO()
    cfg = LogConfig(tee=Std.ALL, local_ranks_filter=parse_local_ranks_filter("1"))
    feed_all(NodeLogs(cfg, stdout=out2, stderr=err2), tmp_path / "b")
    assert out2.getvalue() == b"[trainer1]:out 1 a\n[trainer1]:out 1 b\n"
    assert err2.getvalue() == b"[trainer1]:err 1\n"
    # Filtered ranks still write their files.
    assert (tmp_path / "b" / "0" / "stdout.log").read_bytes() == b"out 0 a\nout 0 b\n"


@pytest.mark.asyncio
async def test_terminal_shows_an_unterminated_line_after_a_short_delay(tmp_path: Path,
                                                                       term) -> None:
    out, _ = term
    logs = NodeLogs(LogConfig(tee=Std.ALL), stdout=out, stderr=term[1])
    w = logs.open_worker(directory=tmp_path, role="r", rank=0, local_rank=0, attempt=0)
    w.feed(log_records.STDOUT, b"progress 10%\r")
    assert out.getvalue() == b""  # waits briefly for the rest of the line
    await wait_until_async(lambda: out.getvalue() != b"", 2, "the unterminated line")
    assert out.getvalue() == b"[r0]:progress 10%\r"
    w.feed(log_records.STDOUT, b"progress 100%\n")
    w.close()
    assert out.getvalue() == b"[r0]:progress 10%\rprogress 100%\n"


# -- specs -----------------------------------------------------------------------------------

def test_parse_std_spec() -> None:
    assert parse_std_spec("0") is Std.NONE
    assert parse_std_spec("1") is Std.OUT
    assert parse_std_spec("2") is Std.ERR
    assert parse_std_spec("3") is Std.ALL
    assert parse_std_spec("0:3,1:1") == {0: Std.ALL, 1: Std.OUT}
    assert parse_std_spec("12:2") == {12: Std.ERR}
    for bad in ("", "4", "-1", "a", "0:4", "0:1,", "0:1;1:2", "1,2", "0:1,0:2"):
        with pytest.raises(ValueError, match="stream spec"):
            parse_std_spec(bad)


def test_parse_local_ranks_filter_and_prefix() -> None:
    assert parse_local_ranks_filter("0,2") == frozenset({0, 2})
    assert parse_local_ranks_filter("") is None
    with pytest.raises(ValueError, match="comma-separated"):
        parse_local_ranks_filter("0,x")
    assert line_prefix(None, "default", 7, 3) == "[default3]:"
    assert line_prefix("[${rank}] ", "default", 7, 3) == "[7] "


def test_drop_marker_is_a_logs_dropped_event(job_id: str) -> None:
    key, fields = make_logs_drop_marker(job_id, NODE)(1234)
    assert key == JobKeys(job_id).events
    event = event_records.decode_event("5-0", fields)
    assert event is not None and event.type == event_records.EventType.LOGS_DROPPED
    assert event.node == NODE and event.data == {"count": 1234}


@pytest.mark.asyncio
async def test_a_nodes_workers_share_one_entry_per_flush(tmp_path: Path,
                                                        publisher: StreamPublisher,
                                                        r: redis.Redis, job_id: str,
                                                        term) -> None:
    """What 4 workers print within a LOG_LINGER goes to Redis as one entry of the node (one
    XADD, not one per worker stream), each worker's lines in order and numbered per stream."""
    logs = NodeLogs(publisher=publisher, job_id=job_id, node_id=NODE,
                    stdout=term[0], stderr=term[1])
    await run_workers(tmp_path, logs, """
        import os, sys, time
        rank = os.environ["RANK"]
        for i in range(20):
            print(f"r{rank} line {i}")
            print(f"r{rank} err {i}", file=sys.stderr)
            time.sleep(0.01)
    """, nproc=4)
    await asyncio.wait_for(publisher.flush(), 10)
    entries = [log_records.decode_log_entries(i, f)
               for i, f in r.xrange(JobKeys(job_id).logs(NODE))]
    assert all(entries)
    bs = [b for e in entries for b in e]
    for rank in range(4):
        assert lines_of(bs, rank) == [f"r{rank} line {i}" for i in range(20)]
        assert lines_of(bs, rank, log_records.STDERR) == [f"r{rank} err {i}" for i in range(20)]
        for stream in (log_records.STDOUT, log_records.STDERR):
            mine = [b.seq for b in bs if b.rank == rank and b.stream == stream]
            assert mine == list(range(1, len(mine) + 1))
    # Most entries hold several worker streams: far fewer XADDs than stream batches.
    assert max(len({(b.rank, b.stream) for b in e}) for e in entries) >= 4
    assert len(entries) < len(bs) / 2, (len(entries), len(bs))
