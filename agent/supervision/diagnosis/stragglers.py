"""Slow ranks (issue 22, part 2): a rank persistently slower than the others, not hung.

How, with no change to the training script: ranks that synchronise through collectives
(DDP, ``all_reduce``) wait for the slowest one in every collective, so the slow rank is the
one that waits *least*. Each worker's trace thread (``recorder_probe.py``) samples, every
0.1 s, whether its rank is inside a collective (the flight recorder's own ``pg_status``: an
enqueued collective not completed yet); each agent asks its workers for the counts every
``--straggler-interval`` and turns them into the share of the window each rank spent
*outside* collectives (computing). For a rank that computes 1.6x longer per step, that share
is 1.6x the others' (the step time is the same everywhere: everyone waits for it). No clock is
compared across hosts: each share is one rank's own samples.

The decision is the round's group rank 0 agent's:

* every agent writes its ranks' shares into one sorted set per round (``JobKeys.stragglers``,
  ZADD + PEXPIRE in one pipeline: O(ranks of the node) per node per interval);
* group rank 0 reads the job's median (ZCARD, then ZRANGE at the middle index) and the top
  :data:`TOP` shares (ZREVRANGE): O(log N + k) per interval, whatever the job's size;
* a rank whose share is at least :data:`THRESHOLD` times the median in :data:`WINDOWS`
  windows in a row is a straggler: one ``straggler`` event names them (ranks ascending, each
  with its host and ``ratio``, how many times the median it computes), again only when the
  set changes (an empty ``ranks`` says the stragglers are gone).

A rank that makes no progress at all is not a straggler but a stall (stall.py): while the
median share is below :data:`MIN_MEDIAN` (every rank waiting), nothing is decided.
NVIDIA's resiliency extension scores speed against the fastest rank with a 0.75 threshold;
1.3x the median is the same order (1 / 0.75 = 1.33).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import redis

from elastic_agent.coordination.wire import trace_records
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.protocol import ProtocolError
from elastic_agent.coordination.wire.stack_replies import current_round, hosts_by_rank

log = logging.getLogger(__name__)

THRESHOLD = 1.3
WINDOWS = 2
#: Ranks group rank 0 reads from the top of the set per interval.
TOP = 16
#: Samples a rank needs in a window to count (10 s of samples at 0.1 s: 100).
MIN_SAMPLES = 10
#: Below this median share of time outside collectives, the job is hung, not slow.
MIN_MEDIAN = 0.02
#: The key outlives its last write by this many intervals.
EXPIRE_INTERVALS = 3

Samples = Callable[[], Awaitable[list[tuple[int, int, bytes | str]]]]


def shares(answers: list[tuple[int, int, bytes | str]]) -> dict[int, float]:
    """rank -> share of the window outside collectives, from the workers' ``sample`` answers
    (decoded in the guarded place); ranks with too few samples are left out."""
    out = {}
    for rank, _pid, answer in answers:
        if isinstance(answer, str):
            continue
        try:
            n, busy, _window = trace_records.decode_busy_sample(answer)
        except ProtocolError:
            continue
        if n >= MIN_SAMPLES:
            out[rank] = round(1.0 - busy / n, 4)
    return out


def slow_ranks(median: float, top: list[tuple[int, float]],
               threshold: float = THRESHOLD) -> dict[int, float]:
    """rank -> ratio to the median of the ranks at least ``threshold`` times it."""
    if median < MIN_MEDIAN:
        return {}
    return {r: round(s / median, 2) for r, s in top if s / median >= threshold}


class StragglerWatch:
    """One agent's side (see the module docstring)."""

    def __init__(self, client: Any, job_id: str, interval_s: float,
                 emit: Callable[..., Any], threshold: float = THRESHOLD) -> None:
        self.client = client
        self.keys = JobKeys(job_id)
        self.job_id = job_id
        self.interval_s = interval_s
        self.emit = emit
        self.threshold = threshold
        self._streak: dict[int, int] = {}
        self._named: dict[int, float] = {}
        self._hosts: dict[int, tuple[str, str]] | None = None

    async def watch(self, round_: int, group_rank: int, samples: Samples) -> None:
        """Every interval until cancelled: write this node's shares, and decide when this
        node is group rank 0. Redis trouble only skips an interval."""
        self._streak, self._named, self._hosts = {}, {}, None
        await samples()  # the first window starts now, not at the workers' start
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.write(round_, shares(await samples()))
                if group_rank == 0:
                    await self.decide(round_)
            except (redis.RedisError, OSError) as exc:
                log.debug("straggler check: %s", exc)

    async def write(self, round_: int, mine: dict[int, float]) -> None:
        if not mine:
            return
        key = self.keys.stragglers(round_)
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(key, {str(r): s for r, s in mine.items()})
        pipe.pexpire(key, int(self.interval_s * 1000 * EXPIRE_INTERVALS))
        await pipe.execute()

    async def decide(self, round_: int) -> None:
        key = self.keys.stragglers(round_)
        n = int(await self.client.zcard(key))
        if n < 2:
            return
        mid = await self.client.zrange(key, n // 2, n // 2, withscores=True)
        top = await self.client.zrevrange(key, 0, TOP - 1, withscores=True)
        try:
            median = float(mid[0][1])
            ranked = [(int(m), float(s)) for m, s in top]
        except (IndexError, TypeError, ValueError):
            return  # a hostile or garbled set: nothing to decide on
        slow = slow_ranks(median, ranked, self.threshold)
        self._streak = {r: self._streak.get(r, 0) + 1 for r in slow}
        named = {r: slow[r] for r, k in self._streak.items() if k >= WINDOWS}
        if set(named) == set(self._named):
            return
        self._named = named
        if self._hosts is None:  # once per round: the round's placement (O(N), read once)
            self._hosts = hosts_by_rank(await current_round(self.client, self.job_id))
        self.emit(EventType.STRAGGLER, round=round_, window_s=self.interval_s,
                  threshold=self.threshold, median_share=round(median, 4), ranks=[
                      {"rank": r, "ratio": named[r], "node": self._hosts.get(r, ("", ""))[0],
                       "host": self._hosts.get(r, ("", ""))[1]} for r in sorted(named)])
