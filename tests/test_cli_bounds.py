"""Bounds on what a command line and a job's writers can make the CLI, the console and the
agent spend: a flood of names in the job's set of log streams (read a page at a time, at
most ``LOG_STREAM_NAMES_MAX``, the last round's nodes' streams first, and a line saying how
many were left out), and numeric options (NaN, the infinities, values past a stated maximum:
one line, status 2, before anything is read or sent). A real job on a real Redis."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.log_records import LogBatch
from elastic_agent.supervision.config import UsageError, parse_args
from elastic_console.cli import main
from elastic_console.job.client import JobClient
from elastic_console.job.follow import LOG_STREAM_NAMES_MAX
from tests.agents import SCRIPTS, Agent
from tests.test_console_app import console as tui
from tests.test_console_app import loaded, run
from tests.test_console_cli import PREFIX, console, events_of, one_error_line
from tests.waiting import wait_until, wait_until_async

FORGED = 200_000
#: The hang bound of one `logs` over the flood: the whole set took 10 s (`logs`) and 20 s
#: (`--attempt`) here; bounded, about 2 s on a loaded 2-core machine, the interpreter's start
#: included.
HANG_S = 10.0


class Job:
    def __init__(self, job_id: str, agent: Agent, redis_url: str, real_stream: str) -> None:
        self.id, self.agent, self.redis_url, self.real_stream = (job_id, agent, redis_url,
                                                                 real_stream)


@pytest.fixture(scope="module")
def flooded(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    """A running job (2 workers printing every 50 ms) whose set of log streams also holds
    200,000 forged names of this job's shape, as anyone who may write the job can add."""
    job_id = f"bounds-{uuid.uuid4().hex[:8]}"
    agent = Agent(["--redis", redis_url, "--job-id", job_id, "--local-addr", "127.0.0.1",
                   "--nproc-per-node", "2", "--shutdown-timeout", "5",
                   str(SCRIPTS / "sleeper.py")], tmp_path_factory.mktemp("bounds"), "agent")
    r = make_client(redis_url)
    keys = JobKeys(job_id)
    try:
        wait_until(lambda: events_of(r, job_id, EventType.WORKERS_STARTED), 30, "workers")
        wait_until(lambda: r.scard(keys.log_streams) == 1, 30, "the node's log stream")
        (real,) = (m.decode() for m in r.smembers(keys.log_streams))
        wait_until(lambda: r.xlen(real) >= 5, 30, "log lines")
        pipe = r.pipeline(transaction=False)
        for i in range(0, FORGED, 10_000):
            pipe.sadd(keys.log_streams, *(f"elastic:log:{{{job_id}/{n % 16}}}:forged-{n}"
                                          for n in range(i, i + 10_000)))
        pipe.execute()
        assert r.scard(keys.log_streams) == FORGED + 1
        yield Job(job_id, agent, redis_url, real)
    finally:
        agent.kill()
        agent.wait(30)
        r.delete(keys.log_streams)  # 200,000 names: not for the session's other tests
        r.close()


def timed(*args: str, redis_url: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    p = console(*args, redis_url=redis_url, timeout=HANG_S)  # TimeoutExpired: a hang
    return p, time.monotonic() - start


@pytest.mark.parametrize("extra", [[], ["--attempt", "0"]], ids=["logs", "attempt"])
def test_logs_read_a_bounded_number_of_stream_names_and_say_so(flooded: Job, extra: list[str]):
    p, took = timed("logs", flooded.id, "--tail", "5", *extra, redis_url=flooded.redis_url)
    assert p.returncode == 0, p.stderr
    notes = p.stderr.splitlines()
    assert len(notes) == 1 and notes[0].startswith("elastic-console: note: "), p.stderr
    assert f"holds {FORGED + 1:,} names" in notes[0]
    assert f"at most {LOG_STREAM_NAMES_MAX:,} are read" in notes[0]
    left = int(re.search(r"([\d,]+) were left out", notes[0]).group(1).replace(",", ""))
    assert FORGED + 1 - LOG_STREAM_NAMES_MAX <= left < FORGED
    # The job's own stream is read, whatever order the forged names came in.
    lines = p.stdout.splitlines()
    assert len(lines) == 5 and all(line.startswith("[rank ") for line in lines), p.stdout
    assert took < HANG_S


def test_the_console_client_follows_within_the_bound(flooded: Job):
    """What feeds the live console: history and every re-read of the set stay within the
    bound (however the set changes), the job's own stream among them, and its new lines
    still come; an earlier attempt's read carries the note too."""
    r = make_client(flooded.redis_url)
    keys = JobKeys(flooded.id)

    async def main_() -> None:
        client = JobClient(flooded.redis_url, flooded.id)
        try:
            await client.history(max_events=10, max_log_entries_per_stream=5)
            assert client.streams_note and "were left out" in client.streams_note
            assert flooded.real_stream in client.last_ids
            assert len(client.last_ids) <= LOG_STREAM_NAMES_MAX + 1  # and the events
            # More names, which the next pages of the set bring in another order.
            r.sadd(keys.log_streams, *(f"elastic:log:{{{flooded.id}/3}}:late-{n}"
                                       for n in range(20_000)))
            for late in range(3):
                r.xadd(f"elastic:log:{{{flooded.id}/3}}:late-{late}", {"v": "1"})
            await client._refresh_streams()
            assert flooded.real_stream in client.last_ids
            assert len(client.last_ids) <= LOG_STREAM_NAMES_MAX + 1
            seen = await wait_for_real_lines(client)
            assert seen and all(flooded.real_stream.endswith(f":{b.node}") for b in seen)
            found = await client.attempt_logs(0, max_lines=10)
            assert found.batches and "were left out" in found.note
        finally:
            await client.close()

    async def wait_for_real_lines(client: JobClient) -> list[LogBatch]:
        got: list[LogBatch] = []
        async for records in client.follow_many():
            got += [b for b in records if isinstance(b, LogBatch)]
            if got:
                return got
        return got

    try:
        asyncio.run(asyncio.wait_for(main_(), 60))
    finally:
        r.srem(keys.log_streams, *(f"elastic:log:{{{flooded.id}/3}}:late-{n}"
                                   for n in range(20_000)))
        r.delete(*(f"elastic:log:{{{flooded.id}/3}}:late-{n}" for n in range(3)))
        r.close()


def test_the_live_console_notes_the_names_left_out(flooded: Job):
    app = tui(flooded.redis_url, flooded.id)

    async def body(pilot, app) -> None:
        await loaded(app, ranks=2, timeout=30)
        await wait_until_async(lambda: any("were left out" in e.text
                                           for e in app.view.timeline), 10, "the note")
        await wait_until_async(lambda: app.view.lines_total > 0, 10, "the job's own lines")

    run(app, body)


# -- numeric options ---------------------------------------------------------------------------

BAD_NUMBERS = ["inf", "-inf", "nan", "1e308", "-1", "0x10", "9" * 5000]


@pytest.mark.parametrize("argv", [
    # --opt=VALUE: a value that starts with "-" is an option to argparse otherwise.
    *(["restart", "JOB", "--yes", f"--timeout={v}"] for v in (*BAD_NUMBERS, "0", "86401")),
    *(["stop", "JOB", "--yes", f"--timeout={v}"] for v in (*BAD_NUMBERS, "0")),
    *([cmd, "JOB", "--timeout", v] for cmd in ("stacks", "collectives", "rm")
      for v in ("inf", "nan", "1e308", "0")),
    ["logs", "JOB", "--tail", "1e9"], ["logs", "JOB", "--tail", "1000001"],
    ["logs", "JOB", "--rank=-1"], ["logs", "JOB", "--rank", "16777216"],
    ["logs", "JOB", "--attempt", "nan"], ["logs", "JOB", "--attempt", "1000000001"],
    ["stacks", "JOB", "--rank", "inf"], ["collectives", "JOB", "--rank", "1.5"],
    ["attach", "JOB", "--scrollback", "inf"], ["attach", "JOB", "--scrollback", "0"],
    ["attach", "JOB", "--scrollback", "4194305"],
    ["serve", "--port", "65536"], ["serve", "--max-sessions", "0"],
    ["serve", "--max-sessions", "1001"], ["serve", "--scrollback=-5"],
], ids=lambda argv: " ".join(a[:12] for a in argv))
def test_a_bad_number_is_one_line_and_nothing_is_sent(flooded: Job, argv: list[str], capsys):
    r = make_client(flooded.redis_url)
    commands = JobKeys(flooded.id).commands
    try:
        before = r.xlen(commands)
        code = main(["--redis", flooded.redis_url, *(flooded.id if a == "JOB" else a
                                                     for a in argv)])
        err = capsys.readouterr().err
        assert code == 2
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(PREFIX + "argument --"), err
        assert "is not a" in lines[0] and len(lines[0]) < 200, lines[0]
        assert r.xlen(commands) == before
    finally:
        r.close()


@pytest.mark.parametrize("argv", [["restart", "JOB", "--timeout", "inf", "--yes"],
                                  ["stop", "JOB", "--timeout", "1e308", "-y"],
                                  ["collectives", "JOB", "--timeout", "1e308"]])
def test_the_reported_timeouts_exit_2_without_a_traceback(flooded: Job, argv: list[str]):
    r = make_client(flooded.redis_url)
    try:
        before = r.xlen(JobKeys(flooded.id).commands)
        p = console(*(flooded.id if a == "JOB" else a for a in argv), redis_url=flooded.redis_url)
        assert p.returncode == 2
        assert "is not a number of seconds above 0 and at most 86,400" in one_error_line(p)
        assert r.xlen(JobKeys(flooded.id).commands) == before
        assert flooded.agent.proc.poll() is None  # still running: nothing reached it
    finally:
        r.close()


def test_good_numbers_still_parse():
    from elastic_console.cli import build_parser

    ns = build_parser().parse_args(["restart", "j", "--timeout", "0.5"])
    assert ns.timeout == 0.5
    ns = build_parser().parse_args(["logs", "j", "--tail", "0", "--rank", "16777215",
                                    "--attempt", "0"])
    assert (ns.tail, ns.rank, ns.attempt) == (0, 16777215, 0)
    ns = build_parser().parse_args(["serve", "--port", "0", "--max-sessions", "1000"])
    assert (ns.port, ns.max_sessions) == (0, 1000)


# -- the agent's own command line ---------------------------------------------------------------

SCRIPT = str(SCRIPTS / "sleeper.py")  # the script is checked before some numbers


@pytest.mark.parametrize("argv", [
    ["--monitor-interval", "inf"], ["--monitor-interval", "nan"],
    ["--monitor-interval", "604801"], ["--shutdown-timeout", "1e308"],
    ["--exit-barrier-timeout", "inf"], ["--stall-timeout", "1e308"],
    ["--stall-timeout", "inf"], ["--max-restarts", "1" + "0" * 30],
    ["--log-retention", "9" * 5000], ["--health-check-port", "65536"],
    ["--rdzv-conf", "join_timeout=nan"], ["--rdzv-conf", "last_call_timeout=inf"],
    ["--rdzv-conf", "heartbeat_timeout=1e308"], ["--rdzv-conf", "keep_alive_max_attempt=inf"],
    ["--straggler-interval", "inf"], ["--flight-recorder", "1e9"],
    ["--nproc-per-node", "32769"], ["--nnodes", "1:32769"],
    ["--rdzv-backend", "static", "--node-rank", "1e308"],
    ["--rdzv-backend", "static", "--master-port", "inf"],
], ids=lambda argv: " ".join(a[:20] for a in argv))
def test_the_agent_refuses_bad_numbers(argv: list[str]):
    with pytest.raises(UsageError) as caught:
        parse_args([*argv, SCRIPT], {})
    message = str(caught.value)
    assert "\n" not in message and len(message) < 200, message
    assert argv[-2].lstrip("-") in message or argv[-1].split("=")[0] in message, message


def test_the_agent_still_takes_good_numbers():
    cfg = parse_args(["--monitor-interval", "0.5", "--shutdown-timeout", "604800",
                      "--max-restarts", "1000000000", "--stall-timeout", "1e9",
                      "--nproc-per-node", "32768", "--rdzv-conf", "join_timeout=0.001",
                      SCRIPT], {})
    assert (cfg.monitor_interval, cfg.shutdown_timeout, cfg.max_restarts, cfg.stall_timeout,
            cfg.nproc, cfg.rendezvous.join_timeout) == (0.5, 604800.0, 10**9, 1e9, 32768,
                                                         0.001)


def test_the_agent_process_says_one_line_and_exits_2(tmp_path: Path):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the script ran')\n")
    for argv in (["--monitor-interval", "inf"], ["--stall-timeout", "1e308"]):
        p = subprocess.run([sys.executable, "-m", "elastic_agent.supervision.cli", "--standalone",
                            *argv, str(script)], capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, p.stdout + p.stderr
        lines = (p.stdout + p.stderr).strip().splitlines()
        assert len(lines) == 1 and "is not a number of seconds" in lines[0], lines
        assert "Traceback" not in p.stderr and "the script ran" not in p.stderr
