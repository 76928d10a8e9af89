"""What the agent's parts share: the outcomes of a round, the agent's state, the helpers.

:class:`~elastic_agent.supervision.elastic_agent.ElasticAgent` is the agent's loop; its other
jobs sit beside it as parts: ``membership`` (joining a round, watching who is in it),
``restart_path`` (stopping the workers with their evidence, counting the restart, the root
cause), ``job_end`` (the exit barrier, leaving, the job's end in Redis) and
``command_handling`` (the job's commands). Each part is a mixin on :class:`AgentBase`; at run
time they are one object. As torch's elastic agent keeps its contract (``api.py``) apart
from the agent that runs one host's workers, this module is the contract the parts are
written against: the attributes ``ElasticAgent.__init__`` sets, the few methods every part
calls (a line on the terminal, a Redis call that rides out an outage, a phase of the restart
clock, a claim), and the loop's own steps that a part calls back. A part calls another
part's method through ``self``.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import IO, Any, TypeVar

import redis
import redis.asyncio as aioredis

from ..coordination.rendezvous.drivers import RedisRendezvous
from ..coordination.rendezvous.types import (
    RendezvousConnectionError,
    RendezvousOutOfMemoryError,
    RendezvousResult,
)
from ..coordination.transport.connection import explain_error, raise_if_cancelled
from ..coordination.transport.pressure import OOM
from ..coordination.transport.stream_mux import MuxReader, StreamMux
from ..coordination.wire.command_records import Command
from ..coordination.wire.keyspace import JobKeys
from ..coordination.wire.text import terminal_line
from .config import AgentConfig
from .diagnosis import recorder
from .diagnosis.metrics import MetricsTracker
from .diagnosis.metrics_publish import MetricsPublisher
from .diagnosis.pattern_watch import PatternWatch
from .diagnosis.restart_patterns import Patterns
from .diagnosis.stacks import StackCollector
from .diagnosis.stall import StallWatch
from .diagnosis.stragglers import StragglerWatch
from .diagnosis.watchdog import Watchdog
from .fence import Fence
from .health import HealthCheck
from .launch.workers import WorkerGroup
from .records.commands import RateLimit
from .records.events import EventSink, ResourceSampler, RestartClock
from .records.job_records import JobRecords
from .records.logs import NodeLogs
from .records.publisher import StreamPublisher
from .records.retention import JobRetention
from .redis_bridge import SyncBridge

T = TypeVar("T")

# OOM (maxmemory, noeviction): a refused write changed nothing and goes through once memory
# is freed, like a write during an outage once Redis is back.
_OUTAGE = (redis.ConnectionError, redis.TimeoutError, OSError, RendezvousConnectionError,
           redis.OutOfMemoryError)

NEWER_ROUND = "another node opened a new round"

EXIT_STOPPED = 143  # a stop command: the conventional status of a terminated process


class Outcome(enum.Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # a local worker failed
    REFORM = "reform"  # membership changed, or another node opened a newer round
    RESTART = "restart"  # a restart command
    STOP = "stop"  # a stop command
    CLOSED = "closed"  # the job ended elsewhere (failed or stopped)
    SIGNAL = "signal"  # the agent itself was signalled
    STALLED = "stalled"  # no rank progressed for --stall-timeout, --on-stall restart|stop
    NAN = "nan"  # a rank printed a NaN or infinite metric, --on-nan stop


@dataclass
class Round:
    result: RendezvousResult
    attempt: int
    restart_count: int
    started_ms: int
    world_size: int


class AgentBase:
    """The state and helpers of one agent, shared by its loop and its parts."""

    # Set by ElasticAgent.__init__. The job and this host:
    cfg: AgentConfig
    keys: JobKeys
    term: IO[str]
    _colour: bool
    host: str
    node_id: str
    # Issue 21: two connections per agent (see ElasticAgent.__init__).
    _client: aioredis.Redis
    _mux: StreamMux
    _reader: MuxReader
    _bridges: list[SyncBridge]
    rdzv: RedisRendezvous
    # What the agent drives and writes:
    publisher: StreamPublisher
    events: EventSink
    node_logs: NodeLogs
    group: WorkerGroup
    stacks: StackCollector
    _stack_tasks: set[asyncio.Task[None]]
    _stacks_limit: RateLimit
    recorder: recorder.RecorderCollector
    _collectives_limit: RateLimit
    stragglers: StragglerWatch | None
    sampler: ResourceSampler
    metrics: MetricsTracker
    metrics_pub: MetricsPublisher
    records: JobRecords
    retention: JobRetention
    fence: Fence
    watchdog: Watchdog
    health: HealthCheck
    stall: StallWatch | None
    patterns: PatternWatch
    # The round under way and what this agent learnt of the job:
    _round: Round | None
    _attempt: int
    _signal: asyncio.Future[int] | None
    _actions: asyncio.Queue[Command]
    _restarts_used: int
    root_cause: dict[str, Any] | None
    _evidence: dict[str, Any] | None
    _lost_nodes: list[str]
    _pattern_tasks: set[asyncio.Task[Patterns]]
    _members_seen: dict[tuple[str, int], bool]
    _restart_clock: RestartClock | None

    # -- terminal ------------------------------------------------------------------------
    def say(self, message: str) -> None:
        """One line on the agent's terminal. Messages quote what others wrote into Redis (an
        issuer, a root cause), so they go through the one text policy like any other output."""
        print(terminal_line(f"[elastic-agent] {message}", self._colour), file=self.term, flush=True)

    # -- shared helpers ------------------------------------------------------------------
    def _mark(self, phase: str, at: float | None = None) -> None:
        if self._restart_clock is not None:
            self._restart_clock.mark(phase, at)

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

    async def _claim(self, field: str) -> bool:
        """True for exactly one agent of the job per ``field``: the one that reports it. The
        field holds the claimer's node id (who decided what follows, for the others to check:
        diagnosis/pattern_watch.py)."""
        won = bool(await self._redis("claiming " + field, lambda: self._client.hsetnx(
            self.keys.meta, field, self.node_id)))
        # claimed, by us or another: never twice
        self.records.note_meta({field: self.node_id if won else 1})
        return won

    async def _claim_final(self, state: str) -> bool:
        won = bool(await self._redis("recording the job's end", lambda: self._client.hsetnx(
            self.keys.meta, "final_state", state)))
        if won:
            self.records.note_meta({"final_state": state})
        return won

    # -- the loop's steps a part calls back (elastic_agent.py) ---------------------------
    async def _after(self, outcome: Outcome, detail: Any) -> int | None:
        raise NotImplementedError

    def _announce_round(self, **extra: Any) -> None:
        raise NotImplementedError

    def _announce_workers(self, **extra: Any) -> None:
        raise NotImplementedError
