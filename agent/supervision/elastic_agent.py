"""The agent's state machine: rendezvous, start, monitor, restart, exit.

One agent runs on each host of a job. The loop, per round:

1. rendezvous (Redis; progress on the terminal) -> group rank, world size, master address;
2. start the local workers with torchrun's environment;
3. monitor, reacting to whichever comes first:
   * the local group's outcome (a worker exit is an asyncio event, not a polling tick),
   * a change of the job's membership or a newer round opened by another node (notify
     streams, plus the heartbeat clock for lost nodes),
   * a command from the job's command stream (stop, restart, signal),
   * a signal to the agent;
4. then stop the workers (whole process trees) and either re-rendezvous or exit.

A failure anywhere restarts the whole job's worker group; restarts are counted once per
round by one job-wide counter in Redis and limited by ``--max-restarts``. Membership changes
and restart commands do not spend a restart. Exit status: 0 on success, 1 when the job
failed, 128+N when signal N stopped the agent, 143 when a stop command ended the job, 93
(do not requeue) when the job failed with a restart pattern in its history or this node was
left out of it as a suspect (restart_patterns.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import redis
import redis.asyncio as aioredis

from ..coordination import protocol, stream_mux
from ..coordination.connection import (
    RedisUnavailableError,
    config_get_each,
    explain_error,
    make_async_client,
    raise_if_cancelled,
)
from ..coordination.pressure import OOM, eviction_policy_warning
from ..coordination.protocol import Command, CommandType, EventType, JobKeys
from ..coordination.rendezvous import (
    RedisRendezvous,
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousOutOfMemoryError,
    RendezvousProgress,
    RendezvousResult,
    opens_a_round,
)
from ..coordination.store import StoreTimeoutError, barrier
from ..coordination.stream_mux import StreamMux
from ..coordination.text import terminal_line
from . import run_summary
from .config import AgentConfig
from .diagnosis import recorder
from .diagnosis.pattern_watch import PatternWatch
from .diagnosis.restart_patterns import DO_NOT_REQUEUE, Patterns
from .diagnosis.stacks import StackCollector
from .diagnosis.stall import Stall, StallWatch
from .diagnosis.stragglers import StragglerWatch
from .diagnosis.watchdog import Watchdog
from .exit_barrier import BarrierLeft, LeavableStore
from .failures import FailedElsewhere, failure_dict, traceback_of, truncate_json
from .fence import Fence
from .health import HealthCheck
from .hosting import scheduler
from .launch.workers import (
    GroupResult,
    RankAssignment,
    WorkerExit,
    WorkerGroup,
    WorkerSpec,
    WorkerStartError,
    WorkerState,
)
from .loops import Cadence, keep_running
from .records import pages
from .records.commands import CommandReader, Rejected, stacks_limit, stacks_refused
from .records.events import EventSink, ResourceSampler, RestartClock
from .records.job_records import JobRecords, ReseedSchedule
from .records.logs import LogConfig, NodeLogs, make_logs_drop_marker, parse_std_spec
from .records.publisher import StreamPublisher
from .records.retention import JobRetention
from .redis_bridge import SyncBridge

log = logging.getLogger(__name__)

T = TypeVar("T")

# OOM (maxmemory, noeviction): a refused write changed nothing and goes through once memory
# is freed, like a write during an outage once Redis is back.
_OUTAGE = (redis.ConnectionError, redis.TimeoutError, OSError, RendezvousConnectionError,
           redis.OutOfMemoryError)

_NEWER_ROUND = "another node opened a new round"

EXIT_STOPPED = 143  # a stop command: the conventional status of a terminated process

# Claims the restart of one failed round, once across the job, and counts it.
# KEYS: restarts, meta. ARGV: round. Returns {claimed (0/1), restarts used}.
_CLAIM_RESTART = """
if redis.call('HSETNX', KEYS[2], 'restart_claim:' .. ARGV[1], 1) == 0 then
  return {0, redis.call('GET', KEYS[1]) or '0'}
end
-- A counter lost with its Redis starts again from the highest count this agent saw.
local seen, current = tonumber(ARGV[2]), tonumber(redis.call('GET', KEYS[1]) or '0')
if current ~= nil and current < seen then redis.call('SET', KEYS[1], seen) end
return {1, redis.call('INCR', KEYS[1])}
"""


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # a local worker failed
    REFORM = "reform"  # membership changed, or another node opened a newer round
    RESTART = "restart"  # a restart command
    STOP = "stop"  # a stop command
    CLOSED = "closed"  # the job ended elsewhere (failed or stopped)
    SIGNAL = "signal"  # the agent itself was signalled
    STALLED = "stalled"  # no rank progressed for --stall-timeout, --on-stall restart|stop


@dataclass
class _Round:
    result: RendezvousResult
    attempt: int
    restart_count: int
    started_ms: int
    world_size: int


def _logs_specs_plugin(config: AgentConfig) -> Any:
    """--logs-specs: the entry point's LogsSpecs, made as torchrun makes it (this imports
    torch); None without the flag. A plugin that fails to load is one line, exit 1."""
    if config.logs_specs is None:
        return None
    from ..coordination.torch_compat import LogsSpecsPlugin

    try:
        return LogsSpecsPlugin(config.logs_specs, str(config.log_dir), config.redirects,
                               config.tee, set(config.local_ranks_filter)
                               if config.local_ranks_filter is not None else None)
    except Exception as exc:  # a third party's plugin may raise anything
        raise WorkerStartError(f"--logs-specs {config.logs_specs}: cannot load it "
                               f"({type(exc).__name__}: {exc})") from None


class ElasticAgent:
    """Runs one host's part of a job until it succeeds, fails, is stopped or signalled."""

    def __init__(self, config: AgentConfig, *, terminal: IO[str] | None = None) -> None:
        self.cfg = config
        self.keys = JobKeys(config.job_id)
        self.term = terminal or sys.stderr
        self._colour = run_summary.isatty(self.term)
        self.host = socket.gethostname()
        # Issue 21: two connections per agent. The writer carries every command that does not
        # block, one at a time (the rendezvous's first); the multiplexer's one XREAD carries
        # every blocking read. The rendezvous and the exit barrier's store run in threads:
        # they use the same two through SyncBridge.
        name = "elastic-agent:" + re.sub(r"[^A-Za-z0-9._-]", "_", self.host) + f":{os.getpid()}"
        self._client: aioredis.Redis = make_async_client(
            config.endpoint, one_connection=True, client_name=name + ":writer")
        self._mux = StreamMux(make_async_client(
            config.endpoint, blocking_ms=stream_mux.BLOCK_MS, retries=0, one_connection=True,
            client_name=name + ":reader"), self._client, wake_key="")
        self._reader = self._mux.reader()
        self._bridges = [SyncBridge(self._client, priority=True),
                         SyncBridge(self._mux.reader(), priority=True)]
        self.rdzv = RedisRendezvous(config.endpoint, config.job_id, config.rendezvous,
                                    local_addr=config.local_addr, nproc=config.nproc,
                                    node_rank=config.static.node_rank if config.static else None,
                                    client=self._bridges[0], reader=self._bridges[1])
        self.node_id = self.rdzv.node_id
        self._mux.wake_key = self.keys.wake(self.node_id)
        self.publisher = StreamPublisher(
            lambda: self._client, close_client=False,
            make_drop_marker=make_logs_drop_marker(config.job_id, self.node_id))
        OOM.count_dropped(lambda: self.publisher.stats().dropped_weight)
        self.events = EventSink(self.publisher, config.job_id, self.node_id,
                                echo=sys.stderr if config.event_log_handler == "console" else None)
        self.node_logs = NodeLogs(
            LogConfig(redirects=parse_std_spec(config.redirects), tee=parse_std_spec(config.tee),
                      local_ranks_filter=config.local_ranks_filter,
                      log_line_prefix_template=config.log_line_prefix_template,
                      maxlen=config.log_retention, duplicate_filters=config.duplicate_filters),
            publisher=self.publisher, job_id=config.job_id, node_id=self.node_id)
        self.group = WorkerGroup(
            WorkerSpec(role=config.role, nproc=config.nproc, entrypoint=config.entrypoint,
                       max_restarts=config.max_restarts, run_id=config.job_id,
                       redis_url=config.endpoint.url, job_id=config.job_id,
                       log_dir=config.log_dir, shutdown_timeout=config.shutdown_timeout,
                       extra_env={**recorder.worker_env(config.flight_recorder, os.environ),
                                  **config.extra_env},
                       virtual_local_rank=config.virtual_local_rank,
                       numa_binding=config.numa_binding, preload=config.preload,
                       preload_auto=config.preload_auto,
                       stack_signal=config.stack_signal,
                       flight_recorder=config.flight_recorder,
                       logs_specs=_logs_specs_plugin(config),
                       signals_to_handle=",".join(signal.Signals(n).name
                                                  for n in config.signals_to_handle)),
            logs=self.node_logs, on_exit=self._on_worker_exit)
        #: Issue 13: the workers' Python stacks, on request and before any stop but success.
        self.stacks = StackCollector(self.group, self._client, config.job_id, self.node_id,
                                     self.host)
        self._stack_tasks: set[asyncio.Task[None]] = set()
        self._stacks_limit = stacks_limit()
        #: Issue 22: the workers' flight recorders, on request and before any stop.
        self.recorder = recorder.RecorderCollector(self.group, self._client, config.job_id,
                                                   self.node_id, self.host)
        self._collectives_limit = stacks_limit()
        #: Issue 22: slow ranks (stragglers.py); None with --straggler-interval 0 or no recorder.
        self.stragglers = StragglerWatch(
            self._client, config.job_id, config.straggler_interval, self.events.emit,
        ) if config.straggler_interval > 0 and config.flight_recorder > 0 else None
        self._evidence: dict[str, Any] | None = None
        self.sampler = ResourceSampler(self._client, config.job_id, self.node_id)
        self.records = JobRecords(self._client, config.job_id, self.node_logs.stream_key)
        self.retention = JobRetention(self._client, config.job_id, self.node_id,
                                      config.retention_s)
        # Cut off from Redis, this node freezes its workers before others may take their ranks.
        self.fence = Fence(self.rdzv, self.group, config.rendezvous.heartbeat_timeout, self.say)
        self.watchdog = Watchdog.from_environ(self.events.emit, self.say).attach(self.group)
        self.health = HealthCheck.for_agent(self)
        #: Issue 13: job-wide stall detection (stall.py); None with --stall-timeout 0.
        self.stall = StallWatch(
            self._client, self._mux.reader(), config.job_id, self.node_id, self.host,
            config.stall_timeout, config.on_stall, self.node_logs.last_output, self.events.emit,
        ) if config.stall_timeout > 0 else None
        #: Issue 22: restart storms, suspect nodes, rounds without progress (pattern_watch.py).
        self.patterns = PatternWatch(self._client, config.job_id, self.node_id,
                                     config.patterns, self.events.emit, self.say)
        self._lost_nodes: list[str] = []
        self._pattern_tasks: set[asyncio.Task[Patterns]] = set()
        self._round: _Round | None = None
        self._attempt = -1
        self._signal: asyncio.Future[int] | None = None
        self._actions: asyncio.Queue[Command] = asyncio.Queue()
        self._restarts_used = 0
        self.root_cause: dict[str, Any] | None = None
        self._members_seen: dict[tuple[str, int], bool] = {}
        #: The restart under way: when each of its phases ended (issue 23).
        self._restart_clock: RestartClock | None = None

    # -- terminal -------------------------------------------------------------------------
    def say(self, message: str) -> None:
        """One line on the agent's terminal. Messages quote what others wrote into Redis (an
        issuer, a root cause), so they go through the one text policy like any other output."""
        print(terminal_line(f"[elastic-agent] {message}", self._colour), file=self.term, flush=True)

    # -- entry point ----------------------------------------------------------------------
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._signal = loop.create_future()
        for sig in self.cfg.signals_to_handle:
            with contextlib.suppress(ValueError, RuntimeError, OSError):
                loop.add_signal_handler(sig, self._on_signal, sig)
        for bridge in self._bridges:
            bridge.attach(loop)
        self._mux.start()
        await self.publisher.start()
        background = [asyncio.create_task(self._read_commands(), name="commands"),
                      asyncio.create_task(self.sampler.run(), name="resources"),
                      asyncio.create_task(self.retention.run(), name="retention")]
        try:
            await self.watchdog.start()
            self.health.start()
            await self.group.prepare()  # --preload: the zygote imports during the rendezvous
            return await self._main()
        finally:
            for t in background:
                t.cancel()
            await self.group.stop()
            await self.group.close()
            self.watchdog.close()
            self.health.stop()
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.rdzv.shutdown)
            OOM.settle(await self.publisher.close(flush_timeout=5.0))
            with contextlib.suppress(Exception):
                # After this agent's last write, so what it wrote expires with the rest.
                await asyncio.wait_for(self.retention.finish(), 10.0)
            await self._mux.aclose()
            await self._mux.client.aclose()
            await self._client.aclose()
            for sig in self.cfg.signals_to_handle:
                with contextlib.suppress(ValueError, RuntimeError):
                    loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self._signal is not None and not self._signal.done():
            self.say(f"received {signal.Signals(sig).name}: stopping the workers and leaving "
                     f"job {self.cfg.job_id}")
            self._signal.set_result(sig)

    async def _main(self) -> int:
        await self._warn_eviction_policy()
        await self._write_meta()
        await self._reopen_if_requeued()
        self.events.emit(EventType.NODE_JOINED, host=self.host, addr=self.rdzv.local_addr,
                         pid=os.getpid(), nproc=self.cfg.nproc)
        while True:
            if await self.patterns.excluded():
                return self._leave_excluded()
            result = await self._race(asyncio.to_thread(self._rendezvous), during_rendezvous=True)
            if isinstance(result, Outcome):
                return await self._finish_without_workers(result)
            self._mark("rendezvous")
            await self._start(result)
            outcome, detail = await self._monitor()
            if outcome not in (Outcome.SUCCEEDED, Outcome.SIGNAL):
                self._restart_clock = RestartClock(outcome.value)
            code = await self._after(outcome, detail)
            if code is not None:
                return code
            self._mark("reported")

    def _leave_excluded(self) -> int:
        """--exclude-suspect-nodes named this node: it joins no further round (the others
        re-form without it when the rendezvous sees it leave, in ``run``'s cleanup)."""
        why = ("this node was in every failure of the job's last restarts (a suspect node) "
               "and --exclude-suspect-nodes leaves it out")
        self.say(f"leaving job {self.cfg.job_id}: {why}; exit status {DO_NOT_REQUEUE} "
                 "(do not requeue)")
        self.events.emit(EventType.NODE_EXCLUDED, host=self.host, reason=why)
        return DO_NOT_REQUEUE

    async def _round_ended(self, reason: str, nodes: list[str | None],
                           final: bool = False) -> Patterns:
        """This agent claimed the restart of the round that just ended: record it and report
        the restart patterns (pattern_watch.py). Off the restart's path (in the background,
        found patterns reported but not returned) unless the job ends here or a pattern can
        change what happens next (--on-restart-storm stop, --exclude-suspect-nodes)."""
        assert self._round is not None
        r, p = self._round, self.cfg.patterns
        # Two samples of the stall meter: a worker's start-up is not progress yet.
        grace = int(2 * self.stall.interval * 1000) if self.stall is not None else None
        record = self.patterns.record(
            r.result.round, reason, nodes, started_ms=r.started_ms, progress_grace_ms=grace,
            group_world_size=r.result.group_world_size, min_nodes=self.cfg.rendezvous.min_nodes)
        if final or p.on_storm == "stop" or p.exclude_suspects:
            return await record
        task = asyncio.create_task(record, name="restart-patterns")
        self._pattern_tasks.add(task)  # a reference until it is done (asyncio keeps none)
        task.add_done_callback(self._pattern_tasks.discard)
        return Patterns()

    def _storm_stops(self, found: Patterns) -> bool:
        return found.storm is not None and self.cfg.patterns.on_storm == "stop"

    def _storm_cause(self, found: Patterns, cause: dict[str, Any] | None) -> dict[str, Any]:
        message = f"{found.summary()} (--on-restart-storm stop)"
        return {**(cause or {}), "reason": "restart_storm", "message": message}

    def _mark(self, phase: str, at: float | None = None) -> None:
        if self._restart_clock is not None:
            self._restart_clock.mark(phase, at)

    # -- rendezvous -----------------------------------------------------------------------
    def _rendezvous(self) -> RendezvousResult | Outcome:
        s = self.cfg.rendezvous
        self.say(f"job {self.cfg.job_id}: joining the rendezvous on {self.cfg.endpoint.display} "
                 f"(nodes {s.min_nodes}..{s.max_nodes})")
        deadline = time.monotonic() + s.join_timeout
        delay = 0.05
        while True:
            try:
                return self.rdzv.next_rendezvous(progress=self._progress)
            except RendezvousClosedError:
                return Outcome.CLOSED
            except RendezvousConnectionError as exc:
                # A failure during an outage waits for Redis, up to the join timeout.
                if time.monotonic() > deadline or self._signal_seen():
                    raise
                if delay == 0.05 and not isinstance(exc, RendezvousOutOfMemoryError):
                    self.say(f"{exc}; retrying until Redis is back "
                             f"(up to {s.join_timeout:g} s)")
                time.sleep(delay)  # this runs in the rendezvous thread: backoff between tries
                delay = min(delay * 2, 1.0)

    def _signal_seen(self) -> bool:
        return self._signal is not None and self._signal.done()

    async def _redis(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run a Redis call the job cannot go on without, riding out an outage for up to the
        join timeout (workers keep running meanwhile; only this decision waits)."""
        deadline = time.monotonic() + self.cfg.rendezvous.join_timeout
        delay = 0.05
        while True:
            raise_if_cancelled()
            try:
                value = await call()
                OOM.accepted()
                return value
            except _OUTAGE as exc:
                oom = isinstance(exc, (redis.OutOfMemoryError, RendezvousOutOfMemoryError))
                if isinstance(exc, redis.OutOfMemoryError):
                    OOM.refused()  # which reports it, once for every writer
                if time.monotonic() > deadline:
                    raise explain_error(exc, self.cfg.endpoint.display) from None
                if delay == 0.05 and not oom:
                    self.say(f"Redis unreachable while {what}; retrying until it is back")
                await asyncio.sleep(delay)  # backoff between reconnection attempts
                delay = min(delay * 2, 1.0)

    def _progress(self, p: RendezvousProgress) -> None:
        if p.status == "waiting":
            self.say(f"round {p.round} is running without this node; waiting for the next "
                     f"round (join timeout in {p.join_left:.0f} s)")
            return
        need = max(0, p.min_nodes - p.joined_count)
        parts = [f"round {p.round}: {p.joined_count} of {p.min_nodes}..{p.max_nodes} nodes "
                 f"joined"]
        if need:
            parts.append(f"waiting for {need} more")
        if p.missing_count:
            parts.append(f"{p.missing_count} of the previous round's nodes not back yet")
        if p.last_call_left is not None:
            parts.append(f"last call ends in {p.last_call_left:.0f} s")
        parts.append(f"join timeout in {p.join_left:.0f} s")
        self.say("; ".join(parts))

    async def _race(self, work: Awaitable[Any], during_rendezvous: bool = False) -> Any:
        """Await ``work`` unless a signal or a stop command comes first."""
        task = asyncio.ensure_future(work)
        assert self._signal is not None
        while True:
            action = asyncio.ensure_future(self._actions.get())
            done, _ = await asyncio.wait({task, self._signal, action},
                                         return_when=asyncio.FIRST_COMPLETED)
            if action in done:
                cmd = action.result()
                if cmd.type == CommandType.STOP:
                    await self._close_job("stopped", command=cmd)
                # A restart while no workers run is already done; keep waiting.
                if not task.done():
                    continue
            else:
                action.cancel()
            if self._signal.done() and not task.done():
                if during_rendezvous:
                    await asyncio.to_thread(self.rdzv.shutdown)  # wakes the rendezvous thread
                    with contextlib.suppress(Exception):
                        await task
                else:
                    task.cancel()
                return Outcome.SIGNAL
            return task.result()

    # -- start ----------------------------------------------------------------------------
    async def _start(self, result: RendezvousResult) -> None:
        # attempt_N is the rendezvous round, not torch's restart count: a restart command or
        # a membership change (which torch does not count) gets a new directory instead of
        # deleting the previous attempt's logs, as torch's DefaultLogsSpecs does (rmtree).
        self._attempt = result.round
        restarts = protocol.decode_counter(await self._redis(
            "reading the restart count", lambda: self._client.get(self.keys.restarts)),
            self.keys.restarts)
        self._restarts_used = restarts
        self.records.note_restarts(restarts)
        world = result.total_workers or self.cfg.nproc * result.group_world_size
        base = result.base_rank if result.total_workers else result.group_rank * self.cfg.nproc
        self.stacks.world_size = self.recorder.world_size = world
        master_addr, master_port = result.master_addr, result.master_port
        static = self.cfg.static
        if static is not None:
            if result.group_rank != static.node_rank:
                await asyncio.to_thread(self.rdzv.shutdown)
                raise RendezvousError(
                    f"--node-rank {static.node_rank} is taken by another node of job "
                    f"{self.cfg.job_id!r}; give every node its own --node-rank below --nnodes")
            master_addr, master_port = static.master_addr, static.master_port
        assignment = RankAssignment(
            group_rank=result.group_rank, group_world_size=result.group_world_size,
            world_size=world, base_rank=base, master_addr=master_addr,
            master_port=master_port, restart_count=restarts, attempt=self._attempt)
        self._round = _Round(result, self._attempt, restarts, result.completed_ms, world)
        if self.records.created_ms is None:
            created = await self._redis("reading the job's creation time", lambda: (
                self._client.hget(self.keys.meta, "created_ms")))
            if created is not None and created.isdigit():
                self.records.created_ms = int(created)
                self.records.note_meta({"created_ms": int(created)})
        self._announce_round()
        self.say(f"round {result.round} complete: group rank {result.group_rank} of "
                 f"{result.group_world_size}, global ranks {base}..{base + self.cfg.nproc - 1} "
                 f"of {world}; restarts used {restarts}/{self.cfg.max_restarts}")
        await self.group.start(assignment)
        for phase, at in self.group.start_marks.items():
            self._mark(phase, at)
        self.sampler.track({w.global_rank: w.pid for w in self.group.workers})
        clock, self._restart_clock = self._restart_clock, None
        self._announce_workers(**({"restart": clock.record()} if clock is not None else {}))

    def _announce_round(self, **extra: Any) -> None:
        """The round's record for readers, written by group rank 0 (once per round, and again
        when Redis lost it)."""
        assert self._round is not None
        result = self._round.result
        info = self.rdzv.last_round_info  # group rank 0 alone holds the whole round
        if result.group_rank == 0 and info is not None:
            self.events.emit(EventType.RENDEZVOUS_COMPLETE, round=result.round,
                             world_size=self._round.world_size,
                             group_world_size=result.group_world_size,
                             nodes=[{"node": n["node"], "host": n["host"],
                                     "group_rank": n["group_rank"], "nproc": n.get("nproc", 0)}
                                    for n in info.nodes], **extra)

    def _announce_workers(self, **extra: Any) -> None:
        assert self._round is not None
        workers = self.group.workers
        self.events.emit(EventType.WORKERS_STARTED, round=self._round.result.round,
                         attempt=self._attempt, restart_count=self._round.restart_count,
                         ranks=[w.global_rank for w in workers],
                         local_ranks=[w.local_rank for w in workers],
                         pids=[w.pid for w in workers], host=self.host, **extra)

    def _on_worker_exit(self, e: WorkerExit) -> None:
        e = self.watchdog.explain(e)  # a watchdog kill: the timer is the message
        data = e.event_data()
        data["attempt"] = self._attempt
        data["round"] = self._round.result.round if self._round else None
        data["host"] = self.host
        data["error_file_path"] = e.error_file_path
        if data.get("error_file"):
            data["error_file"] = truncate_json(data["error_file"], 64 * 1024)
        self.events.emit(EventType.WORKER_EXITED, **data)

    # -- monitor --------------------------------------------------------------------------
    async def _monitor(self) -> tuple[Outcome, Any]:
        assert self._signal is not None
        group = asyncio.ensure_future(self.group.wait())
        watch = asyncio.ensure_future(self._watch_membership())
        fence = asyncio.ensure_future(self.fence.watch(self._round.result.group_world_size))
        stalled = asyncio.ensure_future(self._watch_stall())
        slow = asyncio.ensure_future(self._watch_stragglers())
        try:
            while True:
                action = asyncio.ensure_future(self._actions.get())
                done, _ = await asyncio.wait({group, watch, action, self._signal, stalled},
                                             return_when=asyncio.FIRST_COMPLETED)
                if action in done:
                    cmd = action.result()
                    if cmd.type == CommandType.STOP:
                        return Outcome.STOP, cmd
                    if cmd.type == CommandType.RESTART and self._restart_still_due(cmd):
                        return Outcome.RESTART, cmd
                    continue
                action.cancel()
                if self._signal.done():
                    return Outcome.SIGNAL, self._signal.result()
                if group in done:
                    res: GroupResult = group.result()
                    if res.state == WorkerState.SUCCEEDED:
                        return Outcome.SUCCEEDED, res
                    if (self.cfg.slurm is not None and scheduler.killed_by_a_signal(res.failures)
                            and await scheduler.own_signal_soon(self._signal)):
                        return Outcome.SIGNAL, self._signal.result()  # SLURM's, not a failure
                    return Outcome.FAILED, res
                if stalled in done:
                    return Outcome.STALLED, stalled.result()
                return watch.result()
        finally:
            for t in (group, watch, fence, stalled, slow):
                t.cancel()

    async def _watch_stall(self) -> Stall:
        """Returns a stall this agent claimed and reported whose policy is restart or stop."""
        if self.stall is None:
            await asyncio.get_running_loop().create_future()  # off: never
        assert self.stall is not None and self._round is not None
        r = self._round
        return await self.stall.watch(r.result.round, r.started_ms, lambda: self.group.workers)

    async def _watch_stragglers(self) -> None:
        """Runs until cancelled with the monitor (issue 22)."""
        if self.stragglers is None or self._round is None:
            return
        r = self._round.result
        await self.stragglers.watch(r.round, r.group_rank, lambda: recorder.ask_all(
            self.group.recorder_targets(), "sample"))

    def _restart_still_due(self, cmd: Command) -> bool:
        # A restart issued before the current round formed has been done already (another
        # node acted on it first and this node re-formed with it).
        assert self._round is not None
        return protocol.stream_id_ms(cmd.entry_id) >= self._round.started_ms

    async def _watch_membership(self) -> tuple[Outcome, Any]:
        """Returns when the job wants a new round or has ended; never because of an outage."""
        assert self._round is not None
        my_round = self._round.result.round
        # The transitions only: a late node is seen by the summary within an interval.
        # Following every join too would hand each of N agents every one of N joins when a
        # job re-forms: N^2 entries.
        streams = {self.keys.rdzv_notify: "$"}
        for key in streams:
            with contextlib.suppress(redis.RedisError, OSError):
                last = await self._client.xrevrange(key, count=1)
                streams[key] = last[0][0].decode() if last else "0-0"
        grace_until = 0.0
        interval = self.cfg.rendezvous.keep_alive_interval
        cadence = Cadence(interval)  # the first summary now, then at this node's own phase
        reseed = ReseedSchedule(self.rdzv)
        while True:
            raise_if_cancelled()
            try:
                if reseed.due():
                    if await self.records.reseed():
                        # Redis came back empty: readers get the job back, the workers go on.
                        self.say("Redis lost the job's records (restarted empty?); "
                                 "putting them back")
                        await asyncio.to_thread(self.rdzv.heartbeat)  # the round, at once
                        self._announce_round(restored=True)
                        self._announce_workers(restored=True)
                    reseed.done()
                # This node's beat rides on the summary: one script call per interval.
                m, newly_lost = await asyncio.to_thread(self.rdzv.lost_since_last_check, True)
                if reseed.restored():
                    continue  # the beat found Redis empty: the records go back at once
                in_grace = time.monotonic() < grace_until
                for node in newly_lost:
                    self.events.emit(EventType.NODE_LOST, lost_node=node,
                                     host=node.rsplit("-", 2)[0])
                if m.closed:
                    return Outcome.CLOSED, None
                if m.round > my_round:
                    return Outcome.REFORM, _NEWER_ROUND
                if m.is_member:
                    self.fence.thaw()  # frozen workers go on if this node's beats get through
                if self.rdzv.waiting_count(m, include_lost=not in_grace) > 0:
                    self._lost_nodes = list(m.lost) if not in_grace else []
                    why = []
                    if m.lost and not in_grace:
                        why.append("lost: " + ", ".join(m.lost))
                    if m.left:
                        why.append("left: " + ", ".join(m.left))
                    if m.waiting:
                        why.append("waiting: " + ", ".join(m.waiting))
                    return Outcome.REFORM, "membership changed (" + "; ".join(why) + ")"
                reply = await self._reader.xread(
                    streams, count=pages.PAGE, block=max(1, int(cadence.until_next() * 1000)))
                for key, entries in reply or []:
                    streams[key.decode()] = entries[-1][0].decode()
                    if opens_a_round(entries):
                        return Outcome.REFORM, _NEWER_ROUND
            except Exception as exc:
                log.debug("membership watch: %s", exc)
                # Right after an outage every heartbeat looks stale: give nodes one heartbeat
                # timeout to check in before anyone is declared lost.
                grace_until = time.monotonic() + self.cfg.rendezvous.heartbeat_timeout
                await asyncio.sleep(min(1.0, interval))  # backoff while Redis is away

    # -- after the round ------------------------------------------------------------------
    async def _after(self, outcome: Outcome, detail: Any) -> int | None:
        assert self._round is not None
        if outcome == Outcome.SUCCEEDED:
            return await self._succeed()
        if outcome == Outcome.SIGNAL:
            return await self._leave_on_signal(int(detail))
        if outcome == Outcome.STALLED:
            return await self._on_stall(detail)
        await self._stop_workers(outcome.value)
        if outcome == Outcome.FAILED:
            return await self._on_failure(detail)
        if outcome == Outcome.REFORM:
            self.say(f"re-forming the worker group: {detail}")
            if detail != _NEWER_ROUND and await self._claim(
                    f"reform_claim:{self._round.result.round}"):
                if self._lost_nodes:  # a lost node is a round end; a late joiner is not
                    await self._round_ended("lost", list(self._lost_nodes))
                self.events.emit(EventType.RESTARTING, reason="membership", detail=detail,
                                 restarts_used=self._restarts_used,
                                 max_restarts=self.cfg.max_restarts)
            return None
        if outcome == Outcome.RESTART:
            cmd: Command = detail
            self.say(f"restart requested by {cmd.issuer}")
            self.events.emit(EventType.RESTARTING, reason="command", command_id=cmd.id,
                             restarts_used=self._restarts_used,
                             max_restarts=self.cfg.max_restarts)
            return None
        if outcome == Outcome.STOP:
            await self._close_job("stopped", command=detail)
            return EXIT_STOPPED
        return await self._ended_elsewhere()

    async def _stop_workers(self, reason: str) -> None:
        ranks = [w.global_rank for w in self.group.workers]
        # Evidence before the kill: whatever stops the workers, the survivors' stacks are
        # captured first (2 s at most), so a restart never destroys where they were.
        self._evidence, collectives = await asyncio.gather(
            self.stacks.evidence(f"stop-{self._attempt}"),
            self.recorder.evidence(f"stop-{self._attempt}"))
        self._mark("evidence")
        extra: dict[str, Any] = {"stacks": self._evidence} if self._evidence else {}
        if collectives:
            extra["collectives"] = collectives
        self.fence.kill()  # frozen workers never run again: others may hold their ranks
        await self.group.stop()
        self._mark("stopped")
        self.events.emit(EventType.WORKERS_STOPPED, ranks=ranks, reason=reason,
                         attempt=self._attempt, **extra)

    def _restarts_shown(self) -> int:
        """Restarts used, for people: the counter also counts the failure that found none
        left (max + 1), which is no restart ("1/0 used" was a lie)."""
        return min(self._restarts_used, self.cfg.max_restarts)

    async def _claim_restart(self, rnd: int) -> tuple[bool, int]:
        """Count the restart of round ``rnd``, once across the job: (claimed by us, used)."""
        try:
            claimed, used = await self._redis("counting the restart", lambda: self._client.eval(
                _CLAIM_RESTART, 2, self.keys.restarts, self.keys.meta, rnd,
                self.records.restarts_seen))
        except redis.ResponseError as exc:  # INCR of a counter that is not a number
            raise protocol.ProtocolError(
                f"{self.keys.restarts} cannot count restarts ({exc}): repair or delete that key"
            ) from None
        used = protocol.decode_counter(used, self.keys.restarts)
        self.records.note_restarts(used)
        self.records.note_meta({f"restart_claim:{rnd}": 1})
        self._restarts_used = used
        return bool(claimed), used

    async def _on_stall(self, stall: Stall) -> int | None:
        """--on-stall restart or stop; the stall was reported already (stall.py)."""
        assert self._round is not None
        cause = {**stall.cause, "node": self.node_id}
        self.root_cause = cause
        self.say(f"{cause['message']} (--on-stall {self.cfg.on_stall})")
        used, found = self._restarts_used, Patterns()
        if self.cfg.on_stall == "restart":
            claimed, used = await self._claim_restart(self._round.result.round)
            if claimed:
                found = await self._round_ended("stalled", [], final=used > self.cfg.max_restarts)
            if self._storm_stops(found):
                cause = self.root_cause = self._storm_cause(found, cause)
            elif claimed and used <= self.cfg.max_restarts:
                self.events.emit(EventType.RESTARTING, reason="stalled", detail=cause["message"],
                                 restarts_used=used, max_restarts=self.cfg.max_restarts)
        if self.cfg.on_stall == "stop" or used > self.cfg.max_restarts or self._storm_stops(found):
            # The job ends before its workers do: the other nodes' workers fail once these
            # are gone, and their agents must find the job over, not restart it.
            await self._close_job("failed", cause=cause)
            await self._stop_workers("stalled")
            self.print_summary(cause, failed=True)
            return await self.patterns.failed_status()
        await self._stop_workers("stalled")
        self.say(f"restarting the stalled worker group ({used}/{self.cfg.max_restarts} "
                 "restarts used)")
        return None

    async def _on_failure(self, res: GroupResult) -> int | None:
        assert self._round is not None
        res = self.watchdog.explain_result(res)
        rnd = self._round.result.round
        claimed, used = await self._claim_restart(rnd)
        cause = await self._root_cause(res)
        self.root_cause = cause
        found = Patterns()
        if claimed:
            extra = {"stacks": self._evidence} if self._evidence else {}
            self.events.emit(EventType.GROUP_FAILED, root_cause=cause, round=rnd,
                             failures=[failure_dict(e, self.node_id, self.host)
                                       for e in res.failures], **extra)
            found = await self._round_ended("failure", [cause.get("node") if cause else None],
                                            final=used > self.cfg.max_restarts)
        if used > self.cfg.max_restarts or self._storm_stops(found):
            if self._storm_stops(found):
                cause = self.root_cause = self._storm_cause(found, cause)
            await self._close_job("failed", cause=cause)
            self.print_summary(cause, failed=True)
            return await self.patterns.failed_status()
        if claimed:
            self.events.emit(EventType.RESTARTING, reason="failure", restarts_used=used,
                             max_restarts=self.cfg.max_restarts)
            # Written before this node opens the next round: the nodes waiting at the exit
            # barrier leave it on this event, with its reason, not on the round's 'open'.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.publisher.flush(), timeout=1.0)
        self.say(f"worker group failed ({cause.get('message', '?') if cause else '?'}); "
                 f"restarting ({used}/{self.cfg.max_restarts} restarts used)")
        return None

    async def _root_cause(self, res: GroupResult) -> dict[str, Any]:
        """The earliest failure across all nodes of this round, by Redis server time."""
        assert self._round is not None
        local = res.root_cause
        fallback = failure_dict(local, self.node_id, self.host) if local else {}
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.publisher.flush(), timeout=3.0)
        # A page at a time (pages.py), never the whole round at once: anyone who can write
        # the event stream can make each entry a megabyte. The earliest failure ends the read.
        entries = pages.forward(self._client, self.keys.events, f"{self._round.started_ms}-0")
        # Only a member of this round can be its root cause: anyone who can write the event
        # stream could otherwise name a failure of their own choosing.
        async for entry_id, fields in pages.until_unreachable(entries):
            ev = protocol.decode_event(entry_id, fields)
            if (ev is None or ev.type != EventType.WORKER_EXITED
                    or not await self._member(ev.node, self._round.result.round)):
                continue
            d = ev.data
            if (type(d.get("exit_code")) is not int or d["exit_code"] == 0 or d.get("stopping")
                    or not protocol.is_rank(d.get("rank"))):
                continue
            if d.get("round") != self._round.result.round:
                continue
            cause = {k: d.get(k) for k in ("rank", "local_rank", "pid", "exit_code", "signal",
                                           "message", "host", "timestamp")}
            cause["node"] = ev.node
            cause["server_ms"] = ev.server_ms
            cause["traceback"] = traceback_of(d.get("error_file"))
            # the path only when the worker wrote the file (torch: "<N/A>" otherwise)
            cause["error_file_path"] = d.get("error_file_path", "") if d.get("error_file") else ""
            return cause
        return fallback

    async def _succeed(self) -> int | None:
        assert self._round is not None
        r = self._round.result
        self.say(f"workers finished; waiting at the exit barrier for {r.group_world_size} nodes")
        left = await self._exit_barrier(r)
        await self.group.stop()
        if left is not None:
            outcome, detail = left
            if isinstance(detail, FailedElsewhere):
                # The failing node reports the failure and claims the restart; this node only
                # joins the next round (or learns there that the job is over).
                self.say(f"leaving the exit barrier: {detail}; rejoining the rendezvous")
                return None
            self.say(f"leaving the exit barrier ({outcome.value})")
            return await self._after(outcome, detail)
        try:
            won = await self._claim_final("succeeded")
        except RedisUnavailableError as exc:
            # The workers succeeded: that is the job's outcome, recorded or not.
            self.say(f"the workers succeeded but the job's end could not be recorded: {exc}")
            won = False
        if won:
            self.events.emit(EventType.JOB_SUCCEEDED, restarts_used=self._restarts_used)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.rdzv.set_closed)
        self.print_summary(self.root_cause, failed=False)
        return 0

    async def _exit_barrier(self, r: RendezvousResult) -> tuple[Outcome, Any] | None:
        """Wait at round ``r``'s exit barrier. ``None`` once it filled (or timed out: the job
        is done here either way); else why this node must leave it now. A node that waited
        out the whole timeout while another node failed would hold up the restart or the
        job's end for that long."""
        assert self._signal is not None
        leave = threading.Event()
        reader = self._mux.reader()
        store = LeavableStore.on(
            self._bridges[0], SyncBridge(reader, priority=True, loop=asyncio.get_running_loop()),
            self.cfg.job_id, f"r{r.round}", leave)
        passing = asyncio.ensure_future(asyncio.to_thread(
            barrier, store, r.group_world_size, "exit", self.cfg.exit_barrier_timeout,
            r.group_rank))
        # The failure first: when both have come, its event says why (the round's 'open' that
        # the failing node sends after it does not).
        watchers = [asyncio.ensure_future(self._watch_failures(r)),
                    asyncio.ensure_future(self._watch_membership())]
        reason: tuple[Outcome, Any] | None = None
        try:
            while True:
                action = asyncio.ensure_future(self._actions.get())
                done, _ = await asyncio.wait({passing, action, self._signal, *watchers},
                                             return_when=asyncio.FIRST_COMPLETED)
                if action not in done:
                    action.cancel()
                if passing in done:
                    break
                if action in done:
                    cmd = action.result()
                    if cmd.type == CommandType.STOP:
                        reason = (Outcome.STOP, cmd)
                        break
                    # A restart is for the nodes still running: the round they open next
                    # brings this node along (the membership watch sees it).
                    continue
                if self._signal.done():
                    reason = (Outcome.SIGNAL, self._signal.result())
                else:
                    reason = next(w for w in watchers if w.done()).result()
                break
        finally:
            leave.set()  # the barrier's thread notices within one slice
            for w in watchers:
                w.cancel()
            try:
                await passing
            except BarrierLeft:
                pass
            except StoreTimeoutError as exc:
                self.say(f"exit barrier: {exc}; exiting anyway")
                reason = None
            else:
                reason = None  # it filled: every node succeeded, whatever else came in
            finally:
                store.close()
                reader.close()
        return reason

    async def _watch_failures(self, r: RendezvousResult) -> tuple[Outcome, Any]:
        """Returns when another node of round ``r`` reports that its workers failed, or that
        the job ended. The event comes before the failing node opens the next round (it
        first stops its workers and finds the root cause), so waiting nodes move at once."""
        assert self._round is not None
        since = self._round.started_ms
        last = f"{max(0, since - 1)}-0"  # XREAD is exclusive: start just before the round
        while True:
            raise_if_cancelled()
            try:
                reply = await self._reader.xread({self.keys.events: last}, count=pages.PAGE,
                                                 block=1000)
            except (redis.RedisError, OSError) as exc:
                log.debug("exit barrier event watch: %s", exc)
                await asyncio.sleep(0.5)  # backoff while Redis is away
                continue
            for _key, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                    ev = protocol.decode_event(entry_id, fields)
                    # Only a member of this round speaks for it (anyone who can write the
                    # event stream could otherwise send every node away from the barrier).
                    if (ev is None or ev.server_ms < since
                            or not await self._member(ev.node, r.round)):
                        continue
                    if ev.type == EventType.GROUP_FAILED and ev.data.get("round") == r.round:
                        return Outcome.REFORM, FailedElsewhere(ev.node, ev.data.get("root_cause"))
                    if ev.type in (EventType.JOB_FAILED, EventType.JOB_STOPPED):
                        return Outcome.CLOSED, None

    async def _leave_on_signal(self, sig: int) -> int:
        await self._stop_workers("signal")
        if scheduler.is_scheduler_stop(self.cfg.slurm is not None, sig):
            await self._close_by_scheduler(sig)
        self.events.emit(EventType.NODE_LEFT, host=self.host,
                         reason=f"signal {signal.Signals(sig).name}")
        await asyncio.to_thread(self.rdzv.shutdown)
        return 128 + sig

    async def _finish_without_workers(self, outcome: Outcome) -> int:
        if outcome == Outcome.SIGNAL:
            assert self._signal is not None
            sig = self._signal.result()
            if scheduler.is_scheduler_stop(self.cfg.slurm is not None, sig):
                await self._close_by_scheduler(sig)
            self.events.emit(EventType.NODE_LEFT, host=self.host,
                             reason=f"signal {signal.Signals(sig).name}")
            return 128 + sig
        return await self._ended_elsewhere()

    async def _ended_elsewhere(self) -> int:
        final = await self._redis("reading the job's state",
                                  lambda: self._client.hget(self.keys.meta, "final_state"))
        state = final.decode() if final else "closed"
        self.say(f"job {self.cfg.job_id} {state} elsewhere; exiting")
        if state == "failed":
            self.print_summary(self.root_cause or await self._last_root_cause(), failed=True)
            return await self.patterns.failed_status()
        if state == "stopped":
            return EXIT_STOPPED
        return 0 if state == "succeeded" else 1

    async def _last_root_cause(self) -> dict[str, Any] | None:
        with contextlib.suppress(redis.RedisError, OSError):
            async for entry_id, fields in pages.backward(self._client, self.keys.events,
                                                         limit=500):
                ev = protocol.decode_event(entry_id, fields)
                if ev is None or ev.type not in (EventType.JOB_FAILED, EventType.GROUP_FAILED):
                    continue
                if self._round is not None and not await self._member(
                        ev.node, self._round.result.round):
                    continue
                cause = ev.data.get("root_cause")
                if isinstance(cause, dict):
                    return cause
        return None

    async def _member(self, node: str, round_: int) -> bool:
        """Whether ``node`` is a member of round ``round_``: one HGET of its assignment, so
        that checking who speaks for a round never reads the whole round (O(N) bytes)."""
        key = (node, round_)
        known = self._members_seen.get(key)
        if known is None:
            raw = await self._client.hget(self.keys.rdzv_assign, node)
            known = bool(raw) and raw.split(b" ", 1)[0] == str(round_).encode()
            if len(self._members_seen) > 4096:
                self._members_seen.clear()
            self._members_seen[key] = known
        return known

    async def _claim(self, field: str) -> bool:
        """True for exactly one agent of the job per ``field``: the one that reports it."""
        won = bool(await self._redis("claiming " + field, lambda: self._client.hsetnx(
            self.keys.meta, field, 1)))
        self.records.note_meta({field: 1})  # claimed, by us or another: never twice
        return won

    async def _claim_final(self, state: str) -> bool:
        won = bool(await self._redis("recording the job's end", lambda: self._client.hsetnx(
            self.keys.meta, "final_state", state)))
        if won:
            self.records.note_meta({"final_state": state})
        return won

    async def _close_job(self, state: str, *, command: Command | None = None,
                         cause: dict[str, Any] | None = None) -> None:
        if await self._claim_final(state):
            if state == "stopped" and command is not None:
                self.events.emit(EventType.JOB_STOPPED, command_id=command.id,
                                 issuer=command.issuer)
                self.say(f"job {self.cfg.job_id} stopped by {command.issuer}")
            elif state == "failed":
                self.events.emit(EventType.JOB_FAILED, root_cause=cause,
                                 restarts_used=self._restarts_used,
                                 max_restarts=self.cfg.max_restarts)
        await self._redis("closing the rendezvous", lambda: asyncio.to_thread(self.rdzv.set_closed))

    async def _close_by_scheduler(self, sig: int) -> None:
        """SLURM stopped the job (scheduler.py): it ends as stopped, by the scheduler."""
        if await self._claim_final("stopped"):
            self.events.emit(EventType.JOB_STOPPED, **scheduler.stopped_fields(sig),
                             restarts_used=self._restarts_used,
                             max_restarts=self.cfg.max_restarts)
            self.say(f"job {self.cfg.job_id} stopped by the scheduler "
                     f"({signal.Signals(sig).name})")
        await self._redis("closing the rendezvous", lambda: asyncio.to_thread(self.rdzv.set_closed))

    async def _reopen_if_requeued(self) -> None:
        """A job SLURM requeued comes back under its id: the first agent reopens it."""
        step = self.cfg.slurm
        if step is None or step.restart_count < 1:
            return
        if await self._redis("reopening the requeued job", lambda: scheduler.reopen(
                self._client, self.keys, step.restart_count)):
            self.events.emit(EventType.JOB_REQUEUED, scheduler="slurm",
                             slurm_restart_count=step.restart_count)
            self.say(f"job {self.cfg.job_id} requeued by SLURM (restart "
                     f"{step.restart_count}): its history and restart count continue")

    # -- commands -------------------------------------------------------------------------
    async def _read_commands(self) -> None:
        """Acts on the job's commands for the agent's whole life: the loop is restarted, and
        says so, should anything escape it."""
        reader = CommandReader(self._mux.reader(), self.cfg.job_id)
        await keep_running("command reader", lambda: self._command_loop(reader), self.say,
                           progress=lambda: reader.handled)

    async def _command_loop(self, reader: CommandReader) -> None:
        async for cmd in reader:
            if isinstance(cmd, Rejected):
                self._ack(cmd.id, "rejected", cmd.reason)
                continue
            try:
                await self._handle_command(cmd)
            except Exception as exc:
                self._ack(cmd.id, "rejected", f"{type(exc).__name__}: {exc}")

    async def _handle_command(self, cmd: Command) -> None:
        if cmd.type == CommandType.STACKS:
            if wait := self._stacks_limit.take():
                self._ack(cmd.id, "rejected", stacks_refused(wait))
                return
            # Read-only and up to 2 s: answered beside the command loop, which stays free
            # for a stop that comes meanwhile.
            task = asyncio.create_task(self._answer_stacks(cmd), name="stacks")
            self._stack_tasks.add(task)
            task.add_done_callback(self._stack_tasks.discard)
            return
        if cmd.type == CommandType.COLLECTIVES:
            if wait := self._collectives_limit.take():
                self._ack(cmd.id, "rejected", stacks_refused(wait))
                return
            mine = {w.global_rank for w in self.group.workers} if self._round else set()
            task = asyncio.create_task(self.recorder.answer(cmd, mine, self._ack),
                                       name="collectives")
            self._stack_tasks.add(task)
            task.add_done_callback(self._stack_tasks.discard)
            return
        if cmd.type == CommandType.SIGNAL:
            # decode_command checked the types and the allow-list; the world is ours to know.
            rank, sig = cmd.args["rank"], cmd.args.get("signal", "SIGTERM")
            world = self._round.world_size if self._round else 0
            if rank >= world:
                self._ack(cmd.id, "rejected", f"rank {rank} is not in the job (world size {world})")
                return
            mine = {w.global_rank for w in self.group.workers}
            if rank not in mine:
                self._ack(cmd.id, "accepted", f"rank {rank} is not on this node")
                return
            sent = await self.group.signal_rank(rank, sig)
            self._ack(cmd.id, "accepted" if sent else "rejected",
                      f"{sig} sent to rank {rank}" if sent else f"rank {rank} is not running")
            return
        self._ack(cmd.id, "accepted", f"{cmd.type} from {cmd.issuer}")
        await self._actions.put(cmd)

    async def _answer_stacks(self, cmd: Command) -> None:
        """Publish the stacks of this node's workers (or of ``args.rank`` if it is here)
        under the command's id, then ack it ``done``."""
        rank = cmd.args.get("rank")
        mine = {w.global_rank for w in self.group.workers}
        if self._round is None or not mine:
            self._ack(cmd.id, "done", "no workers on this node")
            return
        if rank is not None and rank not in mine:
            self._ack(cmd.id, "done", f"rank {rank} is not on this node")
            return
        try:
            found = await self.stacks.capture_local(ranks=None if rank is None else [rank])
            await self.stacks.publish(cmd.id, found)
        except (redis.RedisError, OSError) as exc:
            self._ack(cmd.id, "rejected", f"stacks not published: {exc}")
            return
        answered = sum(1 for s in found if s.threads)
        self._ack(cmd.id, "done", f"stacks of {answered} of {len(found)} ranks published")

    def _ack(self, command_id: str, status: str, reason: str) -> None:
        self.events.emit(EventType.COMMAND_ACK, command_id=command_id, status=status,
                         reason=reason, host=self.host)

    async def _warn_eviction_policy(self) -> None:
        """Once at start: an eviction policy may drop the keys a running job needs."""
        try:
            # Every primary of a cluster: each has its own policy.
            replies = await config_get_each(self._client, "maxmemory*")
        except (redis.RedisError, OSError):
            return  # CONFIG is often refused to application users: nothing to say then
        warning = next((w for w in map(eviction_policy_warning, replies) if w), None)
        if warning:
            self.say(f"warning: {warning}")

    async def _write_meta(self) -> None:
        settings = {"max_restarts": self.cfg.max_restarts, "nproc_per_node": self.cfg.nproc,
                    "entrypoint": json.dumps(self.cfg.entrypoint)}
        await self._redis("writing the job's settings", lambda: self._client.hset(
            self.keys.meta, mapping=settings))
        self.records.note_meta({**settings, "min_nodes": self.cfg.rendezvous.min_nodes,
                                "max_nodes": self.cfg.rendezvous.max_nodes})

    # -- summary --------------------------------------------------------------------------
    def print_summary(self, cause: dict[str, Any] | None, failed: bool) -> None:
        script = run_summary.script_name(self.cfg.entrypoint)
        lines = run_summary.summary_lines(script, self.cfg.job_id, cause, failed,
                                          self._restarts_shown(), self.cfg.max_restarts)
        # Each line on its own through the policy: a newline inside a quoted value is escaped.
        print("\n".join(terminal_line(line, self._colour) for line in lines), file=self.term,
              flush=True)
