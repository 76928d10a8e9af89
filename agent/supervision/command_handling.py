"""The job's commands, as this agent acts on them for its whole life.

Stacks and collectives are the console's questions: rate-limited, and answered beside the
command loop (up to 2 s each), which stays free for a stop that comes meanwhile. A signal
command is sent here to a local rank. Any other command (stop, restart) is acked and handed
to the loop through a queue it reads wherever it waits. Every command gets a
``command_ack`` event: accepted, rejected (and why) or done.
"""

from __future__ import annotations

import asyncio

import redis

from ..coordination.wire.command_records import Command, CommandType
from ..coordination.wire.event_records import EventType
from .agent_base import AgentBase
from .loops import keep_running
from .records.commands import CommandReader, Rejected, stacks_refused


class CommandHandling(AgentBase):
    """The agent's part that reads the job's command stream and answers it."""

    async def _read_commands(self) -> None:
        """Acts on the job's commands for the agent's whole life: the loop is restarted, and
        says so, should anything escape it."""
        reader = CommandReader(self._mux.reader(), self.cfg.job_id)
        await keep_running("command reader", lambda: self._command_loop(reader), self.say,
                           progress=lambda: reader.handled)

    async def _command_loop(self, reader: CommandReader) -> None:
        async for cmd in reader:
            if isinstance(cmd, Rejected):
                self._ack(cmd.id, "rejected", cmd.reason)
                continue
            try:
                await self._handle_command(cmd)
            except Exception as exc:
                self._ack(cmd.id, "rejected", f"{type(exc).__name__}: {exc}")

    async def _handle_command(self, cmd: Command) -> None:
        if cmd.type == CommandType.STACKS:
            if wait := self._stacks_limit.take():
                self._ack(cmd.id, "rejected", stacks_refused(wait))
                return
            # Read-only and up to 2 s: answered beside the command loop, which stays free
            # for a stop that comes meanwhile.
            task = asyncio.create_task(self._answer_stacks(cmd), name="stacks")
            self._stack_tasks.add(task)
            task.add_done_callback(self._stack_tasks.discard)
            return
        if cmd.type == CommandType.COLLECTIVES:
            if wait := self._collectives_limit.take():
                self._ack(cmd.id, "rejected", stacks_refused(wait))
                return
            mine = {w.global_rank for w in self.group.workers} if self._round else set()
            task = asyncio.create_task(self.recorder.answer(cmd, mine, self._ack),
                                       name="collectives")
            self._stack_tasks.add(task)
            task.add_done_callback(self._stack_tasks.discard)
            return
        if cmd.type == CommandType.SIGNAL:
            # decode_command checked the types and the allow-list; the world is ours to know.
            rank, sig = cmd.args["rank"], cmd.args.get("signal", "SIGTERM")
            world = self._round.world_size if self._round else 0
            if rank >= world:
                self._ack(cmd.id, "rejected", f"rank {rank} is not in the job (world size {world})")
                return
            mine = {w.global_rank for w in self.group.workers}
            if rank not in mine:
                self._ack(cmd.id, "accepted", f"rank {rank} is not on this node")
                return
            sent = await self.group.signal_rank(rank, sig)
            self._ack(cmd.id, "accepted" if sent else "rejected",
                      f"{sig} sent to rank {rank}" if sent else f"rank {rank} is not running")
            return
        self._ack(cmd.id, "accepted", f"{cmd.type} from {cmd.issuer}")
        await self._actions.put(cmd)

    async def _answer_stacks(self, cmd: Command) -> None:
        """Publish the stacks of this node's workers (or of ``args.rank`` if it is here)
        under the command's id, then ack it ``done``."""
        rank = cmd.args.get("rank")
        mine = {w.global_rank for w in self.group.workers}
        if self._round is None or not mine:
            self._ack(cmd.id, "done", "no workers on this node")
            return
        if rank is not None and rank not in mine:
            self._ack(cmd.id, "done", f"rank {rank} is not on this node")
            return
        try:
            found = await self.stacks.capture_local(ranks=None if rank is None else [rank])
            await self.stacks.publish(cmd.id, found)
        except (redis.RedisError, OSError) as exc:
            self._ack(cmd.id, "rejected", f"stacks not published: {exc}")
            return
        answered = sum(1 for s in found if s.threads)
        self._ack(cmd.id, "done", f"stacks of {answered} of {len(found)} ranks published")

    def _ack(self, command_id: str, status: str, reason: str) -> None:
        self.events.emit(EventType.COMMAND_ACK, command_id=command_id, status=status,
                         reason=reason, host=self.host)
