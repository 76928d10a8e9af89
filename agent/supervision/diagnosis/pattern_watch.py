"""Restart patterns in Redis: the job's round-end history, the pattern events, the nodes left
out of the job (the logic is restart_patterns.py's).

Who decides: the one agent that claimed a round's restart (``restart_claim:<round>`` or
``reform_claim:<round>`` in the job's meta, HSETNX) records the round's end and analyses the
history, so each pattern event is written once per restart by exactly one agent.

Cost: that agent makes 3 round trips per restart (TIME and the progress mark; then LPUSH,
LTRIM and LRANGE of at most ``HISTORY_CAP`` entries in one MULTI; then one HSET or HDEL), and
an SADD per excluded node: O(1) in the job's size, in the background of the restart unless
its answer decides what comes next (restart_path._round_ended). Every other agent makes one
SISMEMBER per round (am I excluded?) and one HEXISTS when the job failed (the exit status):
O(1) per node per restart, nothing per interval. The history key holds at most ``HISTORY_CAP`` entries of
under 1 KiB each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import redis

from elastic_agent.coordination.wire import round_records
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys

from .restart_patterns import (
    DO_NOT_REQUEUE,
    HISTORY_CAP,
    Patterns,
    PatternSettings,
    RoundEnd,
    analyse,
    may_exclude,
    progressed,
)

log = logging.getLogger(__name__)

#: The meta field whose presence makes a failed job's agents exit ``DO_NOT_REQUEUE``.
META_FIELD = "do_not_requeue"


def host_of(node: str) -> str:
    """The host part of a node id (``<host>-<pid>-<random>``)."""
    return node.rsplit("-", 2)[0]


class PatternWatch:
    """One agent's side (see the module docstring)."""

    def __init__(self, client: Any, job_id: str, node_id: str, settings: PatternSettings,
                 emit: Callable[..., Any], say: Callable[[str], None]) -> None:
        self.client = client
        self.keys = JobKeys(job_id)
        self.node_id = node_id
        self.settings = settings
        self.emit = emit
        self.say = say

    async def record(self, round_: int, reason: str, nodes: Iterable[str | None], *,
                     started_ms: int, progress_grace_ms: int | None, group_world_size: int,
                     min_nodes: int) -> Patterns:
        """Record the end of round ``round_`` (this agent claimed its restart), emit the
        patterns the history now shows and, with ``--exclude-suspect-nodes``, leave suspect
        nodes out while the job has nodes to spare. Never raises for Redis trouble (the
        patterns are advice: the restart goes on without them)."""
        try:
            return await self._record(round_, reason, nodes, started_ms, progress_grace_ms,
                                      group_world_size, min_nodes)
        except (redis.RedisError, OSError) as exc:
            log.warning("restart patterns: %s", exc)
            return Patterns()

    async def _record(self, round_: int, reason: str, nodes: Iterable[str | None],
                      started_ms: int, progress_grace_ms: int | None, group_world_size: int,
                      min_nodes: int) -> Patterns:
        k = self.keys
        pipe = self.client.pipeline(transaction=False)
        pipe.time()
        pipe.get(k.progress_newest)
        (sec, usec), newest = await pipe.execute()
        now_ms = int(sec) * 1000 + int(usec) // 1000
        made = None
        if progress_grace_ms is not None:
            text = newest.decode("ascii", "replace") if isinstance(newest, bytes) else newest
            made = progressed(text, round_, started_ms, progress_grace_ms)
        named = tuple(sorted({n for n in nodes if n}))[:round_records.MAX_ROUND_END_NODES]
        end = RoundEnd(round_, now_ms, reason, named, made)
        pipe = self.client.pipeline(transaction=True)
        pipe.lpush(k.restart_history, end.to_json())
        pipe.ltrim(k.restart_history, 0, HISTORY_CAP - 1)
        pipe.lrange(k.restart_history, 0, HISTORY_CAP - 1)
        *_, raw = await pipe.execute()
        history = [RoundEnd.from_record(d) for d in map(round_records.decode_round_end, raw or [])
                   if d is not None]
        found = analyse(history, now_ms, self.settings)
        excluded = await self._exclude(found, group_world_size, min_nodes)
        self._emit(found, round_, excluded)
        if found:
            await self.client.hset(k.meta, META_FIELD, found.summary()[:1000])
            self.say(found.summary())
        else:
            await self.client.hdel(k.meta, META_FIELD)
        return Patterns(found.storm, found.suspects, found.suspect_rounds,
                        found.no_progress_rounds, excluded)

    async def _exclude(self, found: Patterns, group_world_size: int,
                       min_nodes: int) -> tuple[str, ...]:
        if not self.settings.exclude_suspects:
            return ()
        out: list[str] = []
        for node in found.suspects:
            if may_exclude(group_world_size, min_nodes, len(out)):
                out.append(node)
        if out:
            await self.client.sadd(self.keys.excluded, *out)
        return tuple(out)

    def _emit(self, found: Patterns, round_: int, excluded: tuple[str, ...]) -> None:
        s = self.settings
        if found.storm:
            self.emit(EventType.RESTART_STORM, restarts=found.storm.restarts,
                      minutes=found.storm.minutes, limit=s.storm_restarts,
                      rounds=list(found.storm.rounds), round=round_, policy=s.on_storm)
        for node in found.suspects:
            if node in excluded:
                why = "left out of the next rounds (--exclude-suspect-nodes)"
            elif s.exclude_suspects:
                why = "kept: the job has no node to spare (the minimum of --nnodes)"
            else:
                why = "kept (--exclude-suspect-nodes is off)"
            self.emit(EventType.SUSPECT_NODE, suspect_node=node, host=host_of(node),
                      rounds=list(found.suspect_rounds), excluded=node in excluded, why=why,
                      round=round_)
        if found.no_progress_rounds:
            self.emit(EventType.NO_PROGRESS, rounds=list(found.no_progress_rounds),
                      round=round_)

    async def excluded(self) -> bool:
        """Whether this node was left out of the job (one SISMEMBER). An outage says no:
        the rendezvous rides it out as usual."""
        try:
            return bool(await self.client.sismember(self.keys.excluded, self.node_id))
        except (redis.RedisError, OSError):
            return False

    async def failed_status(self) -> int:
        """The exit status of a failed job: ``DO_NOT_REQUEUE`` when its last restart showed
        a pattern (or the storm stopped it), else 1."""
        try:
            flagged = await self.client.hexists(self.keys.meta, META_FIELD)
        except (redis.RedisError, OSError):
            return 1
        return DO_NOT_REQUEUE if flagged else 1
