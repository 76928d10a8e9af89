"""An agent's death takes its whole tree: real agents, real process trees, a real redis-server.

Every worker (tests/scripts/tree_spawner.py) leaves a grandchild in its own session, one in a
session of its own and a double-forked daemon that ignores SIGTERM and has nothing of the job
in its environment. A SIGKILLed agent must leave none of them (nor any other process it
started) alive 5 s later; a stopped agent none at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest
import redis

from elastic_agent.coordination.wire.command_records import Command, encode_command
from elastic_agent.coordination.wire.event_records import EventType, decode_event
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.supervision.launch.exits import WorkerState
from elastic_agent.supervision.launch.worker_env import RankAssignment, WorkerSpec
from elastic_agent.supervision.launch.workers import WorkerGroup
from elastic_agent.supervision.records.logs import NodeLogs
from tests.agents import SCRIPTS, Agent, wait_until

NPROC = 2
#: The promise: nothing of a job outlives its agent by more than this after a SIGKILL.
DEATH_BUDGET = 5.0


def agent_args(redis_url: str, job: str, *extra: str) -> list[str]:
    return ["--redis", redis_url, "--job-id", job, "--local-addr", "127.0.0.1", *extra]


def worker_exits(r: redis.Redis, job: str) -> list:
    events = (decode_event(i, f) for i, f in r.xrange(JobKeys(job).events))
    return [e for e in events if e is not None and e.type == EventType.WORKER_EXITED]


def start_tree(redis_url: str, job_id: str, tmp_path: Path, *extra: str) -> tuple[
        Agent, dict[int, dict[str, int]], list[psutil.Process]]:
    """An agent whose workers have built their trees: the agent, each rank's reported pids,
    and every process below the agent (as psutil handles, so a reused pid is not mistaken
    for a survivor)."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    args = agent_args(redis_url, job_id, "--nproc-per-node", str(NPROC), *extra,
                      str(SCRIPTS / "tree_spawner.py"), "--pid-dir", str(pid_dir))
    agent = Agent(args, tmp_path, "a")
    try:
        wait_until(lambda: len(list(pid_dir.glob("*.json"))) == NPROC, 60,
                   "every worker's tree")
        reported = {int(f.stem): json.loads(f.read_text()) for f in pid_dir.glob("*.json")}
        procs = {p.pid: p for p in agent.descendants()}
        for pids in reported.values():
            for pid in pids.values():
                procs.setdefault(pid, psutil.Process(pid))
    except BaseException:
        agent.kill()
        raise
    return agent, reported, list(procs.values())


def survivors(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            # A zombie has ended; only its parent's wait is missing.
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def describe(procs: list[psutil.Process]) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {p.cmdline()} sid={os.getsid(p.pid)} ppid={p.ppid()}")
        except (psutil.Error, OSError):
            out.append(f"{p.pid} (gone)")
    return "; ".join(out)


def kill_all(procs: list[psutil.Process]) -> None:
    """Clean-up for a failed test: nothing of it may outlive the test."""
    for p in survivors(procs):
        with contextlib.suppress(psutil.Error):
            p.kill()


def check_tree(reported: dict[int, dict[str, int]], procs: list[psutil.Process]) -> None:
    """The trees are what the test is about: grandchildren in and out of the worker's session."""
    assert sorted(reported) == list(range(NPROC))
    for pids in reported.values():
        worker_sid = os.getsid(pids["worker"])
        assert os.getsid(pids["child"]) == worker_sid
        assert os.getsid(pids["session"]) == pids["session"] != worker_sid
        assert os.getsid(pids["daemon"]) not in (worker_sid, pids["session"])
        assert "TORCHELASTIC_ERROR_FILE" not in psutil.Process(pids["daemon"]).environ()
    assert survivors(procs) == procs, "part of the tree is already gone"


def test_sigkilled_agent_takes_its_whole_tree(redis_url, job_id, tmp_path, capsys):
    agent, reported, procs = start_tree(redis_url, job_id, tmp_path)
    try:
        check_tree(reported, procs)
        os.kill(agent.pid, signal.SIGKILL)  # no goodbye: only the kernel knows it died
        t0 = time.monotonic()
        assert agent.wait(10) == -signal.SIGKILL
        deadline = t0 + DEATH_BUDGET
        while survivors(procs) and time.monotonic() < deadline:
            time.sleep(0.002)  # by hand, not wait_until: a tight poll, the time is measured
        elapsed = time.monotonic() - t0
        left = survivors(procs)
        assert left == [], (f"{len(left)} of {len(procs)} processes outlived their SIGKILLed "
                            f"agent by {DEATH_BUDGET} s: {describe(left)}")
        with capsys.disabled():
            print(f"\n{len(procs)} processes of a SIGKILLed agent's tree gone in "
                  f"{elapsed * 1000:.0f} ms")
    finally:
        kill_all(procs)
        agent.kill()


def test_stop_command_still_ends_every_tree(redis_url, r: redis.Redis, job_id, tmp_path):
    agent, reported, procs = start_tree(redis_url, job_id, tmp_path, "--shutdown-timeout", "1")
    try:
        check_tree(reported, procs)
        r.xadd(JobKeys(job_id).commands,
               encode_command(Command("stop-1", "stop", "tester@host", args={})))
        assert agent.wait(30) == 143, agent.output[-3000:]
        # The agent returns only once every tree is gone: nothing to wait for here.
        assert survivors(procs) == [], describe(survivors(procs))
        exited = worker_exits(r, job_id)
        assert sorted(e.data["rank"] for e in exited) == list(range(NPROC))
        assert all(e.data["stopping"] and e.data["signal"] == "SIGTERM" for e in exited), exited
    finally:
        kill_all(procs)
        agent.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signalled_agent_still_ends_every_tree(redis_url, job_id, tmp_path, sig):
    agent, reported, procs = start_tree(redis_url, job_id, tmp_path, "--shutdown-timeout", "1")
    try:
        check_tree(reported, procs)
        os.kill(agent.pid, sig)
        assert agent.wait(30) == 128 + sig, agent.output[-3000:]
        assert survivors(procs) == [], describe(survivors(procs))
    finally:
        kill_all(procs)
        agent.kill()


# -- the keeper itself, in-process ---------------------------------------------------------

def group_of(tmp_path: Path, argv: list[str], nproc: int = 1) -> WorkerGroup:
    spec = WorkerSpec(nproc=nproc, entrypoint=argv, run_id="r", job_id="j", log_dir=tmp_path,
                      shutdown_timeout=1.0)
    return WorkerGroup(spec, logs=NodeLogs(stdout=io.BytesIO(), stderr=io.BytesIO()))


def placement(nproc: int = 1) -> RankAssignment:
    return RankAssignment(group_rank=0, group_world_size=1, world_size=nproc, base_rank=0,
                          master_addr="127.0.0.1", master_port=29500)


def sig_mask(status: str, field: str) -> set[int]:
    line = next(x for x in status.splitlines() if x.startswith(field + ":"))
    mask = int(line.split()[1], 16)
    return {n for n in range(1, 65) if mask & (1 << (n - 1))}


@pytest.mark.asyncio
async def test_workers_inherit_the_agents_signal_dispositions(tmp_path: Path) -> None:
    """As if the agent ran under nohup: its ignored SIGHUP reaches the workers, as it did when
    the agent spawned them itself; the keeper's own ignores and handlers do not."""
    group = group_of(tmp_path, ["sh", "-c", "exec cat /proc/self/status"])
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        await group.start(placement())
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert (await asyncio.wait_for(group.wait(), 10)).state is WorkerState.SUCCEEDED
    await group.stop()
    status = (tmp_path / "attempt_0" / "0" / "stdout.log").read_text()
    ignored = sig_mask(status, "SigIgn")
    # What the agent ignores reaches the workers (make, for one, runs us with 32 and 33
    # ignored); what the keeper ignores for itself, and Python's own SIGPIPE, do not.
    assert signal.SIGHUP in ignored
    assert not ignored & {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGPIPE}, ignored
    assert sig_mask(status, "SigBlk") == set()


@pytest.mark.asyncio
async def test_a_sigkilled_keeper_takes_its_workers_and_fails_the_group(tmp_path: Path) -> None:
    group = group_of(tmp_path, ["sleep", "600"], nproc=2)
    infos = await group.start(placement(2))
    keeper = psutil.Process(infos[0].pid).parent()
    assert keeper is not None and "keeper.py" in " ".join(keeper.cmdline())
    assert {psutil.Process(w.pid).ppid() for w in infos} == {keeper.pid}
    keeper.kill()
    result = await asyncio.wait_for(group.wait(), 10)
    assert result.state is WorkerState.FAILED
    assert {f.signal for f in result.failures} == {"SIGKILL"}
    await asyncio.wait_for(group.stop(), 10)
    assert survivors([psutil.Process(w.pid) for w in infos if psutil.pid_exists(w.pid)]) == []
