"""How long a job's keys outlive it: ``--retention`` after the job ended, then Redis drops them.

A Redis shared for months by thousands of jobs must not keep every job ever run. So:

* When an agent exits, after its last write, it gives every key of the job a TTL: the
  retention if the job has a final state, else (the agent left a job others may still run, or
  the last agent was signalled) the *lease* below. Each agent of a job does it as it exits;
  the last one sets the clock.
* While a job runs its keys carry a lease, ``retention + 3 x interval``, renewed every
  ``interval`` (retention / 4, 1 s to 10 min) by one agent of the job (a ``lease`` token key
  picks it). An agent SIGKILLed, a host lost with its agents: the job is lost, nobody renews,
  and its keys go one retention later, like a finished job's. Keys an agent creates between
  two renewals (a node's new log stream, a new round's store) are caught by the next one.
* "Every key of the job" is found by ``SCAN MATCH elastic:{JOB}:*`` rather than a list, so
  keys added by any part of the package (or a later version) are covered. A SCAN costs
  O(keys on the server): one per job per interval, not per agent. The log streams, outside
  the job's slot (``JobKeys.logs``: on a cluster they are on other masters, which that SCAN
  does not walk), are the members of the job's ``logs`` set, plus this agent's own stream
  (in case the set went first, e.g. ``rm``): one SMEMBERS and O(nodes) PTTL/PEXPIRE per pass.
* A job removed (``elastic-console rm``) while an agent was still ending has no meta any more
  when that agent's last pass runs: the keys it wrote meanwhile are deleted, not kept.
* The job index (``elastic:jobs``, outside every job) loses the oldest entries whose job is
  gone at each final pass (readers also drop them lazily: ``elastic-console ls``).

``--retention 0`` keeps a job's keys forever (as before): no lease, and the final pass
removes any TTL an earlier agent set.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import redis
import redis.asyncio as aioredis

from elastic_agent.coordination.transport.cluster import give_key_ttls, give_ttls, scan_batches
from elastic_agent.coordination.wire.keyspace import JOBS_INDEX, JobKeys

log = logging.getLogger(__name__)

DEFAULT_RETENTION_S = 7 * 24 * 3600.0
#: An index entry younger than this is never pruned: an agent of an older version may have
#: listed its job before writing its meta (agents now write the meta first).
INDEX_GRACE_MS = 1_000
#: Index entries looked at per final pass (the oldest first: they expire first).
INDEX_PRUNE_BATCH = 100
_SCAN_COUNT = 1000

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")


def parse_duration(value: str) -> float:
    """``7d``, ``12h``, ``30m``, ``90s``, ``90`` (seconds), ``1.5h``; ``0`` = forever.
    Raises ValueError with a sentence for anything else."""
    m = _DURATION_RE.fullmatch(value.strip().lower())
    if not m:
        raise ValueError(f"{value!r} is not a duration: use e.g. 7d, 12h, 30m, 90s or 0 "
                         "(keep forever)")
    seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if seconds > 10 * 365 * 86400:
        raise ValueError(f"{value!r} is more than ten years: use 0 to keep jobs forever")
    return seconds


def lease_interval(retention_s: float) -> float:
    """How often a running job's lease is renewed."""
    return min(600.0, max(1.0, retention_s / 4))


def running_ttl(retention_s: float) -> float:
    """The TTL of a running job's keys: if nobody renews it, the job is gone one retention
    (plus a few missed renewals) after its last agent."""
    return retention_s + 3 * lease_interval(retention_s)


class JobRetention:
    """The lease of one agent's job, and the pass that ends it."""

    def __init__(self, client: aioredis.Redis, job_id: str, node_id: str,
                 retention_s: float) -> None:
        self._client = client
        self._keys = JobKeys(job_id)
        self._node = node_id
        self.retention_s = retention_s
        self.interval = lease_interval(retention_s)
        self._pattern = self._keys.all_key_patterns()[0]
        self._token = self._keys.lease
        self._own_stream = self._keys.logs(node_id)

    async def run(self) -> None:
        """Renew the lease for as long as the agent runs (cancel to stop)."""
        if self.retention_s <= 0:
            return
        while True:
            try:
                if await self._take_turn():
                    await self.expire_all(running_ttl(self.retention_s), renewal=True)
            except (redis.RedisError, OSError) as exc:
                log.debug("lease renewal: %s", exc)  # an outage: the next renewal tries again
            # A TTL is a clock: nothing in Redis signals that it is time to renew one.
            await asyncio.sleep(self.interval)

    async def _take_turn(self) -> bool:
        """True for one agent of the job per interval (the others skip their SCAN)."""
        try:
            return bool(await self._client.set(self._token, self._node, nx=True,
                                               px=max(1, int(self.interval * 1000 * 0.9))))
        except redis.ResponseError:
            return True  # refused (OOM: EXPIRE still works): renew rather than let it lapse

    async def finish(self) -> None:
        """The agent's last pass: the job's keys expire one retention from now if the job
        ended, else they keep the lease; a job removed meanwhile loses what was rewritten."""
        client = self._client
        final, meta_exists = await asyncio.gather(
            client.hget(self._keys.meta, "final_state"), client.exists(self._keys.meta))
        if not meta_exists:
            await self.delete_all()
        elif self.retention_s <= 0:
            await self._each_key(lambda pipe, key: pipe.persist(key))
        else:
            await self.expire_all(self.retention_s if final else running_ttl(self.retention_s))
        await self.prune_index()

    async def expire_all(self, seconds: float, renewal: bool = False) -> int:
        """Give every key of the job a TTL of ``seconds``; return how many keys.

        A renewal leaves alone a key whose TTL someone else chose: its own token, a claim with
        a short lease of its own (``stall:<round>``): it only sets the lease on keys without a
        TTL and extends those whose TTL is still one of its leases."""
        ms = max(1, int(seconds * 1000))
        if not renewal:
            return await self._each_key(lambda pipe, key: pipe.pexpire(key, ms))
        # A lease of ours starts at retention + 3 intervals: still above the retention, it was
        # renewed at most three intervals ago (an agent with the turn died, a slow host).
        renew = int(self.retention_s * 1000)
        streams = await self.log_streams()
        return (await give_ttls(self._client, self._pattern, ms, renew_from_ms=renew)
                + await give_key_ttls(self._client, streams, ms, renew_from_ms=renew))

    async def delete_all(self) -> int:
        return await self._each_key(lambda pipe, key: pipe.unlink(key))

    async def log_streams(self) -> list[str]:
        """The job's log streams outside its slot: the set's members that are this job's
        (anything else in it is not ours to touch) and this agent's own stream."""
        try:
            raw = await self._client.smembers(self._keys.log_streams)
        except redis.ResponseError:
            raw = set()  # not a set (WRONGTYPE): the SCAN still covers the job's slot
        return self._keys.streams_elsewhere([*(raw or ()), self._own_stream])

    async def _each_key(self, op: object) -> int:
        async def each(batch: list[Any]) -> int:
            pipe = self._client.pipeline(transaction=False)
            for key in batch:
                op(pipe, key)  # type: ignore[operator]
            await pipe.execute(raise_on_error=False)
            return len(batch)

        # The streams first: the set that lists them is one of the keys the SCAN finds.
        streams: list[Any] = await self.log_streams()
        n = 0
        for i in range(0, len(streams), _SCAN_COUNT):
            n += await each(streams[i:i + _SCAN_COUNT])
        async for batch in _scan_batches(self._client, self._pattern):
            n += await each(batch)
        return n

    async def prune_index(self) -> int:
        """Drop the oldest index entries whose job has no meta and no events any more."""
        return await prune_job_index(self._client)


async def prune_job_index(client: aioredis.Redis, batch: int = INDEX_PRUNE_BATCH) -> int:
    """Remove up to ``batch`` of the oldest job-index entries whose job is gone; how many.

    A job's agent user of the documented ACL (docs/SECURITY.md) may only add to the index
    and reads no other job: it is refused here, and leaves the pruning to readers allowed
    to (``elastic-console ls`` as a user with ZREM on the index)."""
    try:
        return await _prune_job_index(client, batch)
    except redis.exceptions.NoPermissionError as exc:
        log.debug("the job index is not this user's to prune: %s", exc)
        return 0


async def _prune_job_index(client: aioredis.Redis, batch: int) -> int:
    secs, micros = await client.time()
    now_ms = int(secs) * 1000 + int(micros) // 1000
    oldest = await client.zrangebyscore(JOBS_INDEX, "-inf", now_ms - INDEX_GRACE_MS,
                                        start=0, num=batch)
    jobs = []
    for member in oldest:
        name = member.decode("utf-8", "replace") if isinstance(member, bytes) else str(member)
        try:
            jobs.append((member, JobKeys(name)))
        except ValueError:
            jobs.append((member, None))  # not a job id at all: nothing to keep it for
    if not jobs:
        return 0
    pipe = client.pipeline(transaction=False)
    for _, k in jobs:
        if k is not None:
            pipe.exists(k.meta, k.events)
    replies = iter(await pipe.execute())
    gone = [m for m, k in jobs if k is None or not next(replies)]
    if gone:
        await client.zrem(JOBS_INDEX, *gone)
    return len(gone)


def _scan_batches(client: aioredis.Redis, pattern: str):  # type: ignore[no-untyped-def]
    # On a cluster, on the primary that owns the job's slot (connection.scan_batches).
    return scan_batches(client, pattern, _SCAN_COUNT)
