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
  :data:`TOP` shares (ZREVRANGE): O(log N + k) per interval, whatever the job's size. It
  believes only ranks of its own round (below the world size its own rendezvous gave) with a
  finite share in [0, 1]; any other member it reads was written by something else: removed,
  counted (``dropped`` in the next event), logged once a round, and the median read again;
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
import math
from collections.abc import Awaitable, Callable
from typing import Any

import redis

from elastic_agent.coordination.wire import trace_records
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.protocol import ProtocolError
from elastic_agent.coordination.wire.round_records import RoundInfo
from elastic_agent.coordination.wire.stack_replies import read_round

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
    """rank -> ratio to the median of the ranks at least ``threshold`` times it (none while
    the median is below ``MIN_MEDIAN``: the job is hung, not slow)."""
    if median < MIN_MEDIAN:
        return {}
    return {r: round(s / median, 2) for r, s in top if s / median >= threshold}


def named_after(streak: dict[int, int], slow: dict[int, float],
                windows: int = WINDOWS) -> tuple[dict[int, int], dict[int, float]]:
    """One window's decision: ``(the new streaks, the ranks named)``. A rank is named once it
    was slow in ``windows`` windows in a row; a window without it ends its streak."""
    streak = {r: streak.get(r, 0) + 1 for r in slow}
    return streak, {r: slow[r] for r, k in streak.items() if k >= windows}


def member_share(member: Any, score: Any, world: int) -> tuple[int, float] | None:
    """``(rank, share)`` of one member of the set, None for anything an agent of this round
    does not write: a member that is not a rank of the round (``0 <= rank < world``, decimal),
    a score that is not a finite share in [0, 1]."""
    text = member.decode("ascii", "replace") if isinstance(member, bytes) else str(member)
    if not text.isdigit() or len(text) > 9:
        return None
    rank = int(text)
    try:
        share = float(score)
    except (TypeError, ValueError):
        return None
    if rank >= world or not math.isfinite(share) or not 0.0 <= share <= 1.0:
        return None
    return rank, share


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
        self.world = 0
        #: Members of the set dropped this round (outside the round's ranks, or a share
        #: that is not a finite number in [0, 1]): written by something other than its agents.
        self.dropped = 0
        self._streak: dict[int, int] = {}
        self._named: dict[int, float] = {}
        self._round: RoundInfo | None = None
        self._placement_read = False
        self._said: set[str] = set()

    async def watch(self, round_: int, group_rank: int, world: int, samples: Samples) -> None:
        """Every interval until cancelled: write this node's shares, and decide when this
        node is group rank 0 of a round of ``world`` ranks (this agent's own rendezvous says
        how many). Nothing ends it but cancellation: Redis trouble skips an interval, and
        anything else (a record no agent wrote) is logged once a round and skipped."""
        self._streak, self._named, self._round, self._placement_read = {}, {}, None, False
        self.world, self.dropped, self._said = world, 0, set()
        await samples()  # the first window starts now, not at the workers' start
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.write(round_, shares(await samples()))
                if group_rank == 0:
                    await self.decide(round_)
            except (redis.RedisError, OSError) as exc:
                log.debug("straggler check: %s", exc)
            except Exception as exc:  # never silent, never fatal: the next interval tries again
                self._say_once(type(exc).__name__,
                               f"straggler check skipped an interval: {type(exc).__name__}: "
                               f"{str(exc)[:200]}")

    def _say_once(self, what: str, line: str) -> None:
        level = logging.DEBUG if what in self._said else logging.WARNING
        self._said.add(what)
        log.log(level, "%s", line)

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
        median, ranked, bad = await self._read(key)
        if bad:  # hostile input only: drop them, then read the median again, once
            await self._drop(key, bad)
            median, ranked, bad = await self._read(key)
        if median is None or bad:
            return  # no median of the agents' own shares to decide on this interval
        slow = slow_ranks(median, ranked, self.threshold)
        self._streak, named = named_after(self._streak, slow)
        if set(named) == set(self._named):
            return
        self._named = named
        info = await self._placement(round_)
        where = info.placement if info is not None else (lambda _r: ("", ""))
        data: dict[str, Any] = {"dropped": self.dropped} if self.dropped else {}
        self.emit(EventType.STRAGGLER, round=round_, window_s=self.interval_s,
                  threshold=self.threshold, median_share=round(median, 4), ranks=[
                      {"rank": r, "ratio": named[r], "node": where(r)[0], "host": where(r)[1]}
                      for r in sorted(named)], **data)

    async def _read(self, key: str) -> tuple[float | None, list[tuple[int, float]], list[Any]]:
        """``(the median share, the top shares, members no agent of the round writes)``:
        ZCARD, then ZRANGE at the middle index and ZREVRANGE of the top (O(log N + TOP))."""
        n = int(await self.client.zcard(key))
        if n < 2:
            return None, [], []
        mid = await self.client.zrange(key, n // 2, n // 2, withscores=True)
        top = await self.client.zrevrange(key, 0, TOP - 1, withscores=True)
        ranked, bad = [], []
        for m, sc in top:
            got = member_share(m, sc, self.world)
            if got is None:
                bad.append(m)
            else:
                ranked.append(got)
        median = member_share(*mid[0], self.world) if mid else None
        if mid and median is None and mid[0][0] not in bad:
            bad.append(mid[0][0])
        return (median[1] if median is not None else None), ranked, bad

    async def _drop(self, key: str, members: list[Any]) -> None:
        """Members no agent of this round wrote: removed (so the median heals) and counted;
        one warning line a round, the count in the next ``straggler`` event."""
        self.dropped += len(members)
        await self.client.zrem(key, *members)
        shown = ", ".join(repr(m)[:40] for m in members[:3])
        self._say_once("dropped", f"straggler check: dropped {len(members)} member(s) of {key} "
                       f"that no agent of a round of {self.world} ranks writes ({shown}); "
                       f"{self.dropped} this round. Who else writes the job's keys?")

    async def _placement(self, round_: int) -> RoundInfo | None:
        """Which node and host run each rank, once a round: the round record, if it is this
        round's and as large as this agent's own rendezvous says (else only ranks are named)."""
        if not self._placement_read:
            self._placement_read = True
            try:
                info = await read_round(self.client, self.job_id)
            except ProtocolError as exc:
                info = None
                self._say_once("round", f"straggler check: the round record is unreadable "
                               f"({exc}); stragglers are named without their hosts")
            if info is not None and (info.round != round_ or info.total_workers != self.world):
                self._say_once("round", f"straggler check: the round record (round {info.round}"
                               f", {info.total_workers} ranks) is not this round ({round_}, "
                               f"{self.world} ranks); stragglers are named without their hosts")
                info = None
            self._round = info
        return self._round
