"""Restart patterns in Redis: the job's round-end history, the pattern events, the nodes left
out of the job (the logic is restart_patterns.py's).

Who decides: the one agent that claimed a round's restart (``restart_claim:<round>`` or
``reform_claim:<round>`` in the job's meta, HSETNX of its node id) records the round's end and
analyses the history, so each pattern event is written once per restart by exactly one agent.
What it records for the others (a round end, the nodes it leaves out, "do not requeue") names
the round and itself, and the others check that against the claim before they act on it:
anyone who can write the job's keys can write these records too.

Progress: where the job's steps are known, by steps: the rounds' highest steps, which every
node raises in ``JobKeys.metrics_steps`` with its metrics (metrics_publish.py: no command of
its own), read with one HMGET of at most ``STEP_ROUNDS + 1`` fields, and this agent's own
(its last interval's steps may not be in Redis yet); otherwise stall.py's progress mark.

Cost: that agent makes 4 round trips per restart (TIME, the progress mark and the steps;
then LPUSH, LTRIM and LRANGE of at most ``HISTORY_CAP`` entries in one MULTI; the claims of those
entries' rounds, one HMGET; then one HSET or HDEL), and one HSET when it leaves nodes out:
O(1) in the job's size, in the background of the restart unless its answer decides what comes
next (restart_path._round_ended). With ``--exclude-suspect-nodes`` every other agent makes one
round trip per round (am I excluded? two HMGETs of at most 4 fields), without it none; and
two HGET/HMGET when the job failed (the exit status): O(1) per node per restart, nothing per
interval. The history key holds at most ``HISTORY_CAP`` entries of under 1 KiB each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis

from elastic_agent.coordination.wire import round_records
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys

from .restart_patterns import (
    DO_NOT_REQUEUE,
    HISTORY_CAP,
    Decision,
    Patterns,
    PatternSettings,
    RoundEnd,
    analyse,
    claim_field,
    decode_steps,
    may_exclude,
    merge_steps,
    progressed,
    step_fields,
    step_progress,
    verified_history,
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
        #: (round, its number of nodes) of the newest two rounds this node was in.
        self._rounds: list[tuple[int, int]] = []
        self._said: set[str] = set()

    async def record(self, round_: int, reason: str, nodes: Iterable[str | None], *,
                     started_ms: int, progress_grace_ms: int | None, group_world_size: int,
                     min_nodes: int, steps: Mapping[int, int] | None = None) -> Patterns:
        """Record the end of round ``round_`` (this agent claimed its restart), emit the
        patterns the history now shows and, with ``--exclude-suspect-nodes``, leave suspect
        nodes out while the job has nodes to spare. ``steps``: round -> the highest step this
        node's ranks named in it (metrics_publish.py ``steps_reached``). Never raises for
        Redis trouble (the patterns are advice: the restart goes on without them)."""
        try:
            return await self._record(round_, reason, nodes, started_ms, progress_grace_ms,
                                      group_world_size, min_nodes, steps or {})
        except (redis.RedisError, OSError) as exc:
            log.warning("restart patterns: %s", exc)
            return Patterns()

    async def _record(self, round_: int, reason: str, nodes: Iterable[str | None],
                      started_ms: int, progress_grace_ms: int | None, group_world_size: int,
                      min_nodes: int, steps: Mapping[int, int]) -> Patterns:
        k = self.keys
        pipe = self.client.pipeline(transaction=False)
        pipe.time()
        pipe.get(k.progress_newest)
        pipe.hmget(k.metrics_steps, step_fields(round_))
        clock, newest, raw_steps = await pipe.execute(raise_on_error=False)
        for reply in (clock, newest):
            if isinstance(reply, Exception):
                raise reply
        if isinstance(raw_steps, Exception):  # not a hash: only this node's steps count
            self._say_once("steps", f"restart patterns: cannot read {k.metrics_steps} "
                           f"({str(raw_steps)[:200]}): only this node's steps count")
            raw_steps = None
        sec, usec = clock
        now_ms = int(sec) * 1000 + int(usec) // 1000
        highs, base = decode_steps(round_, raw_steps or [])
        made, reached = step_progress(round_, merge_steps(highs, steps), base)
        if made is None and progress_grace_ms is not None:  # no step known: output or CPU
            text = newest.decode("ascii", "replace") if isinstance(newest, bytes) else newest
            made = progressed(text, round_, started_ms, progress_grace_ms)
        named = tuple(sorted({n for n in nodes if n}))[:round_records.MAX_ROUND_END_NODES]
        end = RoundEnd(round_, now_ms, reason, named, made, self.node_id, reached)
        pipe = self.client.pipeline(transaction=True)
        pipe.lpush(k.restart_history, end.to_json())
        pipe.ltrim(k.restart_history, 0, HISTORY_CAP - 1)
        pipe.lrange(k.restart_history, 0, HISTORY_CAP - 1)
        *_, raw = await pipe.execute()
        raw = raw or []
        ends = [RoundEnd.from_record(d) for d in map(round_records.decode_round_end, raw)
                if d is not None]
        # One HMGET of at most HISTORY_CAP claims: each entry counts only if the agent that
        # claimed its round's restart wrote it.
        claimers = await self.client.hmget(k.meta, [e.claim_field for e in ends]) if ends else []
        history, dropped = verified_history(ends, claimers, round_, now_ms)
        dropped += len(raw) - len(ends)
        if dropped:
            log.warning("restart patterns: %d of the %d entries of %s were not written by the "
                        "claimer of their round's restart (or do not decode): left out; who "
                        "else writes the job's keys?", dropped, len(raw), k.restart_history)
        found = analyse(history, now_ms, self.settings)
        excluded = await self._exclude(found, round_, group_world_size, min_nodes)
        self._emit(found, round_, excluded)
        if found:
            decision = Decision(round_, self.node_id, why=found.summary()[:1000])
            await self.client.hset(k.meta, META_FIELD, decision.to_json())
            self.say(found.summary())
        else:
            await self.client.hdel(k.meta, META_FIELD)
        return Patterns(found.storm, found.suspects, found.suspect_rounds,
                        found.no_progress_rounds, excluded)

    async def _exclude(self, found: Patterns, round_: int, group_world_size: int,
                       min_nodes: int) -> tuple[str, ...]:
        if not self.settings.exclude_suspects:
            return ()
        out: list[str] = []
        for node in found.suspects:
            if may_exclude(group_world_size, min_nodes, len(out)):
                out.append(node)
        if out:  # one decision per round: the nodes it leaves out are counted together
            await self.client.hset(self.keys.excluded, str(round_),
                                   Decision(round_, self.node_id, tuple(out)).to_json())
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

    def _say_once(self, what: str, line: str) -> None:
        log.log(logging.DEBUG if what in self._said else logging.WARNING, "%s", line)
        self._said.add(what)

    async def excluded(self, round_: int | None, group_world_size: int,
                       min_nodes: int) -> Decision | None:
        """With ``--exclude-suspect-nodes``, the decision that leaves this node out, or None;
        without it, None and nothing read. ``round_`` is the round this node was last in, of
        ``group_world_size`` nodes. A decision is obeyed only if it is the one recorded for
        that round (or this node's round before it: the claimer may record it after this node
        looked), names this node, was written by the agent that claimed that round's restart
        (the job's meta says who) and leaves at least ``min_nodes`` of the round's nodes.
        Anything else is logged once and ignored. One round trip (two HMGETs) per round."""
        if not self.settings.exclude_suspects or round_ is None:
            return None
        if not self._rounds or self._rounds[-1][0] != round_:
            self._rounds = [*self._rounds[-1:], (round_, group_world_size)]
        rounds = list(self._rounds)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.hmget(self.keys.excluded, [str(r) for r, _ in rounds])
            pipe.hmget(self.keys.meta, [claim_field(why, r) for r, _ in rounds
                                        for why in ("failure", "lost")])
            raws, claims = await pipe.execute()
        except (redis.RedisError, OSError) as exc:  # an outage, or a key of the wrong type
            self._say_once("read", f"--exclude-suspect-nodes: cannot read {self.keys.excluded} "
                           f"({str(exc)[:200]}); this node stays in the job")
            return None
        names = [c.decode("utf-8", "replace") if isinstance(c, bytes) else c for c in claims]
        for i, ((r, world), raw) in enumerate(zip(rounds, raws, strict=True)):
            if raw is None:
                continue
            d = Decision.decode(raw)
            if d is None or d.round != r:
                self._say_once(f"bad {r}", f"--exclude-suspect-nodes: the record of round {r} "
                               f"in {self.keys.excluded} is malformed: ignored")
                continue
            if self.node_id not in d.nodes:
                continue
            if d.by not in names[2 * i:2 * i + 2]:
                why = (f"{d.by!r} did not claim round {r}'s restart (the job's meta names "
                       f"{[n for n in names[2 * i:2 * i + 2] if n] or 'nobody'})")
            elif world - len(d.nodes) < min_nodes:
                why = (f"leaving {len(d.nodes)} of its {world} nodes would take the job below "
                       f"the minimum of --nnodes ({min_nodes})")
            else:
                return d
            self._say_once(f"refused {r}", f"--exclude-suspect-nodes: ignoring the record that "
                           f"leaves this node out after round {r}: {why}")
        return None

    async def failed_status(self) -> int:
        """The exit status of a failed job: ``DO_NOT_REQUEUE`` when its last restart showed
        a pattern (or the storm stopped it), else 1. The meta field counts only as its
        claimer wrote it: a :class:`Decision` of a round whose restart that claimer claimed,
        with a pattern switched on here; anything else is logged and gives 1."""
        if not (self.settings.storm_restarts or self.settings.suspect_rounds
                or self.settings.no_progress_rounds):
            return 1  # no pattern on: nobody of this job writes the field
        try:
            raw = await self.client.hget(self.keys.meta, META_FIELD)
            if raw is None:
                return 1
            d = Decision.decode(raw)
            if d is None:
                log.warning("the job's %s field is malformed: ignored (exit status 1)",
                            META_FIELD)
                return 1
            claims = await self.client.hmget(self.keys.meta, [claim_field("failure", d.round),
                                                              claim_field("lost", d.round)])
        except (redis.RedisError, OSError):
            return 1
        names = [c.decode("utf-8", "replace") if isinstance(c, bytes) else c for c in claims]
        if d.by not in names:
            log.warning("the job's %s field names %r, who did not claim round %d's restart: "
                        "ignored (exit status 1)", META_FIELD, d.by, d.round)
            return 1
        return DO_NOT_REQUEUE
