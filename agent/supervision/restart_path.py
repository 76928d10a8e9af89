"""The restart path: from a round that ended badly to the next rendezvous.

Whatever stops the workers (a failure, a stall, a re-form, a command, a signal), their
evidence comes first: the survivors' stacks and flight recorders (2 s at most), then the
whole process trees. The restart of a failed or stalled round is claimed and counted once
across the job (one script; --max-restarts); the claimant reports the root cause (the
earliest failure among the round's members, by Redis server time) and records the round's
end for the restart patterns (pattern_watch.py), off the restart's path unless a pattern can
change what comes next. bench/launch_bench.py times this path by the phases the restart
clock marks (events.RestartClock): keep its calls and their order.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import redis

from ..coordination.wire import event_records, protocol
from ..coordination.wire.event_records import EventType
from .agent_base import AgentBase
from .diagnosis.restart_patterns import Patterns
from .diagnosis.stall import Stall
from .failures import failure_dict, traceback_of
from .launch.exits import GroupResult
from .records import pages

# Claims the restart of one failed round, once across the job, and counts it. The claim holds
# the claimer's node id: what it then decides (pattern_watch.py) is checked against it.
# KEYS: restarts, meta. ARGV: round, restarts seen, node id. Returns {claimed (0/1), used}.
_CLAIM_RESTART = """
if redis.call('HSETNX', KEYS[2], 'restart_claim:' .. ARGV[1], ARGV[3]) == 0 then
  return {0, redis.call('GET', KEYS[1]) or '0'}
end
-- A counter lost with its Redis starts again from the highest count this agent saw.
local seen, current = tonumber(ARGV[2]), tonumber(redis.call('GET', KEYS[1]) or '0')
if current ~= nil and current < seen then redis.call('SET', KEYS[1], seen) end
return {1, redis.call('INCR', KEYS[1])}
"""


class RestartPath(AgentBase):
    """The agent's part that stops a round's workers and restarts the job."""

    # -- restart patterns ----------------------------------------------------------------
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
            group_world_size=r.result.group_world_size, min_nodes=self.cfg.rendezvous.min_nodes,
            steps=self.metrics_pub.steps_reached())
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

    # -- stop, count, root cause ---------------------------------------------------------
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
                self.records.restarts_seen, self.node_id))
        except redis.ResponseError as exc:  # INCR of a counter that is not a number
            raise protocol.ProtocolError(
                f"{self.keys.restarts} cannot count restarts ({exc}): repair or delete that key"
            ) from None
        used = protocol.decode_counter(used, self.keys.restarts)
        self.records.note_restarts(used)
        self.records.note_meta({f"restart_claim:{rnd}": self.node_id if claimed else 1})
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

    async def _on_nan(self, nan: dict[str, Any]) -> int:
        """--on-nan stop: the job fails at a rank's first NaN or infinite metric (its ``nan``
        event is out already), ended as --on-stall stop ends it."""
        cause = {"reason": "nan", "rank": nan.get("rank"), "host": self.host,
                 "node": self.node_id, "exit_code": None, "step": nan.get("step"),
                 "metric": nan.get("metric"), "timestamp": time.time(),
                 "message": f"rank {nan.get('rank')} printed {nan.get('metric')} = "
                            f"{nan.get('value')} at step {nan.get('step')}"}
        self.root_cause = cause
        self.say(f"{cause['message']} (--on-nan stop)")
        # The job ends before its workers do: the other nodes' workers fail once these are
        # gone, and their agents must find the job over, not restart it.
        await self._close_job("failed", cause=cause)
        await self._stop_workers("nan")
        self.print_summary(cause, failed=True)
        return await self.patterns.failed_status()

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
            ev = event_records.decode_event(entry_id, fields)
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
