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

This module is the loop, the top of the agent. Its other jobs are parts beside it, mixed
into :class:`ElasticAgent` and written against agent_base.py (the outcomes, the shared state
and helpers): membership.py (the rendezvous and the membership watch), restart_path.py
(stopping the workers with their evidence, counting the restart, the root cause),
job_end.py (the exit barrier, leaving, the job's end in Redis) and command_handling.py (the
job's commands).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sys
from collections.abc import Awaitable
from typing import IO, Any

import redis
import redis.asyncio as aioredis

from ..coordination.rendezvous.drivers import RedisRendezvous
from ..coordination.rendezvous.types import RendezvousError, RendezvousResult
from ..coordination.transport import stream_mux
from ..coordination.transport.cluster import config_get_each
from ..coordination.transport.connection import make_async_client
from ..coordination.transport.pressure import OOM, eviction_policy_warning
from ..coordination.transport.stream_mux import StreamMux
from ..coordination.wire import protocol
from ..coordination.wire.command_records import Command, CommandType
from ..coordination.wire.event_records import EventType
from ..coordination.wire.keyspace import JobKeys
from . import run_summary
from .agent_base import EXIT_STOPPED, NEWER_ROUND, Outcome, Round
from .command_handling import CommandHandling
from .config import AgentConfig
from .diagnosis import recorder
from .diagnosis.metrics import MetricsTracker
from .diagnosis.metrics_publish import MetricsPublisher
from .diagnosis.pattern_watch import PatternWatch
from .diagnosis.restart_patterns import DO_NOT_REQUEUE, Decision, Patterns
from .diagnosis.stacks import StackCollector
from .diagnosis.stall import Stall, StallWatch
from .diagnosis.stragglers import StragglerWatch
from .diagnosis.watchdog import Watchdog
from .failures import truncate_json
from .fence import Fence
from .health import HealthCheck
from .hosting import scheduler
from .job_end import JobEnd
from .launch import ptys
from .launch.exits import GroupResult, WorkerExit, WorkerStartError, WorkerState
from .launch.worker_env import RankAssignment, WorkerSpec, worker_redis_url
from .launch.workers import WorkerGroup
from .membership import Membership
from .records.commands import stacks_limit
from .records.events import EventSink, ResourceSampler, RestartClock
from .records.job_records import JobRecords
from .records.log_config import LogConfig, parse_std_spec
from .records.log_shipping import make_logs_drop_marker
from .records.logs import NodeLogs
from .records.publisher import StreamPublisher
from .records.retention import JobRetention
from .redis_bridge import SyncBridge
from .restart_path import RestartPath


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


class ElasticAgent(CommandHandling, JobEnd, RestartPath, Membership):
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
        #: Training metrics read from the workers' output (diagnosis/metrics.py), published
        #: with the resource samples (diagnosis/metrics_publish.py).
        self.metrics = MetricsTracker()
        self.metrics_pub = MetricsPublisher(self.metrics, config.job_id, self.node_id,
                                            self.events.emit, config.on_nan, self.host)
        self.node_logs = NodeLogs(
            LogConfig(redirects=parse_std_spec(config.redirects), tee=parse_std_spec(config.tee),
                      local_ranks_filter=config.local_ranks_filter,
                      log_line_prefix_template=config.log_line_prefix_template,
                      maxlen=config.log_retention, duplicate_filters=config.duplicate_filters),
            publisher=self.publisher, job_id=config.job_id, node_id=self.node_id,
            observer=self.metrics)
        self.group = WorkerGroup(
            WorkerSpec(role=config.role, nproc=config.nproc, entrypoint=config.entrypoint,
                       max_restarts=config.max_restarts, run_id=config.job_id,
                       redis_url=worker_redis_url(config.endpoint, config.worker_endpoint),
                       job_id=config.job_id,
                       log_dir=config.log_dir, shutdown_timeout=config.shutdown_timeout,
                       extra_env={**recorder.worker_env(config.flight_recorder, os.environ),
                                  **config.extra_env},
                       virtual_local_rank=config.virtual_local_rank,
                       numa_binding=config.numa_binding, preload=config.preload,
                       preload_auto=config.preload_auto,
                       stack_signal=config.stack_signal,
                       flight_recorder=config.flight_recorder,
                       worker_tty=ptys.window_for(config.worker_tty),
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
        self.sampler = ResourceSampler(self._client, config.job_id, self.node_id,
                                       rider=self.metrics_pub)
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
        self._round: Round | None = None
        self._attempt = -1
        self._signal: asyncio.Future[int] | None = None
        self._actions: asyncio.Queue[Command] = asyncio.Queue()
        self._restarts_used = 0
        self.root_cause: dict[str, Any] | None = None
        self._members_seen: dict[tuple[str, int], bool] = {}
        #: The restart under way: when each of its phases ended (issue 23).
        self._restart_clock: RestartClock | None = None

    # -- entry point ---------------------------------------------------------------------
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
            with contextlib.suppress(Exception):  # the last points and curves, if Redis is there
                await asyncio.wait_for(self.sampler.final(), 2.0)
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
            left_out = await self.patterns.excluded(
                self._round.result.round if self._round is not None else None,
                self._round.result.group_world_size if self._round is not None else 0,
                self.cfg.rendezvous.min_nodes)
            if left_out is not None:
                return self._leave_excluded(left_out)
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

    def _leave_excluded(self, decision: Decision) -> int:
        """--exclude-suspect-nodes named this node (a decision checked by pattern_watch.py):
        it joins no further round (the others re-form without it when the rendezvous sees
        it leave, in ``run``'s cleanup)."""
        why = ("this node was in every failure of the job's last restarts (a suspect node) "
               "and --exclude-suspect-nodes leaves it out")
        self.say(f"leaving job {self.cfg.job_id}: {why} (decided by {decision.by} after round "
                 f"{decision.round}); exit status {DO_NOT_REQUEUE} (do not requeue)")
        self.events.emit(EventType.NODE_EXCLUDED, host=self.host, reason=why,
                         round=decision.round, decided_by=decision.by)
        return DO_NOT_REQUEUE

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

    # -- racing a signal or a stop -------------------------------------------------------
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

    # -- start ---------------------------------------------------------------------------
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
        self._round = Round(result, self._attempt, restarts, result.completed_ms, world)
        if self.records.created_ms is None:
            created = await self._redis("reading the job's creation time", lambda: (
                self._client.hget(self.keys.meta, "created_ms")))
            if created is not None and created.isdigit():
                self.records.created_ms = int(created)
                self.records.note_meta({"created_ms": int(created)})
        self._announce_round()
        self.metrics_pub.start_attempt(self._attempt, holds_rank0=base == 0)
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

    # -- monitor -------------------------------------------------------------------------
    async def _monitor(self) -> tuple[Outcome, Any]:
        assert self._signal is not None
        group = asyncio.ensure_future(self.group.wait())
        watch = asyncio.ensure_future(self._watch_membership())
        fence = asyncio.ensure_future(self.fence.watch(self._round.result.group_world_size))
        stalled = asyncio.ensure_future(self._watch_stall())
        slow = asyncio.ensure_future(self._watch_stragglers())
        # --on-nan stop: completes at a rank's first NaN metric (metrics_publish.py)
        nan = self.metrics_pub.stop or asyncio.get_running_loop().create_future()
        try:
            while True:
                action = asyncio.ensure_future(self._actions.get())
                done, _ = await asyncio.wait({group, watch, action, self._signal, stalled, nan},
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
                if nan in done:
                    return Outcome.NAN, nan.result()
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
        await self.stragglers.watch(r.round, r.group_rank, self._round.world_size,
                                    lambda: recorder.ask_all(self.group.recorder_targets(),
                                                             "sample"))

    def _restart_still_due(self, cmd: Command) -> bool:
        # A restart issued before the current round formed has been done already (another
        # node acted on it first and this node re-formed with it).
        assert self._round is not None
        return protocol.stream_id_ms(cmd.entry_id) >= self._round.started_ms

    # -- after the round -----------------------------------------------------------------
    async def _after(self, outcome: Outcome, detail: Any) -> int | None:
        assert self._round is not None
        if outcome == Outcome.SUCCEEDED:
            return await self._succeed()
        if outcome == Outcome.SIGNAL:
            return await self._leave_on_signal(int(detail))
        if outcome == Outcome.STALLED:
            return await self._on_stall(detail)
        if outcome == Outcome.NAN:
            return await self._on_nan(detail)
        await self._stop_workers(outcome.value)
        if outcome == Outcome.FAILED:
            return await self._on_failure(detail)
        if outcome == Outcome.REFORM:
            self.say(f"re-forming the worker group: {detail}")
            if detail != NEWER_ROUND and await self._claim(
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
