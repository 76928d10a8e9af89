"""Partitions and outages: three hosts as network namespaces on one bridge, one real agent
each, Redis in the root namespace on the bridge's address (tests/netns.py).

* One host's cable is pulled mid-job. The survivors re-form without it within the heartbeat
  timeout and spend no restart. The cut-off host cannot learn anything from Redis meanwhile:
  it freezes its workers (SIGSTOP) when its own heartbeats have not got through for nearly
  the heartbeat timeout (agent/supervision/fence.py), before anyone may take their ranks;
  when its cable is back it reads that a newer round runs without it, kills the frozen
  workers and rejoins. At no moment do two workers hold one global rank.
* Redis is unreachable for every host for twice the heartbeat timeout (the bridge down, or
  redis-server killed and started again from its AOF): when it is back nobody is called
  lost, no restart is spent, and the same workers go on in the same round (frozen meanwhile).

Workers append the time to a file of their own every 50 ms (round, rank and pid in its
name), so when each one ran is known without Redis, which a cut-off host cannot reach.

The re-form time after a partition prints with
``pytest tests/test_partition.py -k cut_off -s``.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import redis

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.supervision.hosting.standalone import RedisServer
from tests.agents import Agent, alive, wait_until
from tests.netns import Hosts
from tests.test_agent import agent_args, of_type

HEARTBEAT_TIMEOUT = 3.0
KEEP_ALIVE = 0.3
CONF = (f"--rdzv-conf=last_call_timeout=2,heartbeat_timeout={HEARTBEAT_TIMEOUT},"
        f"keep_alive_interval={KEEP_ALIVE},join_timeout=60")
NPROC = 2
#: Beyond the heartbeat timeout, for noticing the loss, stopping the survivors' workers,
#: the rendezvous and the new workers' start (two shared cores: generous).
REFORM_SLACK = 7.0
#: Long, so that a cut-off host that stopped its frozen workers with SIGTERM (pending while
#: they are stopped) instead of SIGKILL would come back visibly late.
SHUTDOWN_TIMEOUT = 30
#: From the cable back to the cut-off host in a round again: its Redis calls hang on dead
#: connections until TCP retransmits (backed off) or the 10 s socket timeout.
REJOIN_BOUND = 20.0

WORKER = """\
import os, re, sys, time
from pathlib import Path

out = Path(sys.argv[1])
# The round names the attempt directory (job-wide, see elastic_agent._start).
rnd = re.search(r"attempt_(\\d+)", os.environ["TORCHELASTIC_ERROR_FILE"]).group(1)
name = f"round{rnd}-rank{os.environ['RANK']}-pid{os.getpid()}.ticks"
with open(out / name, "a", buffering=1) as f:
    while not (out / "done").exists():
        f.write(f"{time.time():.3f}\\n")
        time.sleep(0.05)
"""

_TICKS = re.compile(r"round(\d+)-rank(\d+)-pid(\d+)\.ticks")


@dataclass(frozen=True)
class Run:
    """One worker process as its own file tells it: when it ticked first and last."""

    round: int
    rank: int
    pid: int
    first: float
    last: float


def runs(ticks: Path) -> list[Run]:
    out = []
    for f in ticks.glob("*.ticks"):
        m = _TICKS.fullmatch(f.name)
        times = [float(x) for x in f.read_text().split("\n")[:-1] if x]  # last may be partial
        if m and times:
            out.append(Run(int(m[1]), int(m[2]), int(m[3]), times[0], times[-1]))
    return out


def overlaps(all_runs: list[Run]) -> list[tuple[Run, Run]]:
    """Pairs of worker processes that held the same global rank at the same time."""
    found = []
    by_rank: dict[int, list[Run]] = {}
    for x in all_runs:
        by_rank.setdefault(x.rank, []).append(x)
    for group in by_rank.values():
        group.sort(key=lambda x: x.first)
        for i, a in enumerate(group):
            found += [(a, b) for b in group[i + 1:] if b.first <= a.last]
    return found


def test_overlaps_finds_one_rank_held_twice():
    a = Run(0, 0, 10, 1.0, 5.0)
    assert overlaps([a, Run(1, 0, 11, 4.0, 9.0), Run(1, 1, 12, 4.0, 9.0)]) == [
        (a, Run(1, 0, 11, 4.0, 9.0))]
    assert overlaps([a, Run(1, 0, 11, 5.5, 9.0)]) == []


def ticking(ticks: Path, rnd: int, ranks: set[int], since: float = 0.0) -> bool:
    """Every one of ``ranks`` has a worker of round ``rnd`` that ticked after ``since``."""
    return ranks <= {x.rank for x in runs(ticks) if x.round == rnd and x.last > since}


def agent_pid(node: str) -> int:
    return int(node.rsplit("-", 2)[1])  # node ids are host-pid-random


@dataclass
class Job:
    hosts: Hosts
    redis: redis.Redis
    job_id: str
    agents: list[Agent]
    ticks: Path

    def host_of(self, node: str) -> int:
        return next(i for i, a in enumerate(self.agents) if a.pid == agent_pid(node))

    def round_running(self, size: int, after: int = -1) -> tuple[int, list[str]] | None:
        """The latest round newer than ``after``, if it has ``size`` nodes and every one of
        its workers has ticked: (round, its nodes by group rank)."""
        rounds = of_type(self.redis, self.job_id, EventType.RENDEZVOUS_COMPLETE)
        if not rounds or rounds[-1].data["round"] <= after:
            return None
        ev = rounds[-1]
        rnd = ev.data["round"]
        if ev.data["group_world_size"] != size:
            return None
        nodes = [n["node"] for n in sorted(ev.data["nodes"], key=lambda n: n["group_rank"])]
        started = {e.node for e in of_type(self.redis, self.job_id, EventType.WORKERS_STARTED)
                   if e.data["round"] == rnd}
        if set(nodes) <= started and ticking(self.ticks, rnd, set(range(size * NPROC))):
            return rnd, nodes
        return None

    def worker_pids(self, rnd: int, node: str | None = None) -> list[int]:
        return [p for e in of_type(self.redis, self.job_id, EventType.WORKERS_STARTED)
                if e.data["round"] == rnd and node in (None, e.node) for p in e.data["pids"]]

    def dump(self) -> str:
        return "\n".join(f"--- host {i} ---\n{a.output[-4000:]}" for i, a in enumerate(self.agents))


@contextlib.contextmanager
def job_on(hosts: Hosts, job_id: str, tmp_path: Path, *redis_args: str) -> Iterator[
        tuple[Job, RedisServer]]:
    """Redis on the bridge and one agent per host; everything ends with the block."""
    with RedisServer(host=hosts.bridge_addr, extra_args=list(redis_args)) as srv:
        job = start_job(hosts, srv, job_id, tmp_path)
        try:
            yield job, srv
        finally:
            stop_all(job)


def start_job(hosts: Hosts, srv: RedisServer, job_id: str, tmp_path: Path) -> Job:
    ticks = tmp_path / "ticks"
    ticks.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    agents = []
    for i in range(hosts.n):
        args = agent_args(srv.url, job_id, "--nnodes", f"2:{hosts.n}", "--nproc-per-node",
                          str(NPROC), "--max-restarts", "3", "--shutdown-timeout",
                          str(SHUTDOWN_TIMEOUT), CONF, "--log-dir", str(tmp_path / f"logs{i}"),
                          str(script), str(ticks))
        args[args.index("--local-addr") + 1] = hosts.addrs[i]
        agents.append(Agent(args, tmp_path, f"host{i}", prefix=hosts.prefix(i)))
    return Job(hosts, make_client(srv.url), job_id, agents, ticks)


def finish(job: Job) -> list[int]:
    """Let the workers end; the exit codes of the agents."""
    (job.ticks / "done").touch()
    return [a.wait(60) for a in job.agents]


def stop_all(job: Job) -> None:
    for a in job.agents:
        if a.proc.poll() is None:
            a.kill()
            a.wait(30)
    job.redis.close()


def frozen(pids: list[int]) -> bool:
    try:
        return all(psutil.Process(p).status() == psutil.STATUS_STOPPED for p in pids)
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def hosts():
    with Hosts(3) as h:
        yield h


def test_a_cut_off_host_is_dropped_without_a_restart_and_rejoins(hosts, job_id, tmp_path):
    keys = JobKeys(job_id)
    with job_on(hosts, job_id, tmp_path) as (job, _):
        r0, nodes = wait_until(lambda: job.round_running(3), 60, "a round of all three hosts")
        # The host of group rank 0: the survivors' round hands its global ranks (0..NPROC-1)
        # to others and moves the master, so this is where overlap would happen.
        victim = job.host_of(nodes[0])
        survivors = {i for i in range(3) if i != victim}
        stale = job.worker_pids(r0, nodes[0])
        time.sleep(0.5)  # a moment of the whole job ticking; nothing to wait on
        cut_at = time.time()
        hosts.cut(victim)

        r1, nodes1 = wait_until(lambda: job.round_running(2, after=r0),
                                HEARTBEAT_TIMEOUT + REFORM_SLACK + 20, "the survivors' round")
        reform = max(x.first for x in runs(job.ticks) if x.round == r1) - cut_at
        print(f"\nre-formed without the cut-off host: cable pulled -> every survivor's new "
              f"worker ticking in {reform:.2f} s (heartbeat timeout {HEARTBEAT_TIMEOUT:g} s, "
              f"keep-alive {KEEP_ALIVE:g} s)")
        assert {job.host_of(n) for n in nodes1} == survivors, job.dump()
        assert reform < HEARTBEAT_TIMEOUT + REFORM_SLACK, job.dump()
        assert job.redis.get(keys.restarts) in (None, b"0"), "a partition must not spend a restart"
        lost = of_type(job.redis, job_id, EventType.NODE_LOST)
        assert [agent_pid(e.data["lost_node"]) for e in lost] == [job.agents[victim].pid]
        # Cut off, the host has kept its workers, frozen.
        assert frozen(stale), (stale, job.dump())

        time.sleep(1.0)  # the partition goes on a moment with the survivors running
        healed_at = time.time()
        hosts.heal(victim)
        wait_until(lambda: not alive(stale), REJOIN_BOUND, "the frozen workers ended")
        learnt = time.time() - healed_at
        _, nodes2 = wait_until(lambda: job.round_running(3, after=r1), REJOIN_BOUND,
                               "the cut-off host back in a round of three")
        print(f"cable back -> the cut-off host's frozen workers killed in {learnt:.2f} s, a "
              f"round of three again in {time.time() - healed_at:.2f} s")
        assert {job.host_of(n) for n in nodes2} == {0, 1, 2}
        exits = [e for e in of_type(job.redis, job_id, EventType.WORKER_EXITED)
                 if e.data["pid"] in stale]
        assert [(e.data["signal"], e.data["stopping"]) for e in exits] == [
            ("SIGKILL", True)] * NPROC, [e.data for e in exits]

        assert finish(job) == [0, 0, 0], job.dump()
        assert job.redis.get(keys.restarts) in (None, b"0"), "a partition must not spend a restart"
        reasons = [e.data["reason"] for e in of_type(job.redis, job_id, EventType.RESTARTING)]
        assert reasons and set(reasons) == {"membership"}, reasons
        clash = overlaps(runs(job.ticks))
        assert not clash, f"two workers held one rank at once: {clash}\n{job.dump()}"


@pytest.mark.parametrize("how", ["network", "redis-restart"])
def test_redis_unreachable_longer_than_the_heartbeat_timeout_loses_nobody(
        hosts, job_id, tmp_path, how):
    keys = JobKeys(job_id)
    with job_on(hosts, job_id, tmp_path, "--appendonly", "yes", "--appendfsync", "always") as (
            job, srv):
        r0, _ = wait_until(lambda: job.round_running(3), 60, "a round of all three hosts")
        pids = job.worker_pids(r0)
        time.sleep(0.5)  # a moment of the job running before the outage; nothing to wait on
        down_at = time.time()
        if how == "network":
            hosts.cut_all()  # every host's packets dropped: calls hang, then time out
        else:
            srv.kill()  # connections refused
        time.sleep(HEARTBEAT_TIMEOUT * 2)  # the outage itself: nothing to wait on
        assert frozen(pids), "cut off for longer than the heartbeat timeout: frozen"
        if how == "network":
            hosts.heal_all()
        else:
            srv.start()
        up_at = time.time()
        wait_until(lambda: ticking(job.ticks, r0, set(range(3 * NPROC)), since=up_at), 60,
                   "every worker thawed", explain=job.dump)
        thawed = time.time() - up_at
        # Long enough for every agent to be back and to have judged the membership again.
        wait_until(lambda: ticking(job.ticks, r0, set(range(3 * NPROC)),
                                   since=up_at + 2 * HEARTBEAT_TIMEOUT), 60,
                   "the round going on after the outage")
        print(f"\n{how}: Redis unreachable {up_at - down_at:.1f} s; every worker ticking again "
              f"{thawed:.2f} s after; round {r0} went on, nobody lost")
        assert not of_type(job.redis, job_id, EventType.NODE_LOST), job.dump()
        assert not of_type(job.redis, job_id, EventType.RESTARTING), job.dump()
        assert job.redis.get(keys.restarts) in (None, b"0")
        assert {x.pid for x in runs(job.ticks)} == set(pids), "the same workers, no other"
        assert {x.round for x in runs(job.ticks)} == {r0}
        assert finish(job) == [0, 0, 0], job.dump()
