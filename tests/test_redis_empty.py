"""Redis comes back empty mid-job (a restart without persistence): the agents put back what
readers need, the restart budget does not start over, and no worker is restarted by it."""

from __future__ import annotations

import json
import sys
import time
import types

import pytest

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire.command_records import Command, CommandType, encode_command
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JOBS_INDEX, JobKeys
from elastic_agent.supervision.records.job_records import ReseedSchedule
from tests.agents import SCRIPTS, Agent, alive, wait_until
from tests.test_agent import FAST, agent_args, events, log_lines, of_type
from tests.test_console_cli import console as _console

CONSOLE = [sys.executable, "-m", "elastic_console.cli"]




@pytest.mark.parametrize("how", ["restart", "flushall"])
def test_redis_back_empty_restores_the_job_without_touching_the_workers(
        private_redis, tmp_path, how):
    url = private_redis.url
    job = f"empty-{how}"
    keys = JobKeys(job)
    r = make_client(url)
    # Rank 1 fails once on the first attempt: one restart is spent before Redis is lost.
    agent = Agent(agent_args(url, job, "--nproc-per-node", "2", "--max-restarts", "3", FAST,
                             str(SCRIPTS / "sleeper.py"), "--fail-rank", "1",
                             "--fail-after", "0.3"), tmp_path, "a")
    try:
        wait_until(lambda: len(of_type(r, job, EventType.WORKERS_STARTED)) == 2, 60,
                   "the restart after the injected failure")
        pids = of_type(r, job, EventType.WORKERS_STARTED)[-1].data["pids"]
        assert r.get(keys.restarts) == b"1"
        stream = next(iter(r.smembers(keys.log_streams))).decode()

        lost_at = time.monotonic()
        if how == "restart":
            private_redis.stop()  # no RDB, no AOF: it comes back with nothing
            private_redis.start()
            r = make_client(url)
        else:
            r.flushall()
        assert r.dbsize() < 20  # nearly empty (the agents may already be writing again)

        def restored() -> bool:
            return (r.zscore(JOBS_INDEX, job) is not None and r.hget(keys.meta, "max_restarts") == b"3"
                    and r.get(keys.restarts) == b"1" and r.sismember(keys.log_streams, stream)
                    and r.hget(keys.rdzv_state, "status") == b"complete"
                    and r.get(keys.rdzv_round_info) is not None)

        wait_until(restored, 20, "the job's records put back")
        print(f"[{how}] records back {time.monotonic() - lost_at:.2f} s after Redis was emptied "
              "(keep-alive interval 0.3 s)")
        again = wait_until(lambda: of_type(r, job, EventType.WORKERS_STARTED), 10,
                           "the workers announced again")
        assert again[-1].data["pids"] == pids and again[-1].data.get("restored") is True
        assert alive(pids) == pids, "no worker is restarted by an empty Redis"

        # Readers see the job and its new output.
        ls = _console("ls", "--redis", url).stdout
        assert any(job in line and "running" in line for line in ls.splitlines()), ls
        status = json.loads(_console("status", job, "--json", "--redis", url).stdout)
        assert status["state"] == "running" and status["world_size"] == 2, status
        assert status["restarts_used"] == 1
        assert {x["pid"] for x in status["ranks"]} == set(pids), (
            status["ranks"], [(e.type, e.data) for e in events(r, job)][-10:])
        assert all(x["restarts"] == 0 for x in status["ranks"]), status["ranks"]
        wait_until(lambda: any(line.startswith("tick") for _, _, line in log_lines(r, job)), 10,
                   "new log lines")
        logs = _console("logs", job, "--tail", "5", "--redis", url).stdout
        assert "tick" in logs, logs

        # The budget goes on from 1, not from 0; commands still work.
        r.xadd(keys.commands, encode_command(Command("kill-0", CommandType.SIGNAL, "tester",
                                                     args={"rank": 0, "signal": "SIGKILL"})))
        wait_until(lambda: r.get(keys.restarts) == b"2", 30, "the next restart counted as the 2nd")
        r.xadd(keys.commands, encode_command(Command("stop-1", CommandType.STOP, "tester")))
        assert agent.wait(60) == 143, agent.output[-3000:]
        assert "Traceback" not in agent.output
    finally:
        if agent.proc.poll() is None:
            agent.kill()
            agent.wait(10)


def test_an_attached_console_does_not_count_the_announcement_again_as_a_restart():
    from elastic_agent.coordination.wire.event_records import Event
    from elastic_console.job.state import JobView

    view = JobView("j", scrollback=10)
    started = {"round": 1, "attempt": 1, "restart_count": 1, "ranks": [0, 1],
               "local_ranks": [0, 1], "pids": [11, 12], "host": "h"}
    view.apply_event(Event(EventType.WORKERS_STARTED, "n1", dict(started), "1-0", seq=1))
    view.apply_event(Event(EventType.WORKERS_STARTED, "n1", {**started, "restored": True},
                           "2-0", seq=2))
    assert [view.ranks[r].restarts for r in (0, 1)] == [0, 0]
    view.apply_event(Event(EventType.WORKERS_STARTED, "n1", {**started, "pids": [21, 22]},
                           "3-0", seq=3))
    assert [view.ranks[r].restarts for r in (0, 1)] == [1, 1]


def test_a_job_whose_agents_all_died_shows_lost(redis_url, r, job_id, tmp_path):
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "1", FAST,
                             str(SCRIPTS / "sleeper.py")), tmp_path, "a")
    wait_until(lambda: of_type(r, job_id, EventType.WORKERS_STARTED), 30, "the worker")
    status = json.loads(_console("status", job_id, "--json", "--redis", redis_url).stdout)
    assert status["state"] == "running"
    agent.kill()  # SIGKILL: no goodbye, the heartbeats just stop
    agent.wait(10)
    # FAST: a 2 s heartbeat timeout.
    wait_until(lambda: json.loads(_console("status", job_id, "--json", "--redis", redis_url)
                                  .stdout)["state"] == "lost", 30, "the job shown lost")
    human = _console("status", job_id, "--redis", redis_url).stdout
    assert f"job       {job_id}: lost" in human and "no agent has sent a heartbeat for" in human
    row = next(line for line in _console("ls", "--redis", redis_url).stdout.splitlines()
               if line.startswith(job_id))
    assert " lost " in row and " ago" in row, row
    listed = json.loads(_console("ls", "--json", "--redis", redis_url).stdout)
    mine = next(j for j in listed if j["job"] == job_id)
    assert mine["state"] == "lost" and mine["lost_for_s"] >= 2


def test_the_console_shows_a_job_whose_agents_died_as_lost(redis_url, r, job_id, tmp_path):
    import asyncio

    from elastic_agent.coordination.transport.endpoints import parse_endpoint
    from elastic_console.tui.app import ConsoleApp

    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "1", FAST,
                             str(SCRIPTS / "sleeper.py")), tmp_path, "a")
    wait_until(lambda: of_type(r, job_id, EventType.WORKERS_STARTED), 30, "the worker")

    async def run() -> None:
        app = ConsoleApp(job_id, endpoint=parse_endpoint(redis_url))
        async with app.run_test(size=(160, 48)) as pilot:
            async def until(cond, what: str, seconds: float = 30,
                            explain=lambda: "") -> None:
                for _ in range(int(seconds / 0.05)):
                    if cond():
                        return
                    await pilot.pause(0.05)
                raise AssertionError(f"timed out waiting for {what} {explain()}")

            await until(lambda: app.loaded and app.view.state == "running", "running")
            agent.kill()
            await asyncio.to_thread(agent.wait, 10)
            await until(lambda: app.view.state == "lost", "the lost state",
                        explain=lambda: f"(the job reads as {app.view.state!r})")
            await until(lambda: " LOST " in (app.header._shown or ""), "LOST in the header")

    asyncio.run(run())


def test_reseed_schedule_reseeds_after_a_restoration_at_once_else_every_few_intervals():
    """A node's records script runs at its first pass, at once after its beat restored the
    rendezvous, every RESEED_EVERY passes otherwise, and again until one went through."""
    rdzv = types.SimpleNamespace(restorations=0)
    schedule = ReseedSchedule(rdzv, every=5)

    def passes(k: int, succeed: bool = True) -> list[bool]:
        out = []
        for _ in range(k):
            due = schedule.due()
            out.append(due)
            if due and succeed:
                schedule.done()
        return out

    assert passes(7) == [True, False, False, False, False, True, False]
    rdzv.restorations += 1  # a beat found Redis empty and put the round back
    assert schedule.restored()
    assert passes(2) == [True, False]
    assert not schedule.restored()
    assert passes(6, succeed=False) == [False, False, False, True, True, True]  # owed until done
    assert passes(2) == [True, False]
