"""How this node's part in the job ends, and the job's end in Redis.

After its workers succeeded, a node waits at the round's exit barrier and leaves it early
when another node's workers failed or the job ended (the failure's event, sent before the
round's 'open', says why). A signal ends this node's part (SLURM's stop ends the job, as
stopped by the scheduler); a job that ended elsewhere is read back for its final state and
root cause. The job's final state is claimed once across the job (HSETNX) and reported by
the agent that claimed it; a job SLURM requeued is reopened by the first agent back. The
summary printed when the job ends is here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from typing import Any

import redis

from ..coordination.rendezvous.types import RendezvousResult
from ..coordination.store import StoreTimeoutError
from ..coordination.store_collectives import barrier
from ..coordination.transport.connection import RedisUnavailableError, raise_if_cancelled
from ..coordination.wire import event_records
from ..coordination.wire.command_records import Command, CommandType
from ..coordination.wire.event_records import EventType
from ..coordination.wire.text import terminal_line
from . import run_summary
from .agent_base import EXIT_STOPPED, AgentBase, Outcome
from .exit_barrier import BarrierLeft, LeavableStore
from .failures import FailedElsewhere
from .hosting import scheduler
from .records import pages
from .redis_bridge import SyncBridge

log = logging.getLogger(__name__)


class JobEnd(AgentBase):
    """The agent's part that ends this node's run and records the job's end."""

    # -- success and the exit barrier ----------------------------------------------------
    async def _succeed(self) -> int | None:
        assert self._round is not None
        r = self._round.result
        self.say(f"workers finished; waiting at the exit barrier for {r.group_world_size} nodes")
        left = await self._exit_barrier(r)
        await self.group.stop()
        if left is not None:
            outcome, detail = left
            if isinstance(detail, FailedElsewhere):
                # The failing node reports the failure and claims the restart; this node only
                # joins the next round (or learns there that the job is over).
                self.say(f"leaving the exit barrier: {detail}; rejoining the rendezvous")
                return None
            self.say(f"leaving the exit barrier ({outcome.value})")
            return await self._after(outcome, detail)
        try:
            won = await self._claim_final("succeeded")
        except RedisUnavailableError as exc:
            # The workers succeeded: that is the job's outcome, recorded or not.
            self.say(f"the workers succeeded but the job's end could not be recorded: {exc}")
            won = False
        if won:
            self.events.emit(EventType.JOB_SUCCEEDED, restarts_used=self._restarts_used)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.rdzv.set_closed)
        self.print_summary(self.root_cause, failed=False)
        return 0

    async def _exit_barrier(self, r: RendezvousResult) -> tuple[Outcome, Any] | None:
        """Wait at round ``r``'s exit barrier. ``None`` once it filled (or timed out: the job
        is done here either way); else why this node must leave it now. A node that waited
        out the whole timeout while another node failed would hold up the restart or the
        job's end for that long."""
        assert self._signal is not None
        leave = threading.Event()
        reader = self._mux.reader()
        store = LeavableStore.on(
            self._bridges[0], SyncBridge(reader, priority=True, loop=asyncio.get_running_loop()),
            self.cfg.job_id, f"r{r.round}", leave)
        passing = asyncio.ensure_future(asyncio.to_thread(
            barrier, store, r.group_world_size, "exit", self.cfg.exit_barrier_timeout,
            r.group_rank))
        # The failure first: when both have come, its event says why (the round's 'open' that
        # the failing node sends after it does not).
        watchers = [asyncio.ensure_future(self._watch_failures(r)),
                    asyncio.ensure_future(self._watch_membership())]
        reason: tuple[Outcome, Any] | None = None
        try:
            while True:
                action = asyncio.ensure_future(self._actions.get())
                done, _ = await asyncio.wait({passing, action, self._signal, *watchers},
                                             return_when=asyncio.FIRST_COMPLETED)
                if action not in done:
                    action.cancel()
                if passing in done:
                    break
                if action in done:
                    cmd = action.result()
                    if cmd.type == CommandType.STOP:
                        reason = (Outcome.STOP, cmd)
                        break
                    # A restart is for the nodes still running: the round they open next
                    # brings this node along (the membership watch sees it).
                    continue
                if self._signal.done():
                    reason = (Outcome.SIGNAL, self._signal.result())
                else:
                    reason = next(w for w in watchers if w.done()).result()
                break
        finally:
            leave.set()  # the barrier's thread notices within one slice
            for w in watchers:
                w.cancel()
            try:
                await passing
            except BarrierLeft:
                pass
            except StoreTimeoutError as exc:
                self.say(f"exit barrier: {exc}; exiting anyway")
                reason = None
            else:
                reason = None  # it filled: every node succeeded, whatever else came in
            finally:
                store.close()
                reader.close()
        return reason

    async def _watch_failures(self, r: RendezvousResult) -> tuple[Outcome, Any]:
        """Returns when another node of round ``r`` reports that its workers failed, or that
        the job ended. The event comes before the failing node opens the next round (it
        first stops its workers and finds the root cause), so waiting nodes move at once."""
        assert self._round is not None
        since = self._round.started_ms
        last = f"{max(0, since - 1)}-0"  # XREAD is exclusive: start just before the round
        while True:
            raise_if_cancelled()
            try:
                reply = await self._reader.xread({self.keys.events: last}, count=pages.PAGE,
                                                 block=1000)
            except (redis.RedisError, OSError) as exc:
                log.debug("exit barrier event watch: %s", exc)
                await asyncio.sleep(0.5)  # backoff while Redis is away
                continue
            for _key, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                    ev = event_records.decode_event(entry_id, fields)
                    # Only a member of this round speaks for it (anyone who can write the
                    # event stream could otherwise send every node away from the barrier).
                    if (ev is None or ev.server_ms < since
                            or not await self._member(ev.node, r.round)):
                        continue
                    if ev.type == EventType.GROUP_FAILED and ev.data.get("round") == r.round:
                        return Outcome.REFORM, FailedElsewhere(ev.node, ev.data.get("root_cause"))
                    if ev.type in (EventType.JOB_FAILED, EventType.JOB_STOPPED):
                        return Outcome.CLOSED, None

    # -- leaving -------------------------------------------------------------------------
    async def _leave_on_signal(self, sig: int) -> int:
        await self._stop_workers("signal")
        if scheduler.is_scheduler_stop(self.cfg.slurm is not None, sig):
            await self._close_by_scheduler(sig)
        self.events.emit(EventType.NODE_LEFT, host=self.host,
                         reason=f"signal {signal.Signals(sig).name}")
        await asyncio.to_thread(self.rdzv.shutdown)
        return 128 + sig

    async def _finish_without_workers(self, outcome: Outcome) -> int:
        if outcome == Outcome.SIGNAL:
            assert self._signal is not None
            sig = self._signal.result()
            if scheduler.is_scheduler_stop(self.cfg.slurm is not None, sig):
                await self._close_by_scheduler(sig)
            self.events.emit(EventType.NODE_LEFT, host=self.host,
                             reason=f"signal {signal.Signals(sig).name}")
            return 128 + sig
        return await self._ended_elsewhere()

    async def _ended_elsewhere(self) -> int:
        final = await self._redis("reading the job's state",
                                  lambda: self._client.hget(self.keys.meta, "final_state"))
        state = final.decode() if final else "closed"
        self.say(f"job {self.cfg.job_id} {state} elsewhere; exiting")
        if state == "failed":
            self.print_summary(self.root_cause or await self._last_root_cause(), failed=True)
            return await self.patterns.failed_status()
        if state == "stopped":
            return EXIT_STOPPED
        return 0 if state == "succeeded" else 1

    async def _last_root_cause(self) -> dict[str, Any] | None:
        with contextlib.suppress(redis.RedisError, OSError):
            async for entry_id, fields in pages.backward(self._client, self.keys.events,
                                                         limit=500):
                ev = event_records.decode_event(entry_id, fields)
                if ev is None or ev.type not in (EventType.JOB_FAILED, EventType.GROUP_FAILED):
                    continue
                if self._round is not None and not await self._member(
                        ev.node, self._round.result.round):
                    continue
                cause = ev.data.get("root_cause")
                if isinstance(cause, dict):
                    return cause
        return None

    # -- the job's end in Redis ----------------------------------------------------------
    async def _close_job(self, state: str, *, command: Command | None = None,
                         cause: dict[str, Any] | None = None) -> None:
        if await self._claim_final(state):
            if state == "stopped" and command is not None:
                self.events.emit(EventType.JOB_STOPPED, command_id=command.id,
                                 issuer=command.issuer)
                self.say(f"job {self.cfg.job_id} stopped by {command.issuer}")
            elif state == "failed":
                self.events.emit(EventType.JOB_FAILED, root_cause=cause,
                                 restarts_used=self._restarts_used,
                                 max_restarts=self.cfg.max_restarts)
        await self._redis("closing the rendezvous", lambda: asyncio.to_thread(self.rdzv.set_closed))

    async def _close_by_scheduler(self, sig: int) -> None:
        """SLURM stopped the job (scheduler.py): it ends as stopped, by the scheduler."""
        if await self._claim_final("stopped"):
            self.events.emit(EventType.JOB_STOPPED, **scheduler.stopped_fields(sig),
                             restarts_used=self._restarts_used,
                             max_restarts=self.cfg.max_restarts)
            self.say(f"job {self.cfg.job_id} stopped by the scheduler "
                     f"({signal.Signals(sig).name})")
        await self._redis("closing the rendezvous", lambda: asyncio.to_thread(self.rdzv.set_closed))

    async def _reopen_if_requeued(self) -> None:
        """A job SLURM requeued comes back under its id: the first agent reopens it."""
        step = self.cfg.slurm
        if step is None or step.restart_count < 1:
            return
        if await self._redis("reopening the requeued job", lambda: scheduler.reopen(
                self._client, self.keys, step.restart_count)):
            self.events.emit(EventType.JOB_REQUEUED, scheduler="slurm",
                             slurm_restart_count=step.restart_count)
            self.say(f"job {self.cfg.job_id} requeued by SLURM (restart "
                     f"{step.restart_count}): its history and restart count continue")

    # -- summary -------------------------------------------------------------------------
    def print_summary(self, cause: dict[str, Any] | None, failed: bool) -> None:
        script = run_summary.script_name(self.cfg.entrypoint)
        lines = run_summary.summary_lines(script, self.cfg.job_id, cause, failed,
                                          self._restarts_shown(), self.cfg.max_restarts)
        # Each line on its own through the policy: a newline inside a quoted value is escaped.
        print("\n".join(terminal_line(line, self._colour) for line in lines), file=self.term,
              flush=True)
