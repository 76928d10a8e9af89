"""What readers need of a job, put back by every agent when Redis comes back empty.

A Redis restarted without persistence, a FLUSHALL or a failover to an empty replica leaves
running workers with no job: no index entry, no meta, no log-stream set, a restart counter
back at zero. The rendezvous puts its own round back (``RedisRendezvous.heartbeat``); this
module does the rest. Each agent runs one idempotent script with what it knows as soon as
its beat finds the rendezvous lost, and every :data:`RESEED_EVERY` keep-alive intervals
otherwise: meta fields are set only where missing, its log stream is added to the set,
and the restart counter is raised to the highest value this agent has seen, never lowered
(so the restart budget never starts over).

The log-stream set is how every reader finds the job's log streams, which live outside the
job's slot (``JobKeys.logs``: on a cluster, on other masters). Its cost per node is one member
of ~60 bytes, written once when the node's first worker opens (``NodeLogs.open_worker``) and
confirmed by this script: one O(1) ``SADD`` per node every 30 s.

What an empty Redis loses for good: events and log lines written before it (they were in the
lost streams), and a restart claim between its write and the next reseed of another agent.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import redis
import redis.asyncio as aioredis

from elastic_agent.coordination.transport.lua import LuaScript
from elastic_agent.coordination.transport.pressure import OOM, is_oom
from elastic_agent.coordination.wire.keyspace import JOBS_INDEX, JobKeys

log = logging.getLogger(__name__)

# KEYS: meta, restart counter, log-stream set.
# ARGV: restarts seen, this node's log stream, then meta field/value pairs.
# Returns 1 if the node's stream was in the set already, else 0: each node asks about its own
# entry, because whoever comes first puts the shared ones (meta) back for everybody.
_RESEED = """
for i = 3, #ARGV, 2 do redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) end
local seen = tonumber(ARGV[1])
local current = tonumber(redis.call('GET', KEYS[2]) or '0')
if current ~= nil and current < seen then redis.call('SET', KEYS[2], seen) end
return redis.call('SADD', KEYS[3], ARGV[2]) == 0 and 1 or 0
"""


#: Keep-alive intervals between two reseeds when nothing says Redis lost the job. A Redis that
#: lost everything is seen at once (the beat finds the rendezvous gone, ReseedSchedule);
#: the periodic reseed catches what a failover to a lagging replica may lose on its own (this
#: node's entry in the log-stream set, a restart claim), within 30 s at the default 2 s.
RESEED_EVERY = 15


class ReseedSchedule:
    """When an agent's watch loop reseeds: at its first pass, after any beat that found the
    rendezvous lost and put it back (``rdzv.restorations`` grew), and every
    :data:`RESEED_EVERY` passes otherwise; a reseed that failed (an outage) is owed until one
    succeeds. One script call per node every 30 s instead of every interval: it was a third
    of a node's script calls per interval."""

    def __init__(self, rdzv: Any, every: int = RESEED_EVERY) -> None:
        self._rdzv = rdzv
        self._every = every
        self._seen = rdzv.restorations
        self._passes = 0
        self._owed = True

    def due(self) -> bool:
        """Called once per pass of the loop: True when this pass reseeds."""
        self._passes += 1
        if self._passes >= self._every:
            self._owed = True
        return self._owed or self.restored()

    def done(self) -> None:
        """The reseed went through."""
        self._owed, self._passes, self._seen = False, 0, self._rdzv.restorations

    def restored(self) -> bool:
        """Whether a beat restored the rendezvous since the last reseed."""
        return self._rdzv.restorations != self._seen


class JobRecords:
    """This agent's copy of the job's records, and the reseed that puts them back."""

    def __init__(self, client: aioredis.Redis, job_id: str, log_stream: str) -> None:
        self._client = client
        self._keys = JobKeys(job_id)
        self._job_id = job_id
        self._log_stream = log_stream
        self._script = LuaScript(client, _RESEED)
        self.meta: dict[str, str] = {}
        self.restarts_seen = 0
        self.created_ms: int | None = None
        self._seen_registered = False  # a reseed found this node's entry in place before

    def note_meta(self, fields: Mapping[str, object]) -> None:
        """Fields this agent wrote into, or saw in, the job's meta hash."""
        self.meta.update({k: str(v) for k, v in fields.items()})

    def note_restarts(self, used: int) -> None:
        self.restarts_seen = max(self.restarts_seen, used)

    async def reseed(self) -> bool:
        """Put back whatever is missing; True if Redis had lost the job since the last call
        (this node's entry in the log-stream set was gone: it is only ever added, never removed).

        Raises the redis errors of an outage (the caller rides them out); a key of the wrong
        type is logged and skipped (there is nothing this agent may safely overwrite)."""
        args: list[object] = [self.restarts_seen, self._log_stream]
        for k, v in self.meta.items():
            args += [k, v]
        try:
            was_there = bool(await self._script(
                keys=[self._keys.meta, self._keys.restarts, self._keys.log_streams], args=args))
        except redis.ResponseError as exc:
            if is_oom(exc):
                OOM.refused()  # an outage, reported once per episode; the next call retries
                return False
            log.warning("cannot put the job's records back: %s", exc)
            return False
        OOM.accepted()
        lost = self._seen_registered and not was_there
        self._seen_registered = True
        if lost and self.created_ms is not None:
            # The index lives outside the job's hash slot: its own call, not in the script.
            await self._client.zadd(JOBS_INDEX, {self._job_id: self.created_ms}, nx=True)
        return lost
