"""Membership: joining a round, and watching, while it runs, for what ends it.

The rendezvous runs in a thread and rides out an outage up to the join timeout, with its
progress on the terminal. While the workers run (or wait at the exit barrier), the watch
returns when the job wants a new round (a node lost, left or waiting to join; a newer round
opened by another node) or has ended, never because of an outage: this node's heartbeat
rides on one summary call per keep-alive interval, and the notify stream's transitions wake
it at once. Before an agent believes what a node wrote into the event stream, it checks the
node is a member of the round (one HGET, cached).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import redis

from ..coordination.rendezvous.types import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousOutOfMemoryError,
    RendezvousProgress,
    RendezvousResult,
    opens_a_round,
)
from ..coordination.transport.connection import raise_if_cancelled
from ..coordination.wire.event_records import EventType
from .agent_base import NEWER_ROUND, AgentBase, Outcome
from .loops import Cadence
from .records import pages
from .records.job_records import ReseedSchedule

log = logging.getLogger(__name__)


class Membership(AgentBase):
    """The agent's part that joins rounds and watches the job's membership."""

    # -- rendezvous ----------------------------------------------------------------------
    def _rendezvous(self) -> RendezvousResult | Outcome:
        s = self.cfg.rendezvous
        self.say(f"job {self.cfg.job_id}: joining the rendezvous on {self.cfg.endpoint.display} "
                 f"(nodes {s.min_nodes}..{s.max_nodes})")
        deadline = time.monotonic() + s.join_timeout
        delay = 0.05
        while True:
            try:
                return self.rdzv.next_rendezvous(progress=self._progress)
            except RendezvousClosedError:
                return Outcome.CLOSED
            except RendezvousConnectionError as exc:
                # A failure during an outage waits for Redis, up to the join timeout.
                if time.monotonic() > deadline or self._signal_seen():
                    raise
                if delay == 0.05 and not isinstance(exc, RendezvousOutOfMemoryError):
                    self.say(f"{exc}; retrying until Redis is back "
                             f"(up to {s.join_timeout:g} s)")
                time.sleep(delay)  # this runs in the rendezvous thread: backoff between tries
                delay = min(delay * 2, 1.0)

    def _signal_seen(self) -> bool:
        return self._signal is not None and self._signal.done()

    def _progress(self, p: RendezvousProgress) -> None:
        if p.status == "waiting":
            self.say(f"round {p.round} is running without this node; waiting for the next "
                     f"round (join timeout in {p.join_left:.0f} s)")
            return
        need = max(0, p.min_nodes - p.joined_count)
        parts = [f"round {p.round}: {p.joined_count} of {p.min_nodes}..{p.max_nodes} nodes "
                 f"joined"]
        if need:
            parts.append(f"waiting for {need} more")
        if p.missing_count:
            parts.append(f"{p.missing_count} of the previous round's nodes not back yet")
        if p.last_call_left is not None:
            parts.append(f"last call ends in {p.last_call_left:.0f} s")
        parts.append(f"join timeout in {p.join_left:.0f} s")
        self.say("; ".join(parts))

    # -- membership ----------------------------------------------------------------------
    async def _watch_membership(self) -> tuple[Outcome, Any]:
        """Returns when the job wants a new round or has ended; never because of an outage."""
        assert self._round is not None
        my_round = self._round.result.round
        # The transitions only: a late node is seen by the summary within an interval.
        # Following every join too would hand each of N agents every one of N joins when a
        # job re-forms: N^2 entries.
        streams = {self.keys.rdzv_notify: "$"}
        for key in streams:
            with contextlib.suppress(redis.RedisError, OSError):
                last = await self._client.xrevrange(key, count=1)
                streams[key] = last[0][0].decode() if last else "0-0"
        grace_until = 0.0
        interval = self.cfg.rendezvous.keep_alive_interval
        cadence = Cadence(interval)  # the first summary now, then at this node's own phase
        reseed = ReseedSchedule(self.rdzv)
        while True:
            raise_if_cancelled()
            try:
                if reseed.due():
                    if await self.records.reseed():
                        # Redis came back empty: readers get the job back, the workers go on.
                        self.say("Redis lost the job's records (restarted empty?); "
                                 "putting them back")
                        await asyncio.to_thread(self.rdzv.heartbeat)  # the round, at once
                        self._announce_round(restored=True)
                        self._announce_workers(restored=True)
                    reseed.done()
                # This node's beat rides on the summary: one script call per interval.
                m, newly_lost = await asyncio.to_thread(self.rdzv.lost_since_last_check, True)
                if reseed.restored():
                    continue  # the beat found Redis empty: the records go back at once
                in_grace = time.monotonic() < grace_until
                for node in newly_lost:
                    self.events.emit(EventType.NODE_LOST, lost_node=node,
                                     host=node.rsplit("-", 2)[0])
                if m.closed:
                    return Outcome.CLOSED, None
                if m.round > my_round:
                    return Outcome.REFORM, NEWER_ROUND
                if m.is_member:
                    self.fence.thaw()  # frozen workers go on if this node's beats get through
                if self.rdzv.waiting_count(m, include_lost=not in_grace) > 0:
                    self._lost_nodes = list(m.lost) if not in_grace else []
                    why = []
                    if m.lost and not in_grace:
                        why.append("lost: " + ", ".join(m.lost))
                    if m.left:
                        why.append("left: " + ", ".join(m.left))
                    if m.waiting:
                        why.append("waiting: " + ", ".join(m.waiting))
                    return Outcome.REFORM, "membership changed (" + "; ".join(why) + ")"
                reply = await self._reader.xread(
                    streams, count=pages.PAGE, block=max(1, int(cadence.until_next() * 1000)))
                for key, entries in reply or []:
                    streams[key.decode()] = entries[-1][0].decode()
                    if opens_a_round(entries):
                        return Outcome.REFORM, NEWER_ROUND
            except Exception as exc:
                log.debug("membership watch: %s", exc)
                # Right after an outage every heartbeat looks stale: give nodes one heartbeat
                # timeout to check in before anyone is declared lost.
                grace_until = time.monotonic() + self.cfg.rendezvous.heartbeat_timeout
                await asyncio.sleep(min(1.0, interval))  # backoff while Redis is away

    async def _member(self, node: str, round_: int) -> bool:
        """Whether ``node`` is a member of round ``round_``: one HGET of its assignment, so
        that checking who speaks for a round never reads the whole round (O(N) bytes)."""
        key = (node, round_)
        known = self._members_seen.get(key)
        if known is None:
            raw = await self._client.hget(self.keys.rdzv_assign, node)
            known = bool(raw) and raw.split(b" ", 1)[0] == str(round_).encode()
            if len(self._members_seen) > 4096:
                self._members_seen.clear()
            self._members_seen[key] = known
        return known
