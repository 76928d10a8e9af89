"""The agent's end of a keeper (:mod:`.keeper`): the handles its messages fill.

A :class:`WorkerHandle` per worker (its pid once started, a future of its exit status, its
pipes, log sink and probes) and a :class:`KeeperHandle` per attempt, fed by the keeper's
messages on its socket (:class:`KeeperChannel`): which workers it started (a pid, or the errno
of a failed exec), their exits as it reaps them, and its own end: its socket's EOF, and its
exit, seen as a child's (:class:`KeeperProcess`) or, for one the zygote forked, on a pidfd
(:class:`ForkedKeeper`). A :class:`Spare` is a keeper started ahead of time, waiting for its
request. What to start, and when, is the group's (:mod:`.workers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import select
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from elastic_agent.supervision.launch import keeper
from elastic_agent.supervision.records.logs import WorkerLogs

from . import probes
from .exits import WorkerExit

log = logging.getLogger(__name__)


class WorkerHandle:
    """One worker of the current attempt as the agent holds it: its ranks, error file, log
    sink and output pipes, its probes, and the pid and exit status its keeper reports."""

    __slots__ = ("error_file", "exit", "exited", "global_rank", "local_rank", "logs", "pid",
                 "pipe_inodes", "pipe_ttys", "pipes", "recorder", "stacks")

    def __init__(self, local_rank: int, global_rank: int, error_file: Path,
                 logs: WorkerLogs, exited: asyncio.Future[int]) -> None:
        self.local_rank = local_rank
        self.global_rank = global_rank
        self.error_file = error_file
        self.logs = logs
        self.exited = exited
        self.exit: WorkerExit | None = None
        self.pid = 0
        self.pipes: list[asyncio.ReadTransport] = []
        self.pipe_inodes: set[int] = set()
        self.pipe_ttys: set[str] = set()  # --worker-tty: the slaves' paths (/dev/pts/N)
        self.stacks: probes.StackPipe | None = None
        self.recorder: probes.RecorderLink | None = None


class KeeperHandle:
    """The agent's side of a group's keeper process (:mod:`.keeper`): which workers it has
    started (a pid, or the OSError of a failed exec), their exits, its own exit."""

    def __init__(self, loop: asyncio.AbstractEventLoop, workers: list[WorkerHandle],
                 executable: str) -> None:
        self.workers = workers
        self.executable = executable
        self.started: list[asyncio.Future[int | OSError]] = [
            loop.create_future() for _ in workers]
        self.exited: asyncio.Future[int] = loop.create_future()
        #: The keeper's end of the socket closed: after a stop, its tree is gone.
        self.ended: asyncio.Future[None] = loop.create_future()
        self.process: asyncio.SubprocessTransport | None = None
        self.channel: asyncio.BaseTransport | None = None
        self.pid = 0
        self.closing = False

    def fail_all(self, exc: OSError) -> None:
        for fut in self.started:
            if not fut.done():
                fut.set_result(exc)

    def on_message(self, message: object) -> None:
        try:
            kind, index, value = message  # type: ignore[misc]
            worker = self.workers[index]
        except (TypeError, ValueError, IndexError):
            log.error("ignoring a malformed message from the keeper: %r", message)
            return
        if kind == keeper.STARTED:
            worker.pid = value
            if not self.started[index].done():
                self.started[index].set_result(value)
        elif kind == keeper.FAILED:
            if not self.started[index].done():
                self.started[index].set_result(
                    OSError(value, os.strerror(value), self.executable))
        elif kind == keeper.EXITED and not worker.exited.done():
            worker.exited.set_result(value)

    def on_lost(self) -> None:
        if not self.ended.done():
            self.ended.set_result(None)
        self.fail_all(OSError(errno.ECHILD, "the worker group's keeper process exited"))
        if self.closing:
            return
        # Its workers' PDEATHSIG names the keeper: the kernel has SIGKILLed them.
        lost = [w for w in self.workers if w.pid and not w.exited.done()]
        if lost:
            log.error("the keeper process %d of the workers ended unexpectedly: ranks %s were "
                      "killed with it", self.pid, [w.global_rank for w in lost])
        for w in lost:
            w.exited.set_result(-int(signal.SIGKILL))


class KeeperChannel(asyncio.Protocol):
    """The agent's end of a keeper's socket: its messages, and its EOF, to the handle."""

    def __init__(self, handle: KeeperHandle) -> None:
        self._handle = handle
        self._unframer = keeper.Unframer()

    def data_received(self, data: bytes) -> None:
        for message in self._unframer.feed(data):
            self._handle.on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._handle.on_lost()


class KeeperProcess(asyncio.SubprocessProtocol):
    """An exec'ed keeper (or zygote), a child of the agent: its exit status to ``exited``."""

    def __init__(self, exited: asyncio.Future[int]) -> None:
        self._exited = exited
        self._transport: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def process_exited(self) -> None:
        assert self._transport is not None
        rc = self._transport.get_returncode()
        if not self._exited.done():
            self._exited.set_result(rc if rc is not None else -1)


class ForkedKeeper:
    """``KeeperHandle.process`` for a keeper the zygote forked: no child of the agent, so its
    exit is seen on a pidfd (opened by the zygote before it could reap it), without its
    status."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pid: int, pidfd: int,
                 exited: asyncio.Future[int]) -> None:
        self._loop = loop
        self._pid = pid
        self._pidfd = pidfd
        self._exited = exited
        loop.add_reader(pidfd, self._gone)

    def _gone(self) -> None:
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        if not self._exited.done():
            self._exited.set_result(-1)  # the zygote reaped it: status unknown here

    def get_pid(self) -> int:
        return self._pid

    def close(self) -> None:
        """Kill it if it is still there (as a subprocess transport's close does)."""
        if self._pidfd >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)


@dataclass
class Spare:
    """A keeper started ahead of time, waiting for its request: exec'ed, or forked by the
    zygote with the workers of its attempt parked (``keeper._Keeper.park``)."""

    process: asyncio.SubprocessTransport | ForkedKeeper
    sock: socket.socket
    exited: asyncio.Future[int]

    def close(self) -> None:
        self.sock.close()
        if self.exited.done():
            self.process.close()


def hung_up(sock: socket.socket) -> bool:
    """Whether the other end of an idle keeper's socket is closed (the keeper died): it writes
    nothing before its request, so anything to read is its EOF. Seen before the loop has
    reaped the keeper, which would take a moment longer."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLHUP)
    return bool(poller.poll(0))
