"""`elastic-console` subcommands as real subprocesses against a real job on a real Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire.event_records import EventType, decode_event, encode_event
from elastic_agent.coordination.wire.keyspace import JobKeys
from tests.agents import SCRIPTS, Agent, wait_until

CONSOLE = [sys.executable, "-m", "elastic_console.cli"]
PREFIX = "elastic-console: error: "


def console(*args: str, redis_url: str | None = None, timeout: float = 60,
            stdin: int | None = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env.pop("ELASTIC_REDIS_URL", None)
    if redis_url is not None:
        env["ELASTIC_REDIS_URL"] = redis_url
    return subprocess.run([*CONSOLE, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, stdin=stdin)


def one_error_line(p: subprocess.CompletedProcess[str]) -> str:
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), p.stderr
    assert "Traceback" not in p.stderr
    return lines[0]


def events_of(r: redis.Redis, job: str, event_type: str) -> list:
    evs = (decode_event(i, f) for i, f in r.xrange(JobKeys(job).events))
    return [e for e in evs if e is not None and e.type == event_type]


class Job:
    def __init__(self, job_id: str, agent: Agent, redis_url: str) -> None:
        self.id = job_id
        self.agent = agent
        self.redis_url = redis_url


@pytest.fixture(scope="module")
def job(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    """One running job (2 workers printing every 50 ms) shared by the tests of this module;
    the last tests restart and stop it."""
    job_id = f"cli-{uuid.uuid4().hex[:8]}"
    tmp = tmp_path_factory.mktemp("cli")
    agent = Agent(["--redis", redis_url, "--job-id", job_id, "--local-addr", "127.0.0.1",
                   "--nproc-per-node", "2", "--max-restarts", "3", "--shutdown-timeout", "5",
                   str(SCRIPTS / "sleeper.py")], tmp, "agent")
    r = make_client(redis_url)
    try:
        wait_until(lambda: events_of(r, job_id, EventType.WORKERS_STARTED), 30, "workers")
        # A few lines per rank, so --tail and --grep have something to choose from.
        wait_until(lambda: console("logs", job_id, "--rank", "1", "--tail", "30",
                                   redis_url=redis_url).stdout.count("\n") >= 30, 30, "log lines")
        yield Job(job_id, agent, redis_url)
    finally:
        agent.kill()
        agent.wait(30)
        r.close()


def test_ls_lists_the_job(job: Job):
    p = console("--redis", job.redis_url, "ls")
    assert p.returncode == 0, p.stderr
    header, *rows = p.stdout.splitlines()
    assert header.split() == ["JOB", "STATE", "NODES", "WORLD", "RESTARTS", "AGE", "EXPIRES"]
    mine = [row.split() for row in rows if row.split()[0] == job.id]
    assert mine and mine[0][1:5] == ["running", "1", "2", "0/3"]
    p = console("ls", "--json", redis_url=job.redis_url)
    listed = {j["job"]: j for j in json.loads(p.stdout)}
    assert listed[job.id]["state"] == "running" and listed[job.id]["world_size"] == 2


def test_status_human_and_json(job: Job):
    p = console("status", job.id, "--redis", job.redis_url)
    assert p.returncode == 0, p.stderr
    assert f"job       {job.id}: running (round 0)" in p.stdout
    assert "restarts  0/3 used" in p.stdout
    table = p.stdout.split("\n\n", 1)[1].splitlines()
    assert table[0].split() == ["RANK", "HOST", "LOCAL", "PID", "STATE", "RESTARTS", "LAST",
                                "EXIT", "CPU%", "RSS"]
    assert [row.split()[0] for row in table[1:]] == ["0", "1"]
    assert all(row.split()[4] == "running" for row in table[1:])

    p = console("status", job.id, "--json", redis_url=job.redis_url)
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert (data["job"], data["state"], data["world_size"], data["max_restarts"]) == (
        job.id, "running", 2, 3)
    assert [(r["rank"], r["local_rank"], r["state"], r["restarts"]) for r in data["ranks"]] == [
        (0, 0, "running", 0), (1, 1, "running", 0)]
    assert all(isinstance(r["pid"], int) for r in data["ranks"])
    assert [n["status"] for n in data["nodes"].values()] == ["joined"]
    assert data["root_cause"] is None


def test_events_human_and_json(job: Job):
    p = console("events", job.id, redis_url=job.redis_url)
    assert p.returncode == 0, p.stderr
    first = p.stdout.splitlines()[0].split(" ", 3)
    assert len(first[0]) == len("12:34:56.789") and first[2] == "node_joined"
    assert "host=" in first[3]
    p = console("events", job.id, "--json", redis_url=job.redis_url)
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    assert [r["type"] for r in rows[:3]] == ["node_joined", "rendezvous_complete",
                                             "workers_started"]
    assert set(rows[0]) == {"id", "time_ms", "type", "node", "data"}
    assert rows[0]["time_ms"] == int(rows[0]["id"].split("-")[0])
    assert rows[2]["data"]["ranks"] == [0, 1]


def test_logs_rank_tail_grep(job: Job):
    p = console("logs", job.id, "--rank", "0", "--tail", "5", "--grep", r"tick \d+ rank 0",
                redis_url=job.redis_url)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == 5 and all(line.startswith("[rank 0] tick ") for line in lines)
    ticks = [int(line.split()[3]) for line in lines]
    assert ticks == list(range(ticks[0], ticks[0] + 5))  # the last five, in order
    p = console("logs", job.id, "--tail", "400", redis_url=job.redis_url)
    assert {line.split("]")[0] for line in p.stdout.splitlines()} == {"[rank 0", "[rank 1"}
    assert console("logs", job.id, "--stderr", redis_url=job.redis_url).stdout == ""


def test_follow_streams_until_ctrl_c(job: Job, tmp_path: Path):
    env = {**os.environ, "ELASTIC_REDIS_URL": job.redis_url}
    outs = [tmp_path / "logs.out", tmp_path / "events.out"]
    procs = []
    for args, out in zip((["logs", job.id, "--follow", "--tail", "0", "--rank", "1"],
                          ["events", job.id, "--follow", "--json"]), outs):
        with open(out, "w") as f:
            procs.append(subprocess.Popen([*CONSOLE, *args], stdout=f, stderr=subprocess.PIPE,
                                          text=True, env=env))
    marker = {"count": 424242}
    r = make_client(job.redis_url)
    try:
        wait_until(lambda: outs[0].read_text().count("\n") >= 3, 15, "followed log lines")
        r.xadd(JobKeys(job.id).events, encode_event(EventType.LOGS_DROPPED, "tester", marker))
        wait_until(lambda: "424242" in outs[1].read_text(), 15, "the followed event")
    finally:
        r.close()
        for p in procs:
            p.send_signal(signal.SIGINT)
    for p in procs:
        _, err = p.communicate(timeout=15)
        assert p.returncode == 0, err
        assert "Traceback" not in err
    log_lines = outs[0].read_text().splitlines()
    assert log_lines and all(line.startswith("[rank 1] tick ") for line in log_lines)
    events = [json.loads(line) for line in outs[1].read_text().splitlines()]
    assert events[0]["type"] == "node_joined"  # the past first, then what followed
    assert any(e["data"] == marker and e["node"] == "tester" for e in events)


def test_bad_input_is_one_line(job: Job):
    p = console("status", "no-such-job", redis_url=job.redis_url)
    assert p.returncode == 1
    assert one_error_line(p) == (f"{PREFIX}no job 'no-such-job' on {job.redis_url}: "
                                 "elastic-console ls lists the jobs")
    for sub in ("logs", "events", "restart", "stop"):
        p = console(sub, "no-such-job", "--yes" if sub in ("restart", "stop") else "--json"
                    if sub == "events" else "--follow", redis_url=job.redis_url)
        assert p.returncode == 1 and "no job 'no-such-job'" in one_error_line(p)
    p = console("status", "bad{id}", redis_url=job.redis_url)
    assert p.returncode == 2 and "invalid job id" in one_error_line(p)
    p = console("logs", job.id, "--grep", "(unclosed", redis_url=job.redis_url)
    assert p.returncode == 2 and "bad --grep pattern" in one_error_line(p)
    p = console("ls", "--redis", "redis://someone:s3cret@127.0.0.1:1")
    assert p.returncode == 1
    line = one_error_line(p)
    assert "cannot reach Redis at redis://someone:***@127.0.0.1:1" in line and "s3cret" not in line
    p = console("status", redis_url=job.redis_url)
    assert p.returncode == 2 and "required: JOB" in one_error_line(p)
    p = console("logs", job.id, "--tail", "-3", redis_url=job.redis_url)
    assert p.returncode == 2 and "--tail" in one_error_line(p)
    p = console("frobnicate", redis_url=job.redis_url)
    assert p.returncode == 2 and "invalid choice" in one_error_line(p)
    p = console("--redis", "ftp://x", "ls")
    assert p.returncode == 2 and "invalid Redis endpoint" in one_error_line(p)
    # attach: the app may or may not exist yet; either way a bad job is one line.
    p = console("attach", "no-such-job", redis_url=job.redis_url)
    assert p.returncode in (1, 2)
    one_error_line(p)


def test_stop_without_yes_and_without_a_tty_is_refused(job: Job):
    p = console("stop", job.id, redis_url=job.redis_url)  # stdin is /dev/null
    assert p.returncode == 2
    assert "--yes" in one_error_line(p)
    assert job.agent.proc.poll() is None


def test_restart_then_stop_with_yes(job: Job):
    r = make_client(job.redis_url)
    try:
        p = console("restart", job.id, "--yes", redis_url=job.redis_url)
        assert p.returncode == 0, p.stdout + p.stderr
        out = p.stdout.splitlines()
        assert out[0].startswith("restart command c-") and "waiting for 1 agent" in out[0]
        assert out[1].strip().startswith("accepted by ")
        assert out[-1] == "all 1 agent accepted the restart command"
        wait_until(lambda: len(events_of(r, job.id, EventType.WORKERS_STARTED)) == 2, 30,
                   "the workers to start again")
        status = json.loads(console("status", job.id, "--json", redis_url=job.redis_url).stdout)
        assert [x["restarts"] for x in status["ranks"]] == [1, 1]
        assert status["restarts_used"] == 0, "a restart command spends no restart"

        p = console("stop", job.id, "-y", "--timeout", "20", redis_url=job.redis_url)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "accepted by " in p.stdout and p.stdout.endswith(
            "all 1 agent accepted the stop command\n")
        assert job.agent.wait(30) == 143
        status = json.loads(console("status", job.id, "--json", redis_url=job.redis_url).stdout)
        assert status["state"] == "stopped"
        assert {x["state"] for x in status["ranks"]} == {"stopped"}
        p = console("stop", job.id, "--yes", redis_url=job.redis_url)
        assert p.returncode == 1 and "has already stopped" in one_error_line(p)
    finally:
        r.close()


def test_hostile_output_is_escaped_and_a_failure_shows_its_root_cause(redis_url, r, job_id,
                                                                       tmp_path: Path):
    agent = Agent(["--redis", redis_url, "--job-id", job_id, "--local-addr", "127.0.0.1",
                   "--nproc-per-node", "2", "--max-restarts", "0", str(SCRIPTS / "sleeper.py"),
                   "--fail-rank", "1", "--fail-after", "0.1"], tmp_path, "failing")
    assert agent.wait(60) == 1, agent.output[-2000:]
    p = console("status", job_id, redis_url=redis_url)
    assert p.returncode == 0, p.stderr
    assert f"{job_id}: failed" in p.stdout
    assert "root cause: rank 1 on " in p.stdout and "exit code 3" in p.stdout
    p = console("logs", job_id, "--stderr", redis_url=redis_url)
    assert p.stdout.splitlines() == ["[rank 1] rank 1 failing on purpose"]

    job2 = f"{job_id}-hostile"
    agent = Agent(["--redis", redis_url, "--job-id", job2, "--local-addr", "127.0.0.1",
                   "--nproc-per-node", "1", str(SCRIPTS / "hostile_output.py")], tmp_path, "h")
    assert agent.wait(60) == 0, agent.output[-2000:]
    p = console("logs", job2, redis_url=redis_url)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "\x1b" not in out and "\x07" not in out  # not a TTY: even colours are stripped
    # The title is data (escaped) unless its read also erased the screen: then the agent
    # rendered it (records/screen.py) and removed the sequence.
    assert "[rank 0] \\x1b]0;pwned\\x07title" in out or "[rank 0] title\n" in out
    assert "[rank 0] clear red [bold]markup[/bold]" in out  # the erase rendered, not shown
    assert "[rank 0] after the big line" in out
    p = console("logs", job2, "--grep", r"^title\b", redis_url=redis_url)
    assert p.stdout in ("", "[rank 0] title\n")  # an escaped OSC is part of the visible text
