"""The local worker group: start, park and release through keepers, exits, signals, stops.

A :class:`WorkerGroup` runs ``nproc`` copies of the entrypoint with torchrun's worker
environment (:mod:`.worker_env`, which holds everything a worker is given), each in its own
process group and session, with stdout and stderr piped into the log pipeline
(:mod:`elastic_agent.supervision.records.logs`). How each ended is a :class:`.exits.WorkerExit`;
the agent's end of a keeper is :mod:`.keeper_client`, the search for a tree's strays
:mod:`.strays`.

Everything is an event: a worker's exit is a message from the group's keeper the moment it
reaps the worker, pipe data comes from the loop's reader, a stray process's end from its pidfd.
Nothing polls.

The workers are started by a keeper (:mod:`elastic_agent.supervision.launch.keeper`), one small
process per group and attempt (a child of the agent; with ``--preload``, forked by the node's
zygote, which imported the modules once), child subreaper of the tree: when the agent
dies, however it dies (SIGKILL, OOM), the keeper sees EOF on a socket whose other end only the
agent holds and SIGKILLs every descendant, grandchildren in sessions of their own and
double-forked daemons included; it exits once none is left. The agent keeps everything else:
it creates the output pipes and reads them (``loop.connect_read_pipe``, each chunk of up to
256 KiB straight to the log pipeline), and the exit is reported on reaping, not when the pipes
close, so a worker whose child (a daemon, a compile worker) still holds its stdout is still
seen exiting. Workers get exactly the argv, environment, session, descriptors and inherited
signal dispositions the agent asks for; their parent, the process their PR_SET_PDEATHSIG
names, is the keeper.

No orphans: :meth:`WorkerGroup.stop` sends SIGTERM to every worker's process group and to
every process of its tree that left the group (the keeper's descendants; while a worker lives,
its own; and any process with the worker's ``TORCHELASTIC_ERROR_FILE`` in its environment),
waits up to ``shutdown_timeout``, SIGKILLs what is left, and returns once all are gone, the
output pipes are drained and the keeper has exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping

from elastic_agent.coordination.wire import log_records
from elastic_agent.supervision.launch import keeper, zygote
from elastic_agent.supervision.records.logs import NodeLogs, WorkerLogs

from . import probes, ptys
from .exits import (
    GroupResult,
    WorkerExit,
    WorkerInfo,
    WorkerStartError,
    WorkerState,
    error_message,
    read_error_file,
)
from .keeper_client import (
    ForkedKeeper,
    KeeperChannel,
    KeeperHandle,
    KeeperProcess,
    Spare,
    WorkerHandle,
    hung_up,
)
from .strays import KILL_WAIT, find_strays, pipe_holders, running, signal_all, wait_gone
from .worker_env import (
    RankAssignment,
    WorkerSpec,
    prepare_logs,
    recorder_on,
    recorder_socket,
    stacks_fifo,
    stacks_on,
    worker_argv,
    worker_env,
    zygote_env,
)

log = logging.getLogger(__name__)

#: How long stop() waits for the output pipes to reach EOF once every process is gone.
DRAIN_WAIT = 2.0
#: How long after a start the next attempt's keeper is started (a stop starts it at once).
SPARE_DELAY = 0.5


class _PipeProtocol(asyncio.Protocol):
    """One of a worker's output pipes: each chunk (up to 256 KiB) straight to its log sink."""

    def __init__(self, logs: WorkerLogs, stream: str) -> None:
        self._logs = logs
        self._stream = stream

    def data_received(self, data: bytes) -> None:
        self._logs.feed(self._stream, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._logs.eof(self._stream)


class WorkerGroup:
    """The workers of one role on this node, for one attempt at a time.

    ``start`` -> ``wait`` -> ``stop``, then ``start`` again for the next attempt.
    ``on_exit`` is called (on the event loop, synchronously) for every worker exit as it is
    seen, including exits caused by ``stop``; an exception in it is logged, not raised.
    ``logs`` is the node's log pipeline (default: files and terminal, no Redis).
    """

    def __init__(self, spec: WorkerSpec, *, logs: NodeLogs | None = None,
                 on_exit: Callable[[WorkerExit], object] | None = None,
                 base_env: Mapping[str, str] | None = None) -> None:
        self.spec = spec
        self.logs = logs or NodeLogs()
        if spec.worker_tty is not None:  # cursor-moving output is drawn on a terminal this big
            self.logs.screen_size = spec.worker_tty
        self.on_exit = on_exit
        self._base_env = base_env
        #: --logs-specs: the environments the plugin's reify left, by local rank.
        self._plugin_envs: dict[int, dict[str, str]] = {}
        self.state = WorkerState.INIT
        self.assignment: RankAssignment | None = None
        self._workers: list[WorkerHandle] = []
        self._outcome: asyncio.Future[GroupResult] | None = None
        self._stop_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._keeper: KeeperHandle | None = None
        #: The last start's phases (monotonic): ``keeper`` running and asked for the workers,
        #: ``started`` every worker's pid known (see ``events.RestartClock``).
        self.start_marks: dict[str, float] = {}
        auto = (not spec.preload and spec.preload_auto and spec.numa_binding is None
                and zygote.recipe(spec.entrypoint) is not None)
        #: Workers are forked from a zygote: with --preload, and by default (``auto``) for
        #: every Python entrypoint the zygote can run (issue 23).
        self.warm = bool(spec.preload) or auto
        #: What the zygote imports: --preload's modules, else what ``auto`` found (or none).
        self.preload: tuple[str, ...] = spec.preload or (
            zygote.auto_preload(spec.entrypoint) if auto else ())
        #: The next attempt's keeper, started ahead of time (exec'ed, or forked with its
        #: workers parked; see ``_spare_ahead``).
        self._spare: asyncio.Task[Spare | None] | None = None
        self._spare_timer: asyncio.TimerHandle | None = None
        self._closed = False
        #: Keepers whose trees are gone, exiting (see ``_close_keeper``).
        self._exiting: set[asyncio.Task[None]] = set()
        #: --preload: the node's zygote (its process, the agent's end of its socket, its exit).
        self._zygote: tuple[asyncio.SubprocessTransport, socket.socket, asyncio.Future[int]] | None = None

    @property
    def workers(self) -> list[WorkerInfo]:
        """The workers of the current attempt (pid 0 for one that failed to start)."""
        return [WorkerInfo(w.local_rank, w.global_rank, w.pid) for w in self._workers]

    @property
    def exits(self) -> list[WorkerExit]:
        """The exits seen so far in the current attempt, in the order they happened."""
        return sorted((w.exit for w in self._workers if w.exit is not None),
                      key=lambda e: e.timestamp)

    # -- start ----------------------------------------------------------------------------

    async def start(self, assignment: RankAssignment) -> list[WorkerInfo]:
        """Start ``nproc`` workers for ``assignment``; return them by local rank.

        Each worker gets its own session and process group, stdin from /dev/null, stdout
        and stderr into the log pipeline, and a fresh error file path (a stale file from an
        earlier run is deleted). Every worker's log directory and files are made before the
        first worker starts. Raises RuntimeError if the previous attempt was not stopped,
        WorkerStartError if the log files cannot be made safely (no worker is started then)
        or a worker cannot be spawned (those already started are stopped).
        """
        if self._workers and (self._stop_task is None or not self._stop_task.done()):
            raise RuntimeError("the worker group is running: stop() it before starting again")
        loop = asyncio.get_running_loop()
        self._plugin_envs = {}
        prepared, self._plugin_envs = prepare_logs(self.spec, assignment, self.logs,
                                                   self._base_env)
        self.assignment = assignment
        self._workers = []
        self._stop_task = None
        self._stopping = False
        self._outcome = loop.create_future()
        for local_rank, (err, wlogs) in enumerate(prepared):
            exited: asyncio.Future[int] = loop.create_future()
            worker = WorkerHandle(local_rank, assignment.global_rank(local_rank), err, wlogs, exited)
            self._workers.append(worker)
            exited.add_done_callback(lambda fut, w=worker: self._on_exited(w, fut))
            worker.stacks = await self._open_stacks(assignment, local_rank)
            worker.recorder = await self._open_recorder(assignment, local_rank)
        self.start_marks = {}
        self._keeper = await self._start_keeper(loop, assignment)
        self.start_marks["keeper"] = time.monotonic()
        for worker, started in zip(list(self._workers), self._keeper.started):
            result = await started
            if isinstance(result, OSError):
                await self._start_failed(worker, result)
        self.start_marks["started"] = time.monotonic()
        await self.prepare()  # a zygote that died is replaced (imports) while this runs
        self._spare_later()
        self.state = WorkerState.HEALTHY
        return self.workers

    async def _connect_pipes(self, loop: asyncio.AbstractEventLoop, w: WorkerHandle,
                             write_ends: list[int]) -> list[int]:
        """Connect ``w``'s stdout and stderr pipes to its logs; return their write ends (also
        added to ``write_ends``, which the caller closes once the keeper holds them)."""
        ends = []
        for stream in (log_records.STDOUT, log_records.STDERR):
            if self.spec.worker_tty is not None:  # --worker-tty: a terminal per stream
                read_end, write_end, name = ptys.open_pty(self.spec.worker_tty)
                w.pipe_ttys.add(name)
            else:
                read_end, write_end = os.pipe()
                w.pipe_inodes.add(os.fstat(read_end).st_ino)
            write_ends.append(write_end)
            ends.append(write_end)
            pipe, _ = await loop.connect_read_pipe(
                lambda w=w, stream=stream: _PipeProtocol(w.logs, stream),
                open(read_end, "rb", buffering=0))  # noqa: SIM115 - the transport's
            w.pipes.append(pipe)
        return ends

    def _launch_args(self, w: WorkerHandle, assignment: RankAssignment
                     ) -> tuple[list[bytes], dict[bytes, bytes]]:
        """``w``'s argv and environment as the keeper takes them."""
        env = self._plugin_envs.get(w.local_rank) or worker_env(
            self.spec, assignment, w.local_rank, self._base_env)
        return ([os.fsencode(a) for a in worker_argv(self.spec, w.local_rank)],
                {os.fsencode(k): os.fsencode(v) for k, v in env.items()})

    async def _start_keeper(self, loop: asyncio.AbstractEventLoop,
                            assignment: RankAssignment) -> KeeperHandle:
        """Connect every worker's output pipes, start the keeper, and ask it for the workers.

        The keeper's end of the socket and the pipes' write ends go to the keeper only: once
        it has started the workers they are the workers' alone, and the agent's end of the
        socket is the only one (so its EOF is the agent's death).
        """
        spec = self.spec
        handle = KeeperHandle(loop, self._workers, spec.entrypoint[0])
        if self.warm:
            await self.prepare()
        # A forked worker's recipe (a keeper that is no zygote's fork execs them anyway).
        how = zygote.recipe(spec.entrypoint) if self.warm and spec.numa_binding is None else None
        spare = await self._take_spare()
        if spare is None and self._zygote is not None:
            forked = await self._start_from_zygote(loop, assignment, handle)
            if forked is not None:
                return forked
        if spare is None:
            try:
                spare = await self._spawn_keeper(loop)
            except OSError as exc:
                handle.fail_all(exc)
                return handle
        handle.process, handle.exited = spare.process, spare.exited
        handle.pid = spare.process.get_pid()
        return await self._ask_keeper(loop, spare.sock, handle, assignment, how)

    async def _ask_keeper(self, loop: asyncio.AbstractEventLoop, ours: socket.socket,
                          handle: KeeperHandle, assignment: RankAssignment,
                          how: tuple | None) -> KeeperHandle:
        """Hand a running keeper (``ours``: the agent's end of its socket) the workers to
        start, their pipes as SCM_RIGHTS (``how``: a forked worker's recipe, or None)."""
        write_ends: list[int] = []
        requests = []
        try:
            for w in self._workers:
                ends = await self._connect_pipes(loop, w, write_ends)
                requests.append((*self._launch_args(w, assignment), *ends, how))
            ours.setblocking(False)  # an idle keeper's socket has room: no thread's hop
            try:
                rest = zygote.send_request(ours, requests)
            except BlockingIOError:  # none: wait for it in a thread
                ours.setblocking(True)
                rest = await asyncio.to_thread(zygote.send_request, ours, requests)
                ours.setblocking(False)
            if rest:
                await loop.sock_sendall(ours, rest)
        except BaseException as exc:  # e.g. the keeper died just now: no worker can start
            return self._abandon_start(ours, handle, exc)
        finally:
            for fd in write_ends:
                os.close(fd)
        handle.channel, _ = await loop.create_unix_connection(
            lambda: KeeperChannel(handle), sock=ours)
        return handle

    # -- keepers started ahead of time (issue 23) -----------------------------------------

    async def _spawn_keeper(self, loop: asyncio.AbstractEventLoop) -> Spare:
        """Start a keeper that waits for its request (``python -I -S keeper.py FD``). Its
        end of the socket is its alone, so the agent's death (EOF) ends it, idle or not."""
        ours, theirs = socket.socketpair()
        exited: asyncio.Future[int] = loop.create_future()
        try:
            process, _ = await loop.subprocess_exec(
                lambda: KeeperProcess(exited), sys.executable, "-I", "-S",
                keeper.__file__, str(theirs.fileno()),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=None, pass_fds=(theirs.fileno(),), start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return Spare(process, ours, exited)

    def _spare_ahead(self) -> None:
        """Start the next attempt's keeper in the background, unless one is there or coming:
        exec'ed, or with a zygote, forked by it with the attempt's workers parked."""
        self._cancel_spare_timer()
        if self._spare is not None or self._closed:
            return
        loop = asyncio.get_running_loop()
        if self.warm and self._zygote is not None:
            if not self._zygote[2].done():  # a dead one is replaced by the next start
                self._spare = loop.create_task(self._fork_spare(loop), name="spare keeper")
            return
        self._spare = loop.create_task(self._spawn_keeper(loop), name="spare keeper")

    async def _fork_spare(self, loop: asyncio.AbstractEventLoop) -> Spare | None:
        """Have the zygote fork the next attempt's keeper, which forks its ``nproc`` workers
        at once and parks them before any user code (``keeper._Keeper.park``): the next
        start forks nothing, it hands each parked worker its argv, environment (the new
        round's ranks, world size, master port, restart count) and pipes. None if the zygote
        cannot (the start then forks a keeper as without it)."""
        assert self._zygote is not None
        process, sock, _ = self._zygote
        ours, theirs = socket.socketpair()
        try:
            # Under --numa-binding the workers are exec'ed (numactl): none to park.
            park = self.spec.nproc if self.spec.numa_binding is None else 0
            forked = await zygote.fork_keeper(sock, theirs.fileno(), park=park)
        except BaseException:
            ours.close()
            if self._zygote is not None and self._zygote[1] is sock:
                self._zygote = None  # its reply is unread: a new one answers the next attempt
                sock.close()
                process.close()
            raise
        finally:
            theirs.close()
        if not isinstance(forked, tuple):
            ours.close()
            return None
        pid, pidfd = forked
        exited: asyncio.Future[int] = loop.create_future()
        return Spare(ForkedKeeper(loop, pid, pidfd, exited), ours, exited)

    def _spare_later(self) -> None:
        """After a start: the next keeper once the workers had time to start (on 2 cores
        its interpreter would compete with theirs), or when a stop begins, if sooner."""
        if self._spare is None and not self._closed:
            self._spare_timer = asyncio.get_running_loop().call_later(
                SPARE_DELAY, self._spare_ahead)

    async def _take_spare(self) -> Spare | None:
        """The keeper started ahead for this attempt if it is alive, else None."""
        pending, self._spare = self._spare, None
        self._cancel_spare_timer()
        if pending is not None:
            try:
                spare = await pending
            except OSError as exc:
                log.warning("the keeper started ahead of time failed (%s): starting one now",
                            exc)
            else:
                if spare is not None and not spare.exited.done() and not hung_up(spare.sock):
                    return spare
                if spare is not None:
                    spare.close()
        return None

    def _cancel_spare_timer(self) -> None:
        if self._spare_timer is not None:
            self._spare_timer.cancel()
            self._spare_timer = None

    async def _drop_spare(self) -> None:
        pending, self._spare = self._spare, None
        self._cancel_spare_timer()
        if pending is None:
            return
        try:
            spare = await pending
        except OSError:
            return
        if spare is None:
            return
        spare.close()  # EOF: it exits, having started nothing (its parked workers with it)
        await asyncio.wait([spare.exited], timeout=KILL_WAIT)

    # -- --preload: warm zygotes ------------------------------------------------------------

    async def prepare(self) -> None:
        """When the workers are forked (``spec.preload``, or ``auto``), start the node's zygote
        (:mod:`.zygote`) unless a live one
        runs already (a dead one is replaced). It imports in the background: call this early
        (before the rendezvous). It forks each attempt's keeper. No-op without preload."""
        if not self.warm:
            if not self._workers:
                self._spare_ahead()  # the first attempt's keeper, during the rendezvous
            return
        if self._zygote is not None:
            if not self._zygote[2].done():
                return
            if self._spare is not None:  # it may be asking the dead zygote: its answer first
                await asyncio.wait([self._spare])
            await self._close_zygote()  # it died: replace it
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        argv = zygote.command(self.spec.entrypoint, self.preload, theirs.fileno(),
                              auto=not self.spec.preload, job=self.spec.job_id,
                              node=self.logs.node_id)
        if argv is None:
            ours.close()
            theirs.close()
            if not self._workers:
                self._spare_ahead()  # the exec path's keeper, then
            return
        exited: asyncio.Future[int] = loop.create_future()
        try:
            process, _ = await loop.subprocess_exec(
                lambda: KeeperProcess(exited), *argv, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=None, pass_fds=(theirs.fileno(),),
                start_new_session=True, env=zygote_env(self.spec, self._base_env))
        except OSError as exc:
            log.warning("cannot start the --preload zygote: %s", exc)
            ours.close()
            return
        finally:
            theirs.close()
        self._zygote = (process, ours, exited)

    async def close(self) -> None:
        """End the zygote and the keeper started ahead, if any (the agent's exit would end
        them too); the keepers the zygote forked live on until their own sockets close."""
        self._closed = True
        await self._drop_spare()
        if self._exiting:
            await asyncio.wait(list(self._exiting))  # the last keepers' own exits
        await self._close_zygote()

    async def _close_zygote(self) -> None:
        current, self._zygote = self._zygote, None
        if current is None:
            return
        process, sock, exited = current
        sock.close()  # EOF: the zygote exits
        await asyncio.wait([exited], timeout=KILL_WAIT)
        process.close()

    async def _start_from_zygote(self, loop: asyncio.AbstractEventLoop,
                                 assignment: RankAssignment, handle: KeeperHandle) -> KeeperHandle | None:
        """Have the zygote fork this attempt's keeper and hand it the workers (forked in turn
        where their recipe allows). None if the zygote cannot (a hazard, which it reported,
        or it is gone): the caller execs a keeper instead."""
        assert self._zygote is not None
        process, sock, _ = self._zygote
        ours, theirs = socket.socketpair()
        try:
            forked = await zygote.fork_keeper(sock, theirs.fileno())
        except BaseException:
            ours.close()
            self._zygote = None  # its reply is unread: a new one answers the next attempt
            sock.close()
            process.close()
            raise
        finally:
            theirs.close()  # the keeper's alone now (or nobody's)
        if not isinstance(forked, tuple):
            if forked is not None:
                log.warning("--preload: %s: this attempt's workers start without it", forked)
            ours.close()
            return None
        handle.pid, pidfd = forked
        handle.process = ForkedKeeper(  # type: ignore[assignment]
            loop, handle.pid, pidfd, handle.exited)
        spec = self.spec
        how = zygote.recipe(spec.entrypoint) if spec.numa_binding is None else None
        return await self._ask_keeper(loop, ours, handle, assignment, how)

    def _abandon_start(self, ours: socket.socket, handle: KeeperHandle,
                       exc: BaseException) -> KeeperHandle:
        """The keeper could not be asked for the workers: close our end of its socket (its EOF
        ends the keeper) and the workers' pipes (their logs see EOF: nothing will ever write
        there); an OSError fails every worker's start, anything else is raised."""
        ours.close()
        for w in self._workers:
            for pipe in w.pipes:
                pipe.close()
        if not isinstance(exc, OSError):
            raise exc
        handle.fail_all(exc)
        return handle

    async def _start_failed(self, worker: WorkerHandle, exc: OSError) -> None:
        """``worker`` could not be started: stop those that were (the keeper started none
        after it), then raise WorkerStartError."""
        for unused in self._workers[worker.local_rank + 1:]:
            for pipe in unused.pipes:
                pipe.close()
            if unused.stacks is not None:
                unused.stacks.close()
            if unused.recorder is not None:
                unused.recorder.close()
            unused.logs.close()
        del self._workers[worker.local_rank + 1:]
        worker.exited.set_result(-1)
        worker.exit = self._make_exit(worker, -1, f"could not start: {exc}")
        await self.stop(timeout=min(self.spec.shutdown_timeout, 5.0))
        raise WorkerStartError(
            f"cannot start worker {worker.local_rank} ({self.spec.entrypoint[0]}): {exc}"
        ) from exc

    # -- exits ----------------------------------------------------------------------------

    def _on_exited(self, worker: WorkerHandle, fut: asyncio.Future[int]) -> None:
        if fut.cancelled() or worker.exit is not None:
            return
        rc = fut.result()
        worker.exit = self._make_exit(worker, rc, None)
        if self.on_exit is not None:
            try:
                self.on_exit(worker.exit)
            except Exception:
                log.exception("on_exit callback failed for rank %d", worker.global_rank)
        if self._outcome is None or self._outcome.done() or self._stopping:
            return
        if rc != 0:
            self._settle(WorkerState.FAILED)
        elif all(w.exit is not None and w.exit.exit_code == 0 for w in self._workers):
            self._settle(WorkerState.SUCCEEDED)

    def _settle(self, state: WorkerState) -> None:
        exits = tuple(self.exits)
        failures = tuple(e for e in exits if e.failed and not e.stopping)
        self.state = state
        assert self._outcome is not None
        self._outcome.set_result(GroupResult(state, failures, exits))

    def _make_exit(self, worker: WorkerHandle, rc: int, message: str | None) -> WorkerExit:
        sig_name = None
        if rc < 0:
            try:
                sig_name = signal.Signals(-rc).name
            except ValueError:
                sig_name = f"SIG{-rc}"
        data = read_error_file(worker.error_file) if message is None else None
        if message is None:
            message = error_message(data) if data is not None else ""
        if not message:
            message = f"Signal {-rc} ({sig_name})" if sig_name else f"exit code {rc}"
        return WorkerExit(
            local_rank=worker.local_rank, global_rank=worker.global_rank, pid=worker.pid,
            exit_code=rc, signal=sig_name, message=message, error_file=data,
            timestamp=time.time(), error_file_path=str(worker.error_file),
            stopping=self._stopping)

    async def wait(self) -> GroupResult:
        """Wait for the group's outcome and return it.

        Returns FAILED as soon as any worker exits non-zero (with the failures known at that
        moment), SUCCEEDED once all exited 0, STOPPED if ``stop`` came first. It does not
        wait for the output to drain: call ``stop`` afterwards, which ends leftover
        processes and drains the pipes. Raises RuntimeError before ``start``.
        """
        if self._outcome is None:
            raise RuntimeError("the worker group was not started")
        return await asyncio.shield(self._outcome)

    # -- stacks ---------------------------------------------------------------------------

    async def _open_stacks(self, assignment: RankAssignment,
                           local_rank: int) -> probes.StackPipe | None:
        """The rank's stack FIFO, read by the loop; None (no stacks, the worker still starts)
        for a worker that is not Python or when it cannot be made."""
        if not stacks_on(self.spec):
            return None
        fifo = stacks_fifo(self.spec, assignment, local_rank)
        try:
            fd = probes.open_fifo(fifo, fifo.parent.parent)
            return await probes.StackPipe.connect(fd)
        except (OSError, ValueError) as exc:
            log.warning("no stacks for local rank %d (%s): %s", local_rank, fifo, exc)
            return None

    async def _open_recorder(self, assignment: RankAssignment,
                             local_rank: int) -> probes.RecorderLink | None:
        """The rank's recorder socket (issue 22); None when off or when it cannot be made
        (the worker still starts, without it)."""
        if not recorder_on(self.spec):
            return None
        path = recorder_socket(self.spec, assignment, local_rank)
        try:
            return await probes.RecorderLink.listen(path)
        except OSError as exc:
            log.warning("no collective traces for local rank %d (%s): %s", local_rank, path, exc)
            return None

    def recorder_targets(self, ranks: Iterable[int] | None = None,
                         ) -> list[tuple[int, int, probes.RecorderLink | None]]:
        """``(rank, pid, link)`` of the live workers of the current attempt (``ranks``: only
        those), for :func:`.recorder.ask_all`."""
        wanted = None if ranks is None else set(ranks)
        return [(w.global_rank, w.pid, w.recorder) for w in self._workers
                if (wanted is None or w.global_rank in wanted) and w.pid and not w.exited.done()]

    async def dump_stacks(self, ranks: Iterable[int] | None = None,
                          timeout: float = probes.ANSWER_TIMEOUT,
                          live_only: bool = False) -> list[probes.LocalDump]:
        """Every worker's Python stacks (``ranks``: only those) of the current attempt, asked
        at once, within ``timeout`` seconds (see :mod:`.stacks`)."""
        wanted = None if ranks is None else set(ranks)
        targets = [(w.global_rank, w.local_rank, w.pid, not w.exited.done(), w.stacks)
                   for w in self._workers if wanted is None or w.global_rank in wanted]
        if live_only:
            targets = [t for t in targets if t[3] and t[2]]
        signum = self.spec.stack_signal if stacks_on(self.spec) else None
        return await probes.dump_workers(targets, signum, timeout)

    # -- signals and stop -----------------------------------------------------------------

    async def signal_rank(self, global_rank: int, sig: int | str) -> bool:
        """Send ``sig`` (a number or a name such as ``"SIGTERM"``) to one worker's group.

        Returns False if that worker has already exited. Raises LookupError for a rank that
        is not on this node, ValueError for an unknown signal name.
        """
        signum = _signal_number(sig)
        for w in self._workers:
            if w.global_rank == global_rank:
                if w.exited.done() or not w.pid:
                    return False
                try:
                    os.killpg(w.pid, signum)
                except ProcessLookupError:
                    return False
                return True
        raise LookupError(f"rank {global_rank} is not a worker of this node")

    async def stop(self, timeout: float | None = None) -> None:
        """End every worker's whole process tree and drain their output. Idempotent.

        SIGTERM to each worker's process group and to the processes of its tree that left
        the group; up to ``timeout`` (default ``spec.shutdown_timeout``) for them to exit;
        SIGKILL to whatever is left. Returns when every worker is reaped, every stray
        process found is gone and the output pipes are drained (a pipe still held open by
        a process that could not be found is closed after a short grace). Concurrent calls
        share one stop.
        """
        if not self._workers:
            return
        if self._stop_task is None:
            self._stop_task = asyncio.get_running_loop().create_task(
                self._stop(self.spec.shutdown_timeout if timeout is None else timeout))
        await asyncio.shield(self._stop_task)

    async def _stop(self, timeout: float) -> None:
        self._stopping = True
        if self.state is WorkerState.SUCCEEDED:
            self._cancel_spare_timer()  # no next attempt to start a keeper for
        else:
            self._spare_ahead()  # the next attempt's keeper starts while these stop
        if self._outcome is not None and not self._outcome.done():
            self._settle(WorkerState.STOPPED)
        # The workers first, at once: the search for the rest of their trees (a walk of /proc)
        # runs while they shut down, not before (it was most of a restart's stop).
        signal_all(signal.SIGTERM, {}, self._workers)
        strays = await asyncio.to_thread(find_strays, self._workers, self._keeper)
        signal_all(signal.SIGTERM, strays)
        if not await wait_gone(self._workers, strays, timeout):
            # Look again: the tree may have grown while it was shutting down.
            strays.update(await asyncio.to_thread(find_strays, self._workers, self._keeper))
            left = [w.global_rank for w in self._workers if not w.exited.done()]
            log.warning("worker processes still running %.1f s after SIGTERM (ranks %s, "
                        "%d other processes of their trees): sending SIGKILL", timeout, left,
                        sum(1 for p in strays.values() if running(p)))
            signal_all(signal.SIGKILL, strays, self._workers)
            if not await wait_gone(self._workers, strays, KILL_WAIT):
                log.error("some worker processes survived SIGKILL for %.0f s (uninterruptible "
                          "sleep?); giving up on them", KILL_WAIT)
        # Anything still in a worker's group or tree (an orphan that ignored SIGTERM after
        # its parent died) gets SIGKILL, so nothing outlives the group: the keeper's end does
        # it for the tree (at EOF it SIGKILLs every descendant, orphans being reparented to
        # it), while /proc is searched for the rest (a worker's marker outside the tree; not
        # the tree again, a second walk of every process on a restart's path).
        late_scan = asyncio.ensure_future(
            asyncio.to_thread(find_strays, self._workers, self._keeper, False))
        closing = asyncio.ensure_future(self._close_keeper())
        try:
            late = await late_scan
            signal_all(signal.SIGKILL, late, self._workers)
            await wait_gone(self._workers, late, KILL_WAIT)
            await self._drain()
            for w in self._workers:
                if w.recorder is not None:
                    w.recorder.close()
                if w.stacks is not None:
                    w.stacks.close()
                    if self.assignment is not None:
                        with contextlib.suppress(OSError):
                            os.unlink(stacks_fifo(self.spec, self.assignment, w.local_rank))
        finally:
            await closing

    async def _close_keeper(self) -> None:
        """End our half of the keeper's socket and wait until it has ended whatever is left
        of the tree (nothing, after a stop that went well): it closes its end then, before
        its own exit, which is awaited in the background (``close`` waits for it)."""
        handle = self._keeper
        if handle is None:
            return
        handle.closing = True
        channel = handle.channel
        if channel is not None and channel.can_write_eof() and not channel.is_closing():
            channel.write_eof()  # EOF for the keeper; its own EOF answers once the tree is gone
        elif channel is not None:
            channel.close()
        if handle.process is None:
            return
        done, _ = await asyncio.wait([handle.ended, handle.exited], timeout=KILL_WAIT,
                                     return_when=asyncio.FIRST_COMPLETED)
        if channel is not None:
            channel.close()
        if not done:
            log.error("the keeper process %d did not end the workers' tree %.0f s after their "
                      "stop; killing it", handle.pid, KILL_WAIT)
        if handle.exited.done() or not done:
            handle.process.close()  # kills it if it is still there
            return
        task = asyncio.get_running_loop().create_task(self._keeper_exit(handle))
        self._exiting.add(task)
        task.add_done_callback(self._exiting.discard)

    async def _keeper_exit(self, handle: KeeperHandle) -> None:
        """A keeper that ended its tree exits on its own; killed if it has not after a while."""
        _, pending = await asyncio.wait([handle.exited], timeout=KILL_WAIT)
        if pending:
            log.error("the keeper process %d did not exit %.0f s after the workers' stop; "
                      "killing it", handle.pid, KILL_WAIT)
        assert handle.process is not None
        handle.process.close()  # kills it if it is still there

    async def _drain(self) -> None:
        undrained = [w for w in self._workers if not w.logs.drained.is_set()]
        if undrained:
            waits = [asyncio.ensure_future(w.logs.drained.wait()) for w in undrained]
            _, pending = await asyncio.wait(waits, timeout=DRAIN_WAIT)
            if pending:
                # Someone we could not find by parentage or environment still holds a pipe:
                # find it by the pipe itself, kill it, then give up on the pipe.
                inodes = set().union(*(w.pipe_inodes for w in undrained))
                ttys = set().union(*(w.pipe_ttys for w in undrained))
                holders = await asyncio.to_thread(pipe_holders, inodes, ttys)
                if holders:
                    log.warning("killing %d process(es) still holding worker output pipes",
                                len(holders))
                    signal_all(signal.SIGKILL, holders, self._workers)
                    await wait_gone(self._workers, holders, KILL_WAIT)
                    _, pending = await asyncio.wait(pending, timeout=DRAIN_WAIT)
                for fut in pending:
                    fut.cancel()
        for w in self._workers:
            for pipe in w.pipes:
                pipe.close()  # every process is gone; this only releases the pipes
            w.logs.close()
        if self.state is WorkerState.HEALTHY:
            self.state = WorkerState.STOPPED


# -- helpers -------------------------------------------------------------------------------

def _signal_number(sig: int | str) -> int:
    if isinstance(sig, str):
        name = sig.upper()
        if not name.startswith("SIG"):
            name = "SIG" + name
        try:
            return int(signal.Signals[name])
        except KeyError:
            raise ValueError(f"unknown signal {sig!r}") from None
    return int(sig)
