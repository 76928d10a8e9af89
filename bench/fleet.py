"""A fleet of simulated nodes against one real redis-server: the job at 256 to 4,096 nodes.

Each simulated node runs the agent's own coordination code: the rendezvous (``RedisRendezvous``:
join, the membership summary with the node's beat in it every keep-alive interval, heartbeats
on their own only when that call is late), the
command stream and its acks (``decode_command``, ``EventSink`` through a ``StreamPublisher``),
resource samples (``ResourceSampler.run``), stall progress (``StallWatch.check``) and stack
replies (``StackCollector.publish``). Only the workers are fake: no process is spawned, a
node "runs" ``--nproc-per-node`` ranks whose samples and stacks are made up. Every node holds
two Redis connections, as an agent does: one for its writes and scripts, one for its
blocking reads (the commands and the rendezvous's notify stream in one XREAD, StreamMux).

The nodes are packed into as many processes as there are cores; each process runs its nodes
on one event loop, the rendezvous through ``AsyncRedisRendezvous`` (the agent's steps and
scripts, driven by asyncio instead of a thread per node: 2,048 threads a process hopping to
the loop for every call would be the bench measuring itself). What the packing would add and
an agent on a host of its own does not pay is left out, and said here: the processes run
without the cyclic garbage collector once their nodes are connected (a full pass over 2,048
nodes' objects took 100-380 ms and stalled them all; their peak RSS is printed), and a node
whose "workers" stop at once lets its restart ack be written first, for at most ``STOP_S``,
as an agent's ack is while its workers exit. Each process's loop lag (how late it runs what is
due) is printed with the steady state: near 0 the figures are the protocol's, not the bench's.
For each N it prints:

* forming: from the moment all nodes are released together until every node holds its rank;
* steady state over ``--steady`` seconds (heartbeats, summaries, progress, samples, no logs):
  Redis CPU as % of one core (``INFO cpu``), commands/s, memory, connections per node and in
  total, script calls per node per heartbeat interval, and whether any node was called lost;
* a lost node (its heartbeats stopped, nothing said): until the survivors hold a new round;
* a ``restart`` command: until every node acked it, and until every node's "workers" started
  again in the new round;
* a ``stacks`` request for every rank: until the console side has every rank's reply grouped;
* torch's c10d rendezvous at the same N (threads on a TCPStore, bench/rendezvous_bench.py),
  where it forms within ``--c10d-timeout``, and the ratio.

Goals (issue 21), checked here and printed as held or not: forming 1,024 nodes <= 1 s and
4,096 <= 3 s; at 4,096 nodes Redis under 25% of a core in steady state and no node falsely
lost; a lost node -> the new round within heartbeat timeout + 2 s; ``restart`` acked by every
node within 2 s; the stacks of every rank grouped within 10 s.

    python bench/fleet.py [--nodes 256,1024,4096] [--steady 20] [--c10d-timeout 60]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import resource
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aioredis

from elastic_agent.coordination.rendezvous.drivers import AsyncRedisRendezvous
from elastic_agent.coordination.rendezvous.types import (
    RendezvousResult,
    RendezvousSettings,
    opens_a_round,
)
from elastic_agent.coordination.transport import stream_mux
from elastic_agent.coordination.transport.connection import make_async_client, make_client
from elastic_agent.coordination.transport.stream_mux import StreamMux
from elastic_agent.coordination.wire import command_records, event_records, keyspace, protocol
from elastic_agent.coordination.wire.command_records import Command, CommandType
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.stack_dumps import RankStack, group_stacks, parse_faulthandler
from elastic_agent.coordination.wire.stack_replies import request_stacks
from elastic_agent.supervision.diagnosis.stacks import StackCollector
from elastic_agent.supervision.diagnosis.stall import StallWatch, interval_for
from elastic_agent.supervision.hosting.standalone import RedisServer
from elastic_agent.supervision.loops import Cadence
from elastic_agent.supervision.records.commands import CommandReader, Rejected
from elastic_agent.supervision.records.events import EventSink, ResourceSampler
from elastic_agent.supervision.records.job_records import JobRecords, ReseedSchedule
from elastic_agent.supervision.records.publisher import StreamPublisher

_STACK = """Thread 0x00007f0000000001 (most recent call first):
  File "/opt/train.py", line {line} in {fn}
  File "/opt/train.py", line 40 in main
  File "/opt/train.py", line 44 in <module>
"""


# -- one node -----------------------------------------------------------------------------

class FakeSampler(ResourceSampler):
    """The agent's sampler with made-up workers: the write path is the real one."""

    def __init__(self, client: aioredis.Redis, job: str, node: str, ranks: range) -> None:
        super().__init__(client, job, node)
        self.ranks = ranks

    async def collect(self) -> dict[int, dict[str, Any]]:
        return self.sample()  # made up: no /proc to read, no thread needed

    def sample(self) -> dict[int, dict[str, Any]]:
        now = time.time()
        return {r: {"rank": r, "node": self._node, "pid": 10_000 + r, "cpu": 99.5,
                    "rss": 1 << 30, "threads": 12, "ts": now} for r in self.ranks}


#: The longest a simulated node's "workers" take to stop (an agent's: SIGTERM, then exits).
STOP_S = 0.5


class SimNode:
    """One simulated agent. ``events`` receives (kind, node index, time.time(), detail)."""

    def __init__(self, index: int, url: str, job: str, settings: RendezvousSettings,
                 nproc: int, report: Callable[[str, int, float, Any], None]) -> None:
        self.index = index
        self.job = job
        self.keys = JobKeys(job)
        self.report = report
        self.nproc = nproc
        self.settings = settings
        self.node_id = f"sim{index:05d}-{uuid.uuid4().hex[:6]}"
        # An agent's two connections: the writer, and one XREAD for every stream it follows.
        self.writer = make_async_client(url, one_connection=True)
        self.mux = StreamMux(make_async_client(url, blocking_ms=stream_mux.BLOCK_MS, retries=0,
                                               one_connection=True),
                             self.writer, wake_key=self.keys.wake(self.node_id))
        self.rdzv = AsyncRedisRendezvous(url, job, settings, local_addr="127.0.0.1",
                                         node_id=self.node_id, nproc=nproc,
                                         client=self.writer, reader=self.mux.reader())
        self.publisher = StreamPublisher(lambda: self.writer, close_client=False)
        self.events = EventSink(self.publisher, job, self.node_id)
        self.records = JobRecords(self.writer, job, self.keys.logs(self.node_id))
        self.result: RendezvousResult | None = None
        self.started_ms = 0
        self.tasks: list[asyncio.Task[Any]] = []
        self.restart_after_ms = 0
        self.restart = asyncio.Event()

    async def connect(self) -> None:
        await self.writer.ping()
        await self.mux.client.ping()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.publisher.close(flush_timeout=0.5), 5)
        await self.mux.aclose()
        for client in (self.mux.client, self.writer):
            with contextlib.suppress(Exception):
                await client.aclose()

    async def rendezvous(self) -> RendezvousResult:
        result = await self.rdzv.next_rendezvous()
        self.result = result
        self.started_ms = result.completed_ms
        return result

    @property
    def ranks(self) -> range:
        assert self.result is not None
        return range(self.result.base_rank, self.result.base_rank + self.nproc)

    def start_workers(self) -> None:
        assert self.result is not None
        self.events.emit(EventType.WORKERS_STARTED, round=self.result.round,
                         attempt=self.result.round, restart_count=0, ranks=list(self.ranks),
                         local_ranks=list(range(self.nproc)),
                         pids=[10_000 + r for r in self.ranks], host="fleet")

    async def run(self, formed: Callable[[], Any]) -> None:
        """``formed()`` after the first round; it returns when every node of this process
        has formed: what a node does next would otherwise take this process's CPU from the
        nodes still forming (agents each have a host of their own)."""
        self.mux.start()
        await self.publisher.start()
        await self.rendezvous()
        self.report("formed", self.index, time.time(), time.process_time())
        await formed()
        self.start_workers()
        sampler = FakeSampler(self.writer, self.job, self.node_id, self.ranks)
        self.tasks = [asyncio.create_task(sampler.run()),
                      asyncio.create_task(self.progress()),
                      asyncio.create_task(self.commands())]
        await self.watch()

    async def progress(self) -> None:
        """Stall progress, as StallWatch writes it for a job whose ranks compute."""
        stall = StallWatch(self.writer, self.mux.reader(), self.job, self.node_id, "fleet", 300,
                           "observe", {}, self.events.emit)
        cadence = Cadence(interval_for(300))  # as StallWatch ticks
        while True:
            await asyncio.sleep(cadence.until_next())
            assert self.result is not None
            with contextlib.suppress(redis.RedisError, OSError):
                await stall.check(self.result.round, self.started_ms, 0)

    async def watch(self) -> None:
        """The agent's membership watch: the summary every keep-alive interval, or at once
        when the rendezvous notifies a transition or a restart command came."""
        reader = self.mux.reader()
        streams: dict[str, str] = {}

        async def from_now() -> None:  # the agent's watch starts so each round
            for key in (self.keys.rdzv_notify,):
                last = await self.writer.xrevrange(key, count=1)
                streams[key] = last[0][0].decode() if last else "0-0"

        await from_now()
        cadence = Cadence(self.settings.keep_alive_interval)
        reseed = ReseedSchedule(self.rdzv)
        opened = False  # the notify stream said a new round opened (the agent's watch too)
        while True:
            assert self.result is not None
            if reseed.due():  # as the agent's watch does
                with contextlib.suppress(redis.RedisError, OSError):
                    await self.records.reseed()
                    reseed.done()
            reform = opened or self.restart_after_ms > self.started_ms
            if not reform:
                # A restart that came while the node re-formed anyway was done with it.
                self.restart.clear()
                m, newly = await self.rdzv.lost_since_last_check(beat=True)
                for node in newly:
                    self.events.emit(EventType.NODE_LOST, lost_node=node, host="fleet")
                reform = m.round > self.result.round or self.rdzv.waiting_count(m) > 0
            if reform:
                opened = False
                self.restart_after_ms = 0
                self.restart.clear()
                await self.rendezvous()
                self.report("reformed", self.index, time.time(), self.result.round)
                self.start_workers()
                await from_now()
                continue
            read = asyncio.ensure_future(reader.xread(
                streams, block=max(1, int(cadence.until_next() * 1000)), count=100))
            restart = asyncio.ensure_future(self.restart.wait())
            await asyncio.wait({read, restart}, return_when=asyncio.FIRST_COMPLETED)
            restart.cancel()
            if not read.done():
                read.cancel()
                continue
            for key, entries in read.result() or []:
                streams[key.decode() if isinstance(key, bytes) else key] = (
                    entries[-1][0].decode() if isinstance(entries[-1][0], bytes)
                    else entries[-1][0])
                opened = opened or opens_a_round(entries)

    async def commands(self) -> None:
        """The agent's command reader (its own cursor on the command stream) and acks."""
        async for cmd in CommandReader(self.mux.reader(), self.job):
            if isinstance(cmd, Rejected):
                self.ack(cmd.id, "rejected", cmd.reason)
                continue
            if cmd.type == CommandType.STACKS:
                assert self.result is not None
                odd = self.result.total_workers - 1  # the job's last rank is somewhere else
                stacks = [RankStack(r, self.node_id, "fleet", 10_000 + r, parse_faulthandler(
                    _STACK.format(line=17 if r == odd else 12,
                                  fn="straggler" if r == odd else "all_reduce")))
                          for r in self.ranks]
                collector = StackCollector(None, self.writer, self.job, self.node_id, "fleet")
                collector.world_size = self.result.total_workers
                await collector.publish(cmd.id, stacks)
                self.ack(cmd.id, "done", f"stacks of {len(stacks)} ranks published")
                continue
            self.ack(cmd.id, "accepted", f"{cmd.type} from {cmd.issuer}")
            if (cmd.type == CommandType.RESTART
                    and protocol.stream_id_ms(cmd.entry_id) >= self.started_ms):
                # An agent stops its workers before it joins again (SIGTERM and their exits,
                # tens of ms at the least), and its ack is written meanwhile. These workers
                # stop at once: the node lets its ack be written first, for at most as long
                # as a stop would take, or in a process of 2,048 nodes the acks queue behind
                # every node's rendezvous.
                with contextlib.suppress(asyncio.TimeoutError, RuntimeError):
                    await asyncio.wait_for(self.publisher.flush(), STOP_S)
                self.restart_after_ms = protocol.stream_id_ms(cmd.entry_id)
                self.restart.set()

    def ack(self, command_id: str, status: str, reason: str) -> None:
        self.events.emit(EventType.COMMAND_ACK, command_id=command_id, status=status,
                         reason=reason, host="fleet")

    def kill(self) -> None:
        """The host dies: no leave, no more heartbeats, nothing read or written."""
        self.rdzv.stop_heartbeats()
        for t in self.tasks:
            t.cancel()


def raise_fd_limit() -> int:
    """Open files up to the hard limit (the server and the fleet hold 2 sockets per node)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


# -- one process of nodes ------------------------------------------------------------------

class _Barrier:
    """Every node of this process formed (see SimNode.run)."""

    def __init__(self, count: int) -> None:
        self.left = count
        self.event = asyncio.Event()

    async def formed(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.event.set()
        await self.event.wait()


#: ``FLEET_PROFILE=DIR``: each fleet process profiles itself (cProfile) into DIR/fleet-FIRST.prof,
#: to see what a simulated node costs the process (the bench's own limit at 4,096 nodes).
_PROFILE = os.environ.get("FLEET_PROFILE")


atexit_dump: list[Callable[[], None]] = []  # os._exit skips atexit


def _fleet_process(conn: Any, url: str, job: str, first: int, count: int, nproc: int,
                   settings: RendezvousSettings) -> None:
    raise_fd_limit()
    if _PROFILE:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
        atexit_dump[:] = [lambda: profile.dump_stats(os.path.join(_PROFILE,
                                                                  f"fleet-{first}.prof"))]
    asyncio.run(_fleet_main(conn, url, job, first, count, nproc, settings))


async def _fleet_main(conn: Any, url: str, job: str, first: int, count: int, nproc: int,
                      settings: RendezvousSettings) -> None:
    loop = asyncio.get_running_loop()
    reports: list[tuple[str, int, float, Any]] = []

    def report(kind: str, index: int, at: float, detail: Any) -> None:
        reports.append((kind, index, at, detail))

    nodes = [SimNode(first + i, url, job, settings, nproc, report)
             for i in range(count)]
    for i in range(0, count, 256):
        await asyncio.gather(*(n.connect() for n in nodes[i:i + 256]))
    # Thousands of nodes' objects in one heap: the cyclic collector's full passes took 100 to
    # 380 ms here (every object alive, nothing collected) and stalled all 2,048 nodes of the
    # process at once, every few seconds; an agent's heap is one node's. The nodes' garbage
    # goes by reference counting; what cycles leave behind shows in the processes' peak RSS,
    # printed with the figures.
    gc.collect()
    gc.freeze()
    gc.disable()
    barrier = _Barrier(count)
    lags: list[float] = []

    async def lag_probe() -> None:  # how late this loop runs what is due
        while True:
            t = loop.time()
            await asyncio.sleep(0.05)
            lags.append(loop.time() - t - 0.05)

    probe = asyncio.create_task(lag_probe())
    conn.send(("ready", count))
    runs: list[asyncio.Task[None]] = []
    while True:
        msg = await loop.run_in_executor(None, conn.recv)
        kind = msg[0]
        if kind == "go":
            await asyncio.sleep(max(0.0, msg[1] - time.time()))
            report("released", first, time.time(), time.process_time())
            runs = [asyncio.create_task(n.run(barrier.formed)) for n in nodes]
        elif kind == "kill":
            victim = nodes[msg[1] - first]
            victim.kill()
            runs[msg[1] - first].cancel()
            conn.send(("killed", time.time()))
        elif kind == "cpu":
            conn.send(("cpu", time.process_time()))
        elif kind == "rss":
            conn.send(("rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
        elif kind == "lag":
            conn.send(("lag", list(lags)))
            lags.clear()
        elif kind == "reports":
            conn.send(("reports", list(reports)))
            reports.clear()
        elif kind == "stop":
            probe.cancel()
            for t in runs:
                t.cancel()
            for n in nodes:
                n.rdzv.stop_heartbeats()
            await asyncio.gather(*runs, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*(n.close() for n in nodes),
                                                      return_exceptions=True), 15)
            for dump in atexit_dump:
                dump()
            conn.send(("stopped",))
            # Threads still wait on calls into this loop (a killed node's last read): no
            # interpreter shutdown that would join them.
            os._exit(0)


class Fleet:
    """The processes of one run, driven from the bench's main process."""

    def __init__(self, url: str, job: str, n: int, procs: int, nproc: int,
                 settings: RendezvousSettings) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns = []
        self.procs = []
        self.owner: dict[int, int] = {}
        per = -(-n // procs)
        for p in range(procs):
            first, count = p * per, min(per, n - p * per)
            if count <= 0:
                break
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_fleet_process,
                               args=(child, url, job, first, count, nproc, settings), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
            for i in range(first, first + count):
                self.owner[i] = p
        self.reports: list[tuple[str, int, float, Any]] = []

    def wait_ready(self, timeout: float) -> None:
        for c in self.conns:
            if not c.poll(timeout):
                raise RuntimeError("a fleet process did not get its nodes connected in time")
            c.recv()

    def go(self, at: float) -> None:
        for c in self.conns:
            c.send(("go", at))

    def collect(self) -> list[tuple[str, int, float, Any]]:
        for c in self.conns:
            c.send(("reports",))
        for c in self.conns:
            self.reports.extend(c.recv()[1])
        return self.reports

    def lag(self) -> list[float]:
        """Every process's loop lag samples since the last call, pooled."""
        for c in self.conns:
            c.send(("lag",))
        return [x for c in self.conns for x in c.recv()[1]]

    def peak_rss(self) -> int:
        """The largest peak RSS of the processes, bytes."""
        for c in self.conns:
            c.send(("rss",))
        return max(c.recv()[1] for c in self.conns)

    def cpu(self) -> list[float]:
        """Each process's CPU seconds so far (``time.process_time``)."""
        for c in self.conns:
            c.send(("cpu",))
        return [c.recv()[1] for c in self.conns]

    def kill(self, index: int) -> float:
        c = self.conns[self.owner[index]]
        c.send(("kill", index))
        return c.recv()[1]

    def stop(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                c.send(("stop",))
        for c, p in zip(self.conns, self.procs):
            with contextlib.suppress(OSError, EOFError):
                if c.poll(30):
                    c.recv()
            p.join(5)
            if p.is_alive():
                p.kill()


# -- the main process ------------------------------------------------------------------------

def _wait(cond: Callable[[], Any], timeout: float, step: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(step)  # polling Redis from the bench's side: the nodes are elsewhere
    return None


def _redis_cpu(info: dict[str, Any]) -> float:
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _script_calls(stats: dict[str, Any]) -> int:
    return sum(int(v.get("calls", 0)) for k, v in stats.items()
               if k in ("cmdstat_evalsha", "cmdstat_eval"))


def _node_times(r: redis.Redis, job: str, since: str,
                says: Callable[[event_records.Event], bool]) -> dict[str, int]:
    """Each node that published an event that ``says`` after ``since``: server ms of its
    newest such event."""
    times: dict[str, int] = {}
    last = since
    while True:
        entries = r.xrange(JobKeys(job).events, min=f"({last}", count=5000)
        if not entries:
            break
        for entry_id, fields in entries:
            last = entry_id.decode()
            ev = event_records.decode_event(entry_id, fields)
            if ev is not None and says(ev):
                times[ev.node] = protocol.stream_id_ms(last)
    return times


def _nodes_saying(r: redis.Redis, job: str, since: str,
                 says: Callable[[event_records.Event], bool]) -> tuple[int, int]:
    """(how many nodes published an event that ``says`` after ``since``, server ms of the
    newest such event)."""
    times = _node_times(r, job, since, says)
    return len(times), max(times.values(), default=0)


def _calls_per_node(before: dict[str, Any], after: dict[str, Any], n: int) -> dict[str, float]:
    """Commands per node between two ``INFO commandstats`` (scripts' own calls included), the
    most frequent first."""
    calls = {k.removeprefix("cmdstat_"): (int(v["calls"]) - int(before.get(k, {}).get("calls", 0)))
             / n for k, v in after.items()}
    return {k: round(v, 2) for k, v in sorted(calls.items(), key=lambda kv: -kv[1])[:12] if v}


def _spread(ms: list[int], origin_ms: float) -> dict[str, float]:
    """Seconds after ``origin_ms`` by which 10%, half, 90% and all of ``ms`` had happened:
    whether a phase is one slow call or a queue that every node waits in."""
    if not ms:
        return {}
    ms = sorted(ms)
    at = {q: ms[min(len(ms) - 1, int(q * len(ms)))] for q in (0.1, 0.5, 0.9)}
    return {"p10": (at[0.1] - origin_ms) / 1000, "p50": (at[0.5] - origin_ms) / 1000,
            "p90": (at[0.9] - origin_ms) / 1000, "all": (ms[-1] - origin_ms) / 1000}


def _acks(r: redis.Redis, job: str, command_id: str, since: str) -> tuple[int, int]:
    return _nodes_saying(r, job, since, lambda ev: ev.type == EventType.COMMAND_ACK
                         and ev.data.get("command_id") == command_id)


def _started(r: redis.Redis, job: str, round_: int, since: str) -> tuple[int, int]:
    return _nodes_saying(r, job, since, lambda ev: ev.type == EventType.WORKERS_STARTED
                         and ev.data.get("round") == round_)


def _server_ms(r: redis.Redis) -> int:
    s, us = r.time()
    return s * 1000 + us // 1000


def _newest_id(r: redis.Redis, key: str) -> str:
    last = r.xrevrange(key, count=1)
    return last[0][0].decode() if last else "0-0"


def run_fleet(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Every figure for N nodes on a fresh redis-server."""
    out: dict[str, Any] = {"nodes": n, "ranks": n * args.nproc_per_node}
    # An elastic job (--nnodes N/2:N): it forms once all N are in (max), and can re-form
    # without a node it lost.
    settings = RendezvousSettings(min_nodes=max(1, n // 2), max_nodes=n, join_timeout=600,
                                  last_call_timeout=30, heartbeat_timeout=args.heartbeat_timeout,
                                  keep_alive_interval=args.keep_alive)
    with RedisServer(extra_args=["--maxclients", str(4 * n + 1000)]) as server:
        r = make_client(server.url)
        job = f"fleet-{n}-{uuid.uuid4().hex[:6]}"
        keys = JobKeys(job)
        fleet = Fleet(server.url, job, n, args.procs, args.nproc_per_node, settings)
        try:
            fleet.wait_ready(timeout=120 + n / 20)
            # 1. forming: every node released at once
            release = time.time() + 1.0
            fleet.go(release)
            _say(f"N={n}: {n} nodes connected, released")
            formed = _wait(lambda: len([x for x in fleet.collect() if x[0] == "formed"]) >= n,
                           timeout=args.form_timeout, step=0.1)
            times = [x[2] for x in fleet.reports if x[0] == "formed"]
            out["form_s"] = (max(times) - release) if formed else None
            # Where the time went, by Redis's clock: the first and last joins, the completion.
            joins = r.xrange(keys.rdzv_joins, count=n + 10)
            done = [i for i, f in r.xrange(keys.rdzv_notify) if f.get(b"e") == b"complete"]
            if joins:
                out["first_join_s"] = protocol.stream_id_ms(joins[0][0].decode()) / 1000 - release
                out["last_join_s"] = protocol.stream_id_ms(joins[-1][0].decode()) / 1000 - release
            if done:
                out["complete_s"] = protocol.stream_id_ms(done[0].decode()) / 1000 - release
            # The fleet's own CPU to form (each process, from its release to its last node):
            # what this machine's cores spent being the nodes rather than serving them.
            cpu = {}
            for kind, index, _at, used in fleet.reports:
                p = fleet.owner[index]
                if kind == "released":
                    cpu.setdefault(p, [used, used])[0] = used
                elif kind == "formed":
                    cpu.setdefault(p, [used, used])[1] = max(cpu[p][1], used)
            out["fleet_form_cpu_s"] = max((b - a for a, b in cpu.values()), default=0.0)
            if not formed:
                out["form_note"] = f"{len(times)} of {n} nodes formed within {args.form_timeout:g} s"
                return out
            # 2. steady state
            _say(f"N={n}: formed in {out['form_s']:.3f} s (joins from "
                 f"{_fmt(out.get('first_join_s'))} to {_fmt(out.get('last_join_s'))} s, complete "
                 f"at {_fmt(out.get('complete_s'))} s; a fleet process spent "
                 f"{out['fleet_form_cpu_s']:.2f} s of CPU); steady state")
            time.sleep(args.warmup)
            r.config_resetstat()
            info0, t0 = r.info("cpu"), time.monotonic()
            fleet_cpu0 = fleet.cpu()
            fleet.lag()
            c0 = int(r.info("stats")["total_commands_processed"])
            round0 = int(r.hget(keys.rdzv_state, "round"))
            time.sleep(args.steady)
            info1, t1 = r.info("cpu"), time.monotonic()
            # The busiest fleet process, as % of its core: near 100 the bench, not Redis, is
            # what limits every timing of this N (a real node has a host of its own).
            lags = sorted(fleet.lag())
            if lags:
                out["fleet_lag_ms"] = [round(1000 * lags[int(q * (len(lags) - 1))], 1)
                                       for q in (0.5, 0.9, 0.99)]
            out["fleet_cpu_pct"] = 100 * max(
                b - a for a, b in zip(fleet_cpu0, fleet.cpu())) / (t1 - t0)
            c1 = int(r.info("stats")["total_commands_processed"])
            stats = r.info("commandstats")
            dt = t1 - t0
            out["redis_cpu_pct"] = 100 * (_redis_cpu(info1) - _redis_cpu(info0)) / dt
            out["commands_per_s"] = (c1 - c0) / dt
            intervals = dt / args.keep_alive
            out["scripts_per_node_interval"] = _script_calls(stats) / n / intervals
            # Where Redis's time goes, per node and interval (scripts' own calls included).
            out["redis_us_per_node_interval"] = {
                k.removeprefix("cmdstat_"): round(float(v["usec"]) / n / intervals, 1)
                for k, v in sorted(stats.items(), key=lambda kv: -float(kv[1]["usec"]))[:8]}
            out["calls_per_node_interval"] = {
                k.removeprefix("cmdstat_"): round(int(v["calls"]) / n / intervals, 2)
                for k, v in sorted(stats.items(), key=lambda kv: -int(kv[1]["calls"]))[:10]}
            out["commands_per_node_interval"] = (c1 - c0) / n / intervals
            out["used_memory_mib"] = int(r.info("memory")["used_memory"]) / 2**20
            clients = int(r.info("clients")["connected_clients"]) - 1  # (this bench's own)
            out["connections"] = clients
            out["connections_per_node"] = clients / n
            out["false_lost"] = r.scard(keys.rdzv_lost) + (
                int(r.hget(keys.rdzv_state, "round")) != round0)
            # 3. a lost node
            _say(f"N={n}: Redis {out['redis_cpu_pct']:.1f}% of a core; killing a node")
            since = _newest_id(r, keys.events)
            victim = n - 1
            joins_since = _newest_id(r, keys.rdzv_joins)
            notify_since = _newest_id(r, keys.rdzv_notify)
            cpu_before = fleet.cpu()
            killed = fleet.kill(victim)
            want_round = round0 + 1
            # The victim's last beat (by Redis's clock): nobody may call it lost before that
            # plus the heartbeat timeout, so that is where the protocol's clock starts.
            last_beat = next((score for _, score in r.zscan_iter(
                keys.rdzv_heartbeats, match=f"sim{victim:05d}-*")), None)

            def reformed() -> bool:
                s = r.hmget(keys.rdzv_state, "round", "status")
                return s[0] is not None and int(s[0]) >= want_round and s[1] == b"complete"

            ok = _wait(reformed, timeout=args.heartbeat_timeout + 60)
            out["lost_s"] = (time.time() - killed) if ok else None
            head = json.loads(r.hget(keys.rdzv_state, "head") or b"{}")
            out["lost_world"] = head.get("world_size")
            # By Redis's clock: when the new round completed (the protocol's part; what the
            # nodes take to hear of it is this machine's 2 cores simulating N agents).
            out["lost_complete_s"] = int(head.get("completed_ms", 0)) / 1000 - killed
            told, seen_ms = _nodes_saying(r, job, since, lambda e: e.type == EventType.NODE_LOST)
            if told and last_beat is not None:  # (one node reports a loss: newest = first)
                out["lost_last_beat_s"] = last_beat / 1000 - killed
                out["lost_seen_s"] = seen_ms / 1000 - killed
            survivors = n - 1
            _wait(lambda: _started(r, job, want_round, since)[0] >= survivors, 60, 0.2)
            # How the survivors' joins spread after the call (a queue in the fleet's processes
            # shows as a ramp), and what the fleet's busiest process spent meanwhile.
            if told:
                joined = [protocol.stream_id_ms(i.decode()) for i, f in r.xrange(
                    keys.rdzv_joins, min=f"({joins_since}", count=2 * n) if f.get(b"e") == b"joined"]
                out["lost_joins"] = _spread(joined, seen_ms)
                opened = [protocol.stream_id_ms(i.decode()) for i, f in r.xrange(
                    keys.rdzv_notify, min=f"({notify_since}") if f.get(b"e") == b"open"]
                if opened:
                    out["lost_open_s"] = (opened[0] - seen_ms) / 1000
            out["lost_fleet_cpu_s"] = max(b - a for a, b in zip(cpu_before, fleet.cpu()))
            # 4. restart
            _say(f"N={n}: new round after {_fmt(out['lost_s'])} s; restart")
            time.sleep(1.0)
            since = _newest_id(r, keys.events)
            cmd = Command(f"c-{uuid.uuid4().hex[:12]}", CommandType.RESTART, "fleet-bench")
            cpu_before = fleet.cpu()
            stats_before = r.info("commandstats")
            sent_ms = _server_ms(r)
            r.xadd(keys.commands, command_records.encode_command(cmd), maxlen=keyspace.COMMANDS_MAXLEN,
                   approximate=True)
            acked = _wait(lambda: _acks(r, job, cmd.id, since)[0] >= survivors, 60, 0.1)
            ack_ms = _node_times(r, job, since, lambda ev: ev.type == EventType.COMMAND_ACK
                                 and ev.data.get("command_id") == cmd.id)
            count, newest = len(ack_ms), max(ack_ms.values(), default=0)
            out["restart_acks"] = _spread(list(ack_ms.values()), sent_ms)
            out["restart_acked"] = count
            out["restart_ack_s"] = (newest - sent_ms) / 1000 if acked else None
            want_round += 1
            started = _wait(lambda: _started(r, job, want_round, since)[0] >= survivors, 60, 0.2)
            count, newest = _started(r, job, want_round, since)
            out["restart_started_s"] = (newest - sent_ms) / 1000 if started else None
            head = json.loads(r.hget(keys.rdzv_state, "head") or b"{}")
            out["restart_complete_s"] = (int(head.get("completed_ms", 0)) - sent_ms) / 1000
            out["restart_fleet_cpu_s"] = max(b - a for a, b in zip(cpu_before, fleet.cpu()))
            out["restart_calls_per_node"] = _calls_per_node(stats_before,
                                                            r.info("commandstats"), n)
            # 5. stacks of every rank
            _say(f"N={n}: restart acked in {_fmt(out['restart_ack_s'])} s; stacks")
            time.sleep(1.0)

            async def stacks() -> tuple[float, int, int, int]:
                client = aioredis.Redis.from_url(server.url, socket_timeout=30)
                try:
                    t = time.perf_counter()
                    _, got = await request_stacks(client, job, "fleet-bench", timeout=60)
                    groups = group_stacks(got)
                    took = time.perf_counter() - t
                finally:
                    await client.aclose()
                answered = sum(1 for s in got if s.threads)
                return took, answered, len(got), len(groups)

            took, answered, expected, groups = asyncio.run(stacks())
            out["stacks_s"] = took
            out["stacks_answered"] = answered
            out["stacks_expected"] = expected
            out["stacks_groups"] = groups
            out["fleet_peak_rss_mib"] = fleet.peak_rss() / 2**20
        finally:
            fleet.stop()
            r.close()
    return out


def _c10d_child(n: int, timeout: float, queue: Any) -> None:
    # torch's c10d warns once per socket at this scale ("hostname of the client socket
    # cannot be retrieved"): thousands of lines that say nothing about the figure.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from elastic_agent.coordination.ports import free_port
    from rendezvous_bench import rendezvous_time
    queue.put(rendezvous_time("c10d", f"127.0.0.1:{free_port()}", n, timeout))


def c10d_time(n: int, timeout: float) -> float | None:
    """torch's c10d rendezvous for ``n`` nodes (threads, one process, as torch's own tests),
    in a process of its own: a handler that times out leaves threads spinning."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_c10d_child, args=(n, timeout, queue), daemon=True)
    proc.start()
    try:
        return queue.get(timeout=timeout + 60)
    except Exception:
        return None
    finally:
        proc.kill()
        proc.join(5)


def _say(line: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def _fmt(v: Any, spec: str = ".3f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="256,1024,4096", help="comma-separated node counts")
    parser.add_argument("--procs", type=int, default=os.cpu_count() or 2,
                        help="processes the nodes are packed into (default: the cores)")
    parser.add_argument("--nproc-per-node", type=int, default=8)
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0)
    parser.add_argument("--keep-alive", type=float, default=2.0)
    parser.add_argument("--steady", type=float, default=20.0, help="steady-state window, s")
    parser.add_argument("--warmup", type=float, default=6.0)
    parser.add_argument("--form-timeout", type=float, default=120.0)
    parser.add_argument("--c10d-timeout", type=float, default=60.0,
                        help="give up on torch's c10d at an N after this many seconds")
    parser.add_argument("--no-c10d", action="store_true")
    parser.add_argument("--json", action="store_true", help="also print each N's figures as JSON")
    args = parser.parse_args(argv)
    raise_fd_limit()  # the server and the fleet hold 2 sockets per node
    counts = [int(x) for x in args.nodes.split(",")]
    print(f"fleet: --nnodes N/2:N, {args.procs} processes, {args.nproc_per_node} ranks a node, "
          f"heartbeat every "
          f"{args.keep_alive:g} s, lost after {args.heartbeat_timeout:g} s", flush=True)
    rows = []
    c10d_gave_up = False
    for n in counts:
        fig = run_fleet(n, args)
        if args.no_c10d or c10d_gave_up:
            fig["c10d_s"] = None
        else:
            fig["c10d_s"] = c10d_time(n, args.c10d_timeout)
            c10d_gave_up = fig["c10d_s"] is None  # a larger N will not form either
        rows.append(fig)
        print(_report(fig, args), flush=True)
        if args.json:
            print(json.dumps(fig), flush=True)
    print(_table(rows, args))
    failed = _goals(rows, args)
    for line in failed:
        print("goal NOT held: " + line)
    if not failed:
        print("every goal held")
    return 1 if failed else 0


def _report(f: dict[str, Any], args: argparse.Namespace) -> str:
    if f.get("form_s") is None:
        return f"N={f['nodes']}: did not form ({f.get('form_note')})"
    c10d = f.get("c10d_s")
    ratio = f" ({f['form_s'] / c10d:.3f}x)" if c10d else ""
    return "\n".join([
        f"N={f['nodes']} nodes, {f['ranks']} ranks",
        f"  forming: {f['form_s']:.3f} s; torch c10d: "
        f"{_fmt(c10d, '.3f', f'not formed in {args.c10d_timeout:g} s')}{ratio}",
        f"  steady: Redis {f['redis_cpu_pct']:.1f}% of a core, {f['commands_per_s']:.0f} "
        f"commands/s, {f['used_memory_mib']:.1f} MiB, {f['connections']} connections "
        f"({f['connections_per_node']:.2f} a node); a node per heartbeat interval: "
        f"{f['scripts_per_node_interval']:.2f} scripts, {f['commands_per_node_interval']:.2f} "
        f"commands; falsely lost: {f['false_lost']}; the busiest fleet process "
        f"{f.get('fleet_cpu_pct', 0):.0f}% of a core, its loop late by "
        f"{'/'.join(map(str, f.get('fleet_lag_ms', [])))} ms (50/90/99%)",
        "  Redis us per node and interval: " + ", ".join(
            f"{k} {v}" for k, v in f.get("redis_us_per_node_interval", {}).items()),
        "  calls per node and interval (scripts' own calls included): " + ", ".join(
            f"{k} {v}" for k, v in f.get("calls_per_node_interval", {}).items()),
        f"  lost node -> new round of {f.get('lost_world')}: {_fmt(f.get('lost_s'))} s (its last "
        f"beat at {_fmt(f.get('lost_last_beat_s'))} s, called lost at "
        f"{_fmt(f.get('lost_seen_s'))} s, the new round complete in Redis at "
        f"{_fmt(f.get('lost_complete_s'))} s)",
        f"  restart: acked by {f.get('restart_acked')} nodes in {_fmt(f.get('restart_ack_s'))} s,"
        f" the new round complete in Redis at {_fmt(f.get('restart_complete_s'))} s, workers "
        f"started again in {_fmt(f.get('restart_started_s'))} s",
        f"  spread (10%/50%/90%/all, s): the new round opened {_fmt(f.get('lost_open_s'))} s "
        f"after the call, re-form joins after the call "
        f"{_quantiles(f.get('lost_joins'))}, the fleet's busiest process "
        f"{_fmt(f.get('lost_fleet_cpu_s'), '.2f')} s of CPU; restart acks "
        f"{_quantiles(f.get('restart_acks'))}, busiest process "
        f"{_fmt(f.get('restart_fleet_cpu_s'), '.2f')} s of CPU",
        "  a restart's commands per node (scripts' own calls included): " + ", ".join(
            f"{k} {v}" for k, v in f.get("restart_calls_per_node", {}).items()),
        f"  stacks: {f.get('stacks_answered')} of {f.get('stacks_expected')} ranks answered, "
        f"{f.get('stacks_groups')} groups, in {_fmt(f.get('stacks_s'))} s; a fleet process's "
        f"peak RSS {_fmt(f.get('fleet_peak_rss_mib'), '.0f')} MiB",
    ])


def _quantiles(spread: dict[str, float] | None) -> str:
    if not spread:
        return "-"
    return "/".join(f"{spread[k]:.2f}" for k in ("p10", "p50", "p90", "all"))


def _table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    head = ("| nodes | ranks | forming | torch c10d | ratio | Redis CPU | commands/s | memory | "
            "conn/node | scripts/node/interval | lost node -> new round | restart acked | "
            "restarted | stacks grouped |")
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for f in rows:
        if f.get("form_s") is None:
            lines.append(f"| {f['nodes']} | {f['ranks']} | not formed |" + " |" * 11)
            continue
        c10d = f.get("c10d_s")
        lines.append(
            f"| {f['nodes']:,} | {f['ranks']:,} | {f['form_s']:.2f} s | "
            f"{_fmt(c10d, '.2f') + ' s' if c10d else f'> {args.c10d_timeout:g} s'} | "
            f"{_fmt(f['form_s'] / c10d, '.3f') + 'x' if c10d else '-'} | "
            f"{f['redis_cpu_pct']:.1f}% | {f['commands_per_s']:,.0f} | "
            f"{f['used_memory_mib']:.0f} MiB | {f['connections_per_node']:.2f} | "
            f"{f['scripts_per_node_interval']:.2f} | {_fmt(f.get('lost_s'), '.2f')} s | "
            f"{_fmt(f.get('restart_ack_s'), '.2f')} s | {_fmt(f.get('restart_started_s'), '.2f')} s | "
            f"{_fmt(f.get('stacks_s'), '.2f')} s |")
    return "\n".join(lines)


def _goals(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    failed = []
    limits = {1024: 1.0, 4096: 3.0}
    for f in rows:
        n = f["nodes"]
        if f.get("form_s") is None:
            failed.append(f"N={n}: did not form")
            continue
        if n in limits and f["form_s"] > limits[n]:
            failed.append(f"N={n}: forming {f['form_s']:.2f} s > {limits[n]:g} s")
        if n >= 4096 and f["redis_cpu_pct"] >= 25:
            failed.append(f"N={n}: Redis {f['redis_cpu_pct']:.1f}% of a core in steady state")
        if f["false_lost"]:
            failed.append(f"N={n}: a node was called lost in steady state")
        if f["connections_per_node"] > 2:
            failed.append(f"N={n}: {f['connections_per_node']:.2f} connections a node")
        if f.get("lost_s") is None or f["lost_s"] > args.heartbeat_timeout + 2:
            failed.append(f"N={n}: lost node -> new round in {_fmt(f.get('lost_s'))} s "
                          f"> {args.heartbeat_timeout + 2:g} s")
        if f.get("restart_ack_s") is None or f["restart_ack_s"] > 2:
            failed.append(f"N={n}: restart acked in {_fmt(f.get('restart_ack_s'))} s > 2 s")
        if f.get("stacks_s") is None or f["stacks_s"] > 10 or (
                f.get("stacks_answered") != f.get("stacks_expected")):
            failed.append(f"N={n}: stacks {f.get('stacks_answered')} of "
                          f"{f.get('stacks_expected')} in {_fmt(f.get('stacks_s'))} s")
    return failed


if __name__ == "__main__":
    sys.exit(main())
