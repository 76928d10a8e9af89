"""Issue 21: an agent holds at most two Redis connections, whatever it is doing.

Counted from the outside: the agent process's established TCP connections to the Redis port
(psutil), sampled every 20 ms from its start to its exit, and named by ``CLIENT LIST``.
"""

from __future__ import annotations

import re
import socket
import threading
from collections import defaultdict
from urllib.parse import urlsplit

import psutil
import redis

from elastic_agent.coordination.protocol import Command, EventType, JobKeys, encode_command
from tests.agents import SCRIPTS, Agent, wait_until
from tests.test_agent import FAST, agent_args, of_type, worker_pids

MAX_CONNECTIONS = 2


def redis_sockets(pid: int, port: int) -> list[psutil._common.pconn]:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return []
    return [c for c in conns if c.raddr and c.raddr.port == port
            and c.status == psutil.CONN_ESTABLISHED]


class Sampler:
    """Counts each agent's Redis connections every 20 ms, per phase of the test."""

    def __init__(self, pids: list[int], port: int) -> None:
        self.pids, self.port = pids, port
        self.phase = "start"
        self.most: dict[tuple[str, int], int] = defaultdict(int)
        self.samples: dict[str, int] = defaultdict(int)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            phase = self.phase
            for pid in self.pids:
                n = len(redis_sockets(pid, self.port))
                self.most[phase, pid] = max(self.most[phase, pid], n)
            self.samples[phase] += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def named_clients(r: redis.Redis, pid: int, port: int) -> list[str]:
    """The CLIENT LIST names of the connections ``pid`` holds."""
    mine = {f"{c.laddr.ip}:{c.laddr.port}" for c in redis_sockets(pid, port)}
    return sorted(c["name"] for c in r.client_list() if c["addr"] in mine)


def test_an_agent_holds_two_connections_through_rendezvous_run_stacks_and_restart(
        redis_url, r, job_id, tmp_path):
    port = urlsplit(redis_url).port
    keys = JobKeys(job_id)
    args = agent_args(redis_url, job_id, "--nnodes", "2", "--nproc-per-node", "2",
                      "--max-restarts", "3", FAST, str(SCRIPTS / "sleeper.py"))
    first = Agent(args, tmp_path, "a")
    sampler = Sampler([first.pid], port)
    second = None
    try:
        sampler.phase = "rendezvous"
        # Alone in a round of two: it waits in the rendezvous (notify and joins streams).
        wait_until(lambda: "waiting for 1 more" in first.output, 30, "the first agent waiting")
        wait_until(lambda: sampler.samples["rendezvous"] >= 25, 10, "samples while waiting")
        second = Agent(args, tmp_path, "b")
        sampler.pids.append(second.pid)
        wait_until(lambda: len(worker_pids(r, job_id)) == 4, 60, "four workers")

        sampler.phase = "running"
        wait_until(lambda: sampler.samples["running"] >= 25, 10, "samples while running")
        for agent in (first, second):
            held = sampler.most["running", agent.pid]
            assert held <= MAX_CONNECTIONS, f"agent {agent.pid} held {held} Redis connections"
            names = named_clients(r, agent.pid, port)
            assert names == [f"elastic-agent:{_host()}:{agent.pid}:reader",
                             f"elastic-agent:{_host()}:{agent.pid}:writer"], names

        def send(cmd_id: str, kind: str) -> None:
            r.xadd(keys.commands, encode_command(Command(cmd_id, kind, "tester@host")))

        def acks(cmd_id: str, status: str) -> int:
            return sum(1 for e in of_type(r, job_id, EventType.COMMAND_ACK)
                       if e.data["command_id"] == cmd_id and e.data["status"] == status)

        sampler.phase = "stacks"
        send("stacks-1", "stacks")
        wait_until(lambda: acks("stacks-1", "done") == 2, 30, "both agents' stacks")

        sampler.phase = "restart"
        send("restart-1", "restart")
        wait_until(lambda: len(of_type(r, job_id, EventType.WORKERS_STARTED)) == 4, 60,
                   "both agents' workers started again")

        sampler.phase = "stop"
        send("stop-1", "stop")
        assert first.wait(60) == 143 and second.wait(60) == 143
    finally:
        sampler.stop()
        for agent in (first, second):
            if agent is not None:
                agent.kill()
    for phase in ("rendezvous", "running", "stacks", "restart"):
        for agent in (first, second):
            if phase == "rendezvous" and agent is second:
                continue
            most = sampler.most[phase, agent.pid]
            assert 1 <= most <= MAX_CONNECTIONS, (
                f"{phase}: agent {agent.pid} held {most} Redis connections "
                f"(at most {MAX_CONNECTIONS})")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())
