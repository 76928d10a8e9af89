"""Stall detection: no rank of the job made progress for ``--stall-timeout`` seconds (issue 13).

What counts as progress of a rank (``ProgressMeter``):

* **output**: a chunk of stdout or stderr read from its pipes (``NodeLogs.last_output``, set by
  the log pipeline as it reads; a progress bar redrawn with ``\\r`` counts too);
* **CPU**: its process tree (the worker and its live descendants, plus the children it
  reaped) used at least ``CPU_PROGRESS_FRACTION`` of one core over the last sample.

A rank blocked in a collective whose wait sleeps (gloo's wait, a Python ``time.sleep``, a
lock) uses no CPU and prints nothing: no progress. A rank computing silently burns CPU:
progress, never a stall. The other side of that rule: a rank that *busy-waits* burns CPU
too and counts as progressing: a Python spin loop, and a CUDA stream synchronize that spins
behind a hung NCCL collective (CUDA's default schedule spins when there are more cores
than GPUs). A job whose ranks all spin is not flagged by this detector; torch's own NCCL
watchdog (``TORCH_NCCL_*`` timeouts) ends such a collective with an error, and the failure
path captures the stacks then.

The job is stalled when no rank of the job made progress for the timeout. It is job-wide,
so agents share progress through Redis (``StallWatch``): every agent writes the server time
of its node's newest progress into ``JobKeys.progress`` (node -> ms) and, in the same script,
compares the newest progress of the round's members (and the round's start) with the
server clock. The first agent to see the job idle for the timeout claims the stall with a
SET on ``JobKeys.stall(round)`` holding that progress time, under a lease: the others see
it claimed; if the claimer dies before reporting, the lease runs out and another agent
claims it. Once reported, the key holds the progress time for good: the same stall is
never reported twice, and a new one needs newer progress first.

The claimer captures every rank's stacks through the ``stacks`` command (job-wide, see
coordination/wire/stack_replies.py), groups them and publishes a ``stalled`` event naming the odd
ranks: those outside the largest group of identical stacks (the ranks everybody else waits
for). Then ``--on-stall`` decides: ``observe`` goes on watching, ``restart`` and ``stop`` are
the agent's (restart_path.py).

CPU time has no event to wait on: the meter samples every ``interval`` (a quarter of the
timeout, at most ``MAX_INTERVAL_S``); that is also how often each agent writes to Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import redis

from elastic_agent.coordination.transport.lua import LuaScript
from elastic_agent.coordination.wire import collective_replies, collectives, stack_replies
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.stack_dumps import StackGroup, format_ranks, group_record, group_stacks

from ..loops import Cadence

log = logging.getLogger(__name__)

#: A sample in which a rank's tree used this share of one core (or more) is progress.
CPU_PROGRESS_FRACTION = 0.05
MAX_INTERVAL_S = 5.0
MIN_INTERVAL_S = 0.2
#: How long a claimed stall stays claimed before it is reported (the claimer died: another
#: agent takes over once it runs out).
CLAIM_LEASE_MS = 60_000
#: The stack capture of a stall waits this long for every rank's reply.
CAPTURE_TIMEOUT_S = 10.0
MAX_GROUPS = 20
#: Progress times closer than this are the same progress (see _REPORT_AND_CLAIM); a quarter
#: of the timeout when that is shorter.
JITTER_MS = 1_000
FRAMES_PER_GROUP = 12
POLICIES = ("observe", "restart", "stop")

# KEYS: progress hash, the round's stall key, the job's newest progress. ARGV: node, age of
# the node's newest progress (ms), timeout (ms), the round's start (server ms), lease (ms),
# jitter (ms), round. Returns {claimed 0/1, idle ms, the job's newest progress ms}.
# O(1) in the job's size: each node keeps its own field (for readers) and raises one shared
# value, "<round> <ms>", the newest progress of any member of the round; nothing walks the
# members. A value that is not a number, or is more than a minute ahead of the server clock,
# is not progress (hostile or garbage): it could otherwise hide every stall of the job, and
# the next member's write replaces it. A progress time is "server now - local age": the same
# progress, written again, moves by the round trip's jitter; only a move of more than
# ``jitter`` is new progress (or the same stall would be claimed again and again).
_REPORT_AND_CLAIM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ahead = now + 60000
local mine = now - tonumber(ARGV[2])
local jitter = tonumber(ARGV[6])
local round = ARGV[7]
local held = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '')
if held == nil or held ~= held or held < mine - jitter or held > ahead then
  redis.call('HSET', KEYS[1], ARGV[1], mine)
end
local newest = tonumber(ARGV[4])
local shared = redis.call('GET', KEYS[3])
local r, ms = nil, nil
if shared then r, ms = string.match(shared, '^(%d+) (%d+)$') end
ms = tonumber(ms or '')
if r == round and ms and ms == ms and ms <= ahead and ms > newest then newest = ms end
if mine > newest + jitter or (r ~= round and mine > newest) or (ms and ms > ahead) then
  redis.call('SET', KEYS[3], round .. ' ' .. mine)
  if mine > newest then newest = mine end
end
local idle = now - newest
if idle < tonumber(ARGV[3]) then return {0, idle, newest} end
local claimed = tonumber(redis.call('GET', KEYS[2]) or '')
if claimed ~= nil and claimed >= newest - jitter then return {0, idle, newest} end
redis.call('SET', KEYS[2], newest, 'PX', tonumber(ARGV[5]))
return {1, idle, newest}
"""


@dataclass(frozen=True)
class Stall:
    """A stall this agent claimed (and reported): ``data`` is the ``stalled`` event's."""

    idle_ms: int
    progress_ms: int
    data: dict[str, Any]

    @property
    def cause(self) -> dict[str, Any]:
        """The stall as a root cause (``job_failed``, the agent's summary)."""
        odd = self.data.get("odd_ranks") or []
        hosts = self.data.get("odd_hosts") or []
        where = ""
        if odd:
            where = f"; odd rank{'s' if len(odd) > 1 else ''} {format_ranks(odd)}"
            if hosts:
                where += f" on {', '.join(hosts[:4])}"
            groups = self.data.get("groups") or []
            if groups and groups[0].get("summary"):
                where += f" ({groups[0]['summary']})"
        return {"reason": "stalled", "rank": odd[0] if len(odd) == 1 else None,
                "host": hosts[0] if len(hosts) == 1 else None, "exit_code": None,
                "message": f"stalled: no rank made progress for {self.idle_ms / 1000:.0f} s"
                           + where,
                "stacks_request": self.data.get("request", ""),
                "timestamp": time.time()}


def interval_for(timeout_s: float) -> float:
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, timeout_s / 4))


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of ``pid``, its live descendants and the children they reaped; None if
    ``pid`` is gone. A descendant that exits unreaped drops out of the sum: callers count
    only increases."""
    try:
        proc = psutil.Process(pid)
        t = proc.cpu_times()
        total = t.user + t.system + t.children_user + t.children_system
        children = proc.children(recursive=True)
    except psutil.Error:
        return None
    for child in children:
        with contextlib.suppress(psutil.Error):
            c = child.cpu_times()
            total += c.user + c.system + c.children_user + c.children_system
    return total


class ProgressMeter:
    """The newest progress of this node's workers, in ``time.monotonic()`` seconds."""

    def __init__(self, last_output: Mapping[int, float],
                 cpu: Callable[[int], float | None] = tree_cpu_seconds,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._outputs = last_output
        self._cpu_of = cpu
        self._clock = clock
        self._cpu: dict[int, tuple[float, float]] = {}  # rank -> (cpu seconds, when)
        self.last = clock()

    def reset(self) -> None:
        """A new round: its start is progress; CPU is measured from here."""
        self._cpu = {}
        self.last = self._clock()

    def sample(self, workers: Iterable[Any]) -> float:
        """Look at every worker (``global_rank``, ``pid``) once; returns :attr:`last`."""
        now = self._clock()
        for w in workers:
            out = self._outputs.get(w.global_rank)
            if out is not None and out > self.last:
                self.last = out
            if not w.pid:
                continue
            cpu = self._cpu_of(w.pid)
            if cpu is None:
                continue
            prev = self._cpu.get(w.global_rank)
            self._cpu[w.global_rank] = (cpu, now)
            if prev is not None and cpu - prev[0] > 0 and (
                    cpu - prev[0] >= CPU_PROGRESS_FRACTION * (now - prev[1])):
                self.last = now
        return self.last


def odd_groups(groups: Sequence[StackGroup]) -> list[StackGroup]:
    """The groups smaller than the largest one (the ranks the others wait for); none when
    every group is as large (two ranks, two stacks: nothing tells which one is odd)."""
    largest = max((len(g.ranks) for g in groups), default=0)
    return [g for g in groups if len(g.ranks) < largest]


def stalled_event_data(groups: Sequence[StackGroup], request: str, idle_ms: int, policy: str,
                       round_: int) -> dict[str, Any]:
    """The ``stalled`` event's fields (see event_records.EventType.STALLED)."""
    odd = odd_groups(groups)
    return {
        "request": request,
        "idle_s": round(idle_ms / 1000, 1),
        "groups": [group_record(g, FRAMES_PER_GROUP) for g in groups[:MAX_GROUPS]],
        "odd_ranks": sorted(r for g in odd for r in g.ranks),
        "odd_hosts": sorted({h for g in odd for h in g.hosts}),
        "policy": policy,
        "round": round_,
    }


class StallWatch:
    """One agent's side of the job-wide detection (see the module docstring)."""

    def __init__(self, client: Any, reader: Any, job_id: str, node_id: str, host: str,
                 timeout_s: float, policy: str, last_output: Mapping[int, float],
                 emit: Callable[..., Any],
                 request_stacks: Callable[..., Any] | None = None,
                 request_collectives: Callable[..., Any] | None = None) -> None:
        self.client = client
        # EVALSHA: Redis hashes a script's whole text on every EVAL.
        self._report_and_claim = LuaScript(client, _REPORT_AND_CLAIM)
        self.reader = reader  # blocks longer than the stack replies' reads
        self.job_id = job_id
        self.keys = JobKeys(job_id)
        self.node_id = node_id
        self.host = host
        self.timeout_ms = int(timeout_s * 1000)
        self.interval = interval_for(timeout_s)
        self.policy = policy
        self.meter = ProgressMeter(last_output)
        self.lease_ms = CLAIM_LEASE_MS
        # Well below the timeout: a node's progress is written at most this late.
        self.jitter_ms = min(JITTER_MS, self.timeout_ms // 4)
        self.emit = emit
        self._request_stacks = request_stacks or stack_replies.request_stacks
        self._request_collectives = (request_collectives
                                     or collective_replies.request_collectives)

    async def watch(self, round_: int, started_ms: int,
                    workers: Callable[[], Iterable[Any]]) -> Stall:
        """Report every stall of round ``round_``; return the first one whose policy is
        not ``observe`` (the caller restarts or stops). Never raises for Redis trouble: an
        outage only pauses the detection."""
        self.meter.reset()
        while True:
            stall = await self._next_claim(round_, started_ms, workers)
            data = await self._report(stall[0], round_)
            result = Stall(stall[0], stall[1], data)
            with contextlib.suppress(redis.RedisError, OSError):
                await self.client.set(self.keys.stall(round_), stall[1])  # reported, for good
            if self.policy != "observe":
                return result

    async def _next_claim(self, round_: int, started_ms: int,
                          workers: Callable[[], Iterable[Any]]) -> tuple[int, int]:
        cadence = Cadence(self.interval)  # N nodes' checks spread over the interval
        while True:
            await asyncio.sleep(cadence.until_next())  # CPU time has no event: a sample is due
            last = self.meter.sample(workers())
            age_ms = max(0, int((time.monotonic() - last) * 1000))
            try:
                claimed, idle, newest = await self.check(round_, started_ms, age_ms)
            except (redis.RedisError, OSError, TypeError, ValueError) as exc:
                log.debug("stall check: %s", exc)
                continue
            if claimed:
                return idle, newest

    async def check(self, round_: int, started_ms: int, age_ms: int) -> tuple[bool, int, int]:
        """Write this node's newest progress (``age_ms`` ago) and claim a stall of the job if
        there is one: ``(claimed, idle ms, the job's newest progress ms)``."""
        reply = await self._report_and_claim(
            keys=[self.keys.progress, self.keys.stall(round_), self.keys.progress_newest],
            args=[self.node_id, int(age_ms), self.timeout_ms, int(started_ms), self.lease_ms,
                  self.jitter_ms, int(round_)])
        claimed, idle, newest = (int(x) for x in reply)
        return bool(claimed), idle, newest

    async def _collectives(self) -> dict[str, Any] | None:
        """Every rank's flight recorder, analysed (issue 22); None when no rank has one."""
        try:
            request, traces = await self._request_collectives(
                self.reader, self.job_id, f"stall-detector@{self.host}",
                timeout=CAPTURE_TIMEOUT_S)
        except Exception as exc:  # the event goes out without them rather than not at all
            log.warning("stall: capturing the collective traces failed: %s", exc)
            return None
        analysis = collectives.analyse(traces)
        if not analysis["answered"]:
            return None
        return collectives.event_record(analysis, request)

    async def _report(self, idle_ms: int, round_: int) -> dict[str, Any]:
        """Capture every rank's stacks and publish the ``stalled`` event; its data."""
        request, stacks = "", []
        try:
            request, stacks = await self._request_stacks(
                self.reader, self.job_id, f"stall-detector@{self.host}",
                timeout=CAPTURE_TIMEOUT_S)
        except Exception as exc:  # the event goes out without stacks rather than not at all
            log.warning("stall: capturing the stacks failed: %s", exc)
        data = stalled_event_data(group_stacks(stacks), request, idle_ms, self.policy, round_)
        traced = await self._collectives()
        if traced is not None:
            data["collectives"] = traced
        self.emit(EventType.STALLED, **data)
        return data
