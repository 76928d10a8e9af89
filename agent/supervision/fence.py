"""Fencing: a node cut off from Redis freezes its workers before anyone may take their ranks.

The other nodes call a node lost once its last heartbeat in Redis is older than the heartbeat
timeout, and re-form without it: its global ranks go to their workers. That heartbeat was sent
at ``rdzv.renewed_at`` (this host's monotonic clock; Redis stamped it later), so nobody can
take the ranks before ``renewed_at + heartbeat_timeout``. A little before that (``margin``)
the workers' process groups get SIGSTOP: frozen, they cannot run alongside the new owners of
their ranks, nor write a checkpoint over theirs.

Frozen, not stopped: from here an outage of Redis or of the network that cut every node off
looks the same as this node cut off alone, and an outage must not kill or restart a worker.
The agent thaws them (``thaw``, SIGCONT) once Redis confirms the node is still in its round,
and kills them frozen (``kill``, SIGKILL: a SIGTERM handler would let a stale worker act) once
it learns it was dropped. A round of one node is never fenced: nobody can take its ranks.
Only the workers' process groups are frozen: a child that left its group (``setsid``) is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable

from ..coordination.rendezvous.drivers import RedisRendezvous
from .launch.workers import WorkerGroup


class Fence:
    """Freezes ``group`` while ``rdzv``'s heartbeats are not getting through (see above)."""

    def __init__(self, rdzv: RedisRendezvous, group: WorkerGroup, heartbeat_timeout: float,
                 say: Callable[[str], None]) -> None:
        self.rdzv = rdzv
        self.group = group
        #: Freeze this long before the heartbeat timeout runs out: room for a late event
        #: loop. The others need longer still: notice, stop their workers, re-form, start.
        self.margin = min(1.0, heartbeat_timeout / 4)
        self.lease = heartbeat_timeout - self.margin
        self.say = say
        self.frozen = False
        self._thawed = asyncio.Event()

    def lease_left(self) -> float:
        """Seconds until the workers must be frozen (negative: overdue)."""
        renewed = self.rdzv.renewed_at
        if renewed is None:
            return self.lease
        return renewed + self.lease - time.monotonic()

    async def watch(self, round_nodes: int) -> None:
        """Freeze the workers whenever the lease runs out, for a round of ``round_nodes``
        nodes; runs until cancelled."""
        if round_nodes < 2:
            return
        while True:
            if self.frozen:
                await self._thawed.wait()
                continue
            left = self.lease_left()
            if left > 0:
                await asyncio.sleep(left)  # the lease's end: a deadline, not a poll
                continue
            self._signal(signal.SIGSTOP)
            self.frozen = True
            self._thawed.clear()
            self.say(f"heartbeats have not reached Redis for {self.lease:g} s: freezing the "
                     "workers (the other nodes may re-form without this node and give its "
                     "ranks away); they go on if Redis confirms this node is still in its round")

    def thaw(self) -> bool:
        """Resume frozen workers if the lease is valid again: the caller has just read that
        this node is still in its round. True if they were thawed."""
        if not self.frozen or self.lease_left() <= 0:
            return False
        self._signal(signal.SIGCONT)
        self._unfreeze()
        self.say("Redis confirms this node is still in its round: the workers go on")
        return True

    def kill(self) -> None:
        """SIGKILL frozen workers (nothing otherwise): they must not run again, since other
        nodes may hold their ranks now. Call before stopping the group."""
        if self.frozen:
            self._signal(signal.SIGKILL)
            self._unfreeze()
            self.say("the frozen workers are killed: this node's round is over")

    def _unfreeze(self) -> None:
        self.frozen = False
        self._thawed.set()

    def _signal(self, sig: signal.Signals) -> None:
        for w in self.group.workers:
            if w.pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    # Each worker leads its own process group: this reaches its children too,
                    # as WorkerGroup's own stop does (the group outlives an exited leader).
                    os.killpg(w.pid, sig)
