"""The local worker group: spawn, environment, exits, error files, signals, whole-tree stops.

A :class:`WorkerGroup` runs ``nproc`` copies of the entrypoint with torchrun's worker
environment (:func:`worker_env`), each in its own process group and session, with stdout and
stderr piped into the log pipeline (:mod:`elastic_agent.supervision.records.logs`).

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
import errno
import json
import logging
import os
import select
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import psutil

from elastic_agent.coordination import protocol
from elastic_agent.supervision.launch import keeper, zygote
from elastic_agent.supervision.records.logs import (
    LogPathError,
    NodeLogs,
    WorkerLogs,
    open_private_dir,
    plugin_destinations,
)

from . import probes

log = logging.getLogger(__name__)

#: How long stop() waits for SIGKILLed processes before giving up on them (a process in
#: uninterruptible sleep, e.g. wedged in a driver, cannot die sooner).
KILL_WAIT = 10.0
#: How long stop() waits for the output pipes to reach EOF once every process is gone.
DRAIN_WAIT = 2.0
#: How long after a start the next attempt's keeper is started (a stop starts it at once).
SPARE_DELAY = 0.5
#: A larger error file is not read (a worker could otherwise make the agent load gigabytes).
ERROR_FILE_MAX_BYTES = 4 << 20


class WorkerState(str, Enum):
    """The state of a worker group (the subset of torch's ``WorkerState`` that applies)."""

    INIT = "INIT"
    HEALTHY = "HEALTHY"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


class WorkerStartError(RuntimeError):
    """A worker could not be started (e.g. the entrypoint does not exist, or its log files
    cannot be created safely). The message is one line for the terminal."""


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """What to run on this node, and how (torch's ``WorkerSpec`` for one role).

    ``entrypoint`` is the full argv (e.g. ``[sys.executable, "-u", "train.py", *args]``).
    ``log_dir`` is the run's own directory (``<--log-dir>/<run_id>_<random>``, made by the
    agent, never shared with another agent); attempts go in ``log_dir/attempt_<n>/<local_rank>/``
    as in torch's ``DefaultLogsSpecs``. ``log_dir``'s parent is the user's; ``log_dir`` and
    everything below it are the agent's, private and checked (``logs.open_private_dir``).
    ``extra_env`` is added to every worker's
    environment before torchrun's variables (which win).
    """

    role: str = "default"
    nproc: int
    entrypoint: Sequence[str]
    max_restarts: int = 0
    run_id: str
    redis_url: str = ""
    job_id: str
    log_dir: Path
    shutdown_timeout: float = 30.0
    use_agent_store: bool = False
    extra_env: Mapping[str, str] = field(default_factory=dict)
    virtual_local_rank: bool = False
    numa_binding: str | None = None
    #: ``--preload``: modules a warm zygote imports; its workers are forked from it.
    preload: tuple[str, ...] = ()
    #: ``--preload auto``: without ``preload``, Python workers are forked from a zygote that
    #: imported what :func:`.zygote.auto_preload` finds the script starting with (torch).
    preload_auto: bool = False
    #: torchrun's --signals-to-handle, which its launcher puts in the workers' environment.
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    #: torchrun's --logs-specs: a ``torch_compat.LogsSpecsPlugin`` whose ``reify`` decides
    #: each attempt's files and environment, instead of the layout below ``log_dir``.
    logs_specs: Any = None
    #: ``--stack-signal``: the signal Python workers dump their stacks on (None: off).
    stack_signal: int | None = probes.DEFAULT_SIGNAL
    #: ``--flight-recorder``: entries of torch's flight recorder per worker; > 0 also links a
    #: Python worker's trace thread to the agent (:mod:`.recorder`, issue 22).
    flight_recorder: int = 0

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"nproc must be at least 1, not {self.nproc}")
        if not self.entrypoint:
            raise ValueError("the entrypoint is empty")
        object.__setattr__(self, "entrypoint", tuple(str(a) for a in self.entrypoint))
        object.__setattr__(self, "log_dir", Path(self.log_dir))
        object.__setattr__(self, "extra_env", dict(self.extra_env))
        object.__setattr__(self, "preload", tuple(self.preload))


@dataclass(frozen=True, kw_only=True)
class RankAssignment:
    """This node's place in a rendezvous round, and the attempt it starts.

    ``base_rank`` is the global rank of local rank 0. ``role_base_rank`` and
    ``role_world_size`` default to the global ones (a job with a single role).
    """

    group_rank: int
    group_world_size: int
    world_size: int
    base_rank: int
    master_addr: str
    master_port: int
    restart_count: int = 0
    attempt: int = 0
    role_base_rank: int | None = None
    role_world_size: int | None = None

    def global_rank(self, local_rank: int) -> int:
        return self.base_rank + local_rank

    def role_rank(self, local_rank: int) -> int:
        base = self.base_rank if self.role_base_rank is None else self.role_base_rank
        return base + local_rank

    @property
    def role_size(self) -> int:
        return self.world_size if self.role_world_size is None else self.role_world_size


def error_file_path(spec: WorkerSpec, assignment: RankAssignment, local_rank: int) -> Path:
    """``log_dir/attempt_<n>/<local_rank>/error.json``: torch's ``DefaultLogsSpecs`` layout
    (``log_dir`` is this agent's alone, so the stray scan's markers stay unique)."""
    return spec.log_dir / f"attempt_{assignment.attempt}" / str(local_rank) / "error.json"


def worker_env(spec: WorkerSpec, assignment: RankAssignment, local_rank: int,
               base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The complete environment of one worker, as torchrun 2.13 builds it, plus ours.

    ``base_env`` (default ``os.environ``) is inherited; ``OMP_NUM_THREADS=1`` is added when
    ``nproc > 1`` and the user has not set it (torchrun's run.py); then
    ``spec.extra_env``; then torchrun's variables (``LocalElasticAgent._start_workers`` and
    ``DefaultLogsSpecs.reify``) and ``ELASTIC_REDIS_URL`` / ``ELASTIC_JOB_ID``.
    """
    env = dict(os.environ if base_env is None else base_env)
    env.update(spec.extra_env)
    if spec.nproc > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"
    env.update({
        "RANK": str(assignment.global_rank(local_rank)),
        "LOCAL_RANK": "0" if spec.virtual_local_rank else str(local_rank),
        "GROUP_RANK": str(assignment.group_rank),
        "ROLE_RANK": str(assignment.role_rank(local_rank)),
        "ROLE_NAME": spec.role,
        "LOCAL_WORLD_SIZE": str(spec.nproc),
        "WORLD_SIZE": str(assignment.world_size),
        "GROUP_WORLD_SIZE": str(assignment.group_world_size),
        "ROLE_WORLD_SIZE": str(assignment.role_size),
        "MASTER_ADDR": assignment.master_addr,
        "MASTER_PORT": str(assignment.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(assignment.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": spec.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(spec.use_agent_store),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_ERROR_FILE": str(error_file_path(spec, assignment, local_rank)),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": spec.signals_to_handle,
        "ELASTIC_REDIS_URL": spec.redis_url,
        "ELASTIC_JOB_ID": spec.job_id,
    })
    if _stacks_on(spec):
        env.update(probes.worker_vars(spec.stack_signal,
                                      _stacks_fifo(spec, assignment, local_rank)))
    if _recorder_on(spec):
        env[zygote.RECORDER_ENV] = str(_recorder_socket(spec, assignment, local_rank))
    if spec.virtual_local_rank:
        # torch's LocalElasticAgent: each worker sees only its own GPU, as device 0.
        visible = (base_env if base_env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible is not None else None
        env["CUDA_VISIBLE_DEVICES"] = (gpus[local_rank].strip() if gpus is not None
                                       and local_rank < len(gpus) else str(local_rank))
    return env


def worker_argv(spec: WorkerSpec, local_rank: int) -> list[str]:
    """The worker's command line: the entrypoint, wrapped in numactl by torch's own rules
    under ``--numa-binding`` (torch imported only then); a Python worker is started through
    the stack handler's bootstrap (:func:`.stacks.boot_argv`)."""
    entrypoint = (probes.boot_argv(spec.entrypoint) if _stacks_on(spec) or _recorder_on(spec)
                  else spec.entrypoint)
    if spec.numa_binding is None:
        return list(entrypoint)
    from elastic_agent.coordination.torch_compat import numa_bound_argv

    return numa_bound_argv(entrypoint, local_rank, spec.numa_binding)


def _stacks_on(spec: WorkerSpec) -> bool:
    return spec.stack_signal is not None and probes.is_python_entrypoint(spec.entrypoint)


def _recorder_on(spec: WorkerSpec) -> bool:
    return spec.flight_recorder > 0 and probes.is_python_entrypoint(spec.entrypoint)


def _recorder_socket(spec: WorkerSpec, assignment: RankAssignment, local_rank: int) -> Path:
    return probes.socket_path(f"{spec.log_dir}|{assignment.attempt}|{local_rank}")


def _stacks_fifo(spec: WorkerSpec, assignment: RankAssignment, local_rank: int) -> Path:
    """The rank's stack FIFO, in the agent's private runtime directory (never in the log
    tree, whose layout is torch's)."""
    return probes.fifo_path(f"{spec.log_dir}|{assignment.attempt}|{local_rank}")


@dataclass(frozen=True)
class WorkerInfo:
    """A started worker."""

    local_rank: int
    global_rank: int
    pid: int


@dataclass(frozen=True)
class WorkerExit:
    """How a worker ended.

    ``exit_code`` is the return code (negative for a signal, as in torch); ``signal`` its
    name (``"SIGKILL"``) or None; ``message`` the error file's message when the worker wrote
    one (torch's ``@record``), else ``"Signal 9 (SIGKILL)"`` or ``"exit code 3"``;
    ``error_file`` the file's parsed content or None. ``timestamp`` is this host's
    ``time.time()`` when the exit was seen. ``stopping`` is True for an exit caused by
    :meth:`WorkerGroup.stop`.
    """

    local_rank: int
    global_rank: int
    pid: int
    exit_code: int | None
    signal: str | None
    message: str
    error_file: dict[str, Any] | None
    timestamp: float
    error_file_path: str = ""
    stopping: bool = False

    @property
    def failed(self) -> bool:
        return self.exit_code != 0

    def event_data(self) -> dict[str, Any]:
        """The fields of a ``worker_exited`` event (see ``protocol.EventType``)."""
        return {
            "rank": self.global_rank, "local_rank": self.local_rank, "pid": self.pid,
            "exit_code": self.exit_code, "signal": self.signal, "message": self.message,
            "error_file": self.error_file, "timestamp": self.timestamp,
            "stopping": self.stopping,
        }


@dataclass(frozen=True)
class GroupResult:
    """What :meth:`WorkerGroup.wait` saw: the state and the exits known at that moment."""

    state: WorkerState
    failures: tuple[WorkerExit, ...] = ()
    exits: tuple[WorkerExit, ...] = ()

    @property
    def root_cause(self) -> WorkerExit | None:
        """The earliest failure (the one that brought the group down)."""
        return min(self.failures, key=lambda e: e.timestamp) if self.failures else None


class _Worker:
    __slots__ = ("error_file", "exit", "exited", "global_rank", "local_rank", "logs", "pid",
                 "pipe_inodes", "pipes", "recorder", "stacks")

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
        self.stacks: probes.StackPipe | None = None
        self.recorder: probes.RecorderLink | None = None


class _PipeProtocol(asyncio.Protocol):
    """One of a worker's output pipes: each chunk (up to 256 KiB) straight to its log sink."""

    def __init__(self, logs: WorkerLogs, stream: str) -> None:
        self._logs = logs
        self._stream = stream

    def data_received(self, data: bytes) -> None:
        self._logs.feed(self._stream, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._logs.eof(self._stream)


class _Keeper:
    """The agent's side of a group's keeper process (:mod:`.keeper`): which workers it has
    started (a pid, or the OSError of a failed exec), their exits, its own exit."""

    def __init__(self, loop: asyncio.AbstractEventLoop, workers: list[_Worker],
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


class _KeeperChannel(asyncio.Protocol):
    def __init__(self, handle: _Keeper) -> None:
        self._handle = handle
        self._unframer = keeper.Unframer()

    def data_received(self, data: bytes) -> None:
        for message in self._unframer.feed(data):
            self._handle.on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._handle.on_lost()


class _KeeperProcess(asyncio.SubprocessProtocol):
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


class _ForkedKeeper:
    """``_Keeper.process`` for a keeper the zygote forked: no child of the agent, so its exit
    is seen on a pidfd (opened by the zygote before it could reap it), without its status."""

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
class _Spare:
    """A keeper started ahead of time, waiting for its request: exec'ed, or forked by the
    zygote with the workers of its attempt parked (``keeper._Keeper.park``)."""

    process: asyncio.SubprocessTransport | _ForkedKeeper
    sock: socket.socket
    exited: asyncio.Future[int]

    def close(self) -> None:
        self.sock.close()
        if self.exited.done():
            self.process.close()


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
        self.on_exit = on_exit
        self._base_env = base_env
        #: --logs-specs: the environments the plugin's reify left, by local rank.
        self._plugin_envs: dict[int, dict[str, str]] = {}
        self.state = WorkerState.INIT
        self.assignment: RankAssignment | None = None
        self._workers: list[_Worker] = []
        self._outcome: asyncio.Future[GroupResult] | None = None
        self._stop_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._keeper: _Keeper | None = None
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
        self._spare: asyncio.Task[_Spare | None] | None = None
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
        prepared = self._prepare_logs(assignment)
        self.assignment = assignment
        self._workers = []
        self._stop_task = None
        self._stopping = False
        self._outcome = loop.create_future()
        for local_rank, (err, wlogs) in enumerate(prepared):
            exited: asyncio.Future[int] = loop.create_future()
            worker = _Worker(local_rank, assignment.global_rank(local_rank), err, wlogs, exited)
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

    async def _connect_pipes(self, loop: asyncio.AbstractEventLoop, w: _Worker,
                             write_ends: list[int]) -> list[int]:
        """Connect ``w``'s stdout and stderr pipes to its logs; return their write ends (also
        added to ``write_ends``, which the caller closes once the keeper holds them)."""
        ends = []
        for stream in (protocol.STDOUT, protocol.STDERR):
            read_end, write_end = os.pipe()
            write_ends.append(write_end)
            ends.append(write_end)
            w.pipe_inodes.add(os.fstat(read_end).st_ino)
            pipe, _ = await loop.connect_read_pipe(
                lambda w=w, stream=stream: _PipeProtocol(w.logs, stream),
                open(read_end, "rb", buffering=0))  # noqa: SIM115 - the transport's
            w.pipes.append(pipe)
        return ends

    def _launch_args(self, w: _Worker, assignment: RankAssignment
                     ) -> tuple[list[bytes], dict[bytes, bytes]]:
        """``w``'s argv and environment as the keeper takes them."""
        env = self._plugin_envs.get(w.local_rank) or worker_env(
            self.spec, assignment, w.local_rank, self._base_env)
        return ([os.fsencode(a) for a in worker_argv(self.spec, w.local_rank)],
                {os.fsencode(k): os.fsencode(v) for k, v in env.items()})

    async def _start_keeper(self, loop: asyncio.AbstractEventLoop,
                            assignment: RankAssignment) -> _Keeper:
        """Connect every worker's output pipes, start the keeper, and ask it for the workers.

        The keeper's end of the socket and the pipes' write ends go to the keeper only: once
        it has started the workers they are the workers' alone, and the agent's end of the
        socket is the only one (so its EOF is the agent's death).
        """
        spec = self.spec
        handle = _Keeper(loop, self._workers, spec.entrypoint[0])
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
                          handle: _Keeper, assignment: RankAssignment,
                          how: tuple | None) -> _Keeper:
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
            lambda: _KeeperChannel(handle), sock=ours)
        return handle

    # -- keepers started ahead of time (issue 23) -----------------------------------------

    async def _spawn_keeper(self, loop: asyncio.AbstractEventLoop) -> _Spare:
        """Start a keeper that waits for its request (``python -I -S keeper.py FD``). Its
        end of the socket is its alone, so the agent's death (EOF) ends it, idle or not."""
        ours, theirs = socket.socketpair()
        exited: asyncio.Future[int] = loop.create_future()
        try:
            process, _ = await loop.subprocess_exec(
                lambda: _KeeperProcess(exited), sys.executable, "-I", "-S",
                keeper.__file__, str(theirs.fileno()),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=None, pass_fds=(theirs.fileno(),), start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return _Spare(process, ours, exited)

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

    async def _fork_spare(self, loop: asyncio.AbstractEventLoop) -> _Spare | None:
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
        return _Spare(_ForkedKeeper(loop, pid, pidfd, exited), ours, exited)

    def _spare_later(self) -> None:
        """After a start: the next keeper once the workers had time to start (on 2 cores
        its interpreter would compete with theirs), or when a stop begins, if sooner."""
        if self._spare is None and not self._closed:
            self._spare_timer = asyncio.get_running_loop().call_later(
                SPARE_DELAY, self._spare_ahead)

    async def _take_spare(self) -> _Spare | None:
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
                if spare is not None and not spare.exited.done() and not _hung_up(spare.sock):
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

    def _zygote_env(self) -> dict[str, str]:
        """The workers' environment without the launcher's per-rank variables."""
        env = dict(os.environ if self._base_env is None else self._base_env)
        env.update(self.spec.extra_env)
        if self.spec.nproc > 1 and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = "1"
        return {k: v for k, v in env.items() if k not in zygote.LAUNCHER_VARS}

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
                              auto=not self.spec.preload)
        if argv is None:
            ours.close()
            theirs.close()
            if not self._workers:
                self._spare_ahead()  # the exec path's keeper, then
            return
        exited: asyncio.Future[int] = loop.create_future()
        try:
            process, _ = await loop.subprocess_exec(
                lambda: _KeeperProcess(exited), *argv, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=None, pass_fds=(theirs.fileno(),),
                start_new_session=True, env=self._zygote_env())
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
                                 assignment: RankAssignment, handle: _Keeper) -> _Keeper | None:
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
        handle.process = _ForkedKeeper(  # type: ignore[assignment]
            loop, handle.pid, pidfd, handle.exited)
        spec = self.spec
        how = zygote.recipe(spec.entrypoint) if spec.numa_binding is None else None
        return await self._ask_keeper(loop, ours, handle, assignment, how)

    def _abandon_start(self, ours: socket.socket, handle: _Keeper,
                       exc: BaseException) -> _Keeper:
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

    async def _start_failed(self, worker: _Worker, exc: OSError) -> None:
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

    def _prepare_logs(self, assignment: RankAssignment) -> list[tuple[Path, WorkerLogs]]:
        """Each local rank's error file path and open log sink; WorkerStartError if any
        cannot be made (the ones already open are closed)."""
        spec = self.spec
        self._plugin_envs = {}
        if spec.logs_specs is not None:
            return self._prepare_plugin_logs(assignment)
        prepared: list[tuple[Path, WorkerLogs]] = []
        try:
            for local_rank in range(spec.nproc):
                err = error_file_path(spec, assignment, local_rank)
                dir_fd = open_private_dir(err.parent, base=spec.log_dir.parent)
                try:
                    # A stale file would be read as this attempt's failure. unlink never
                    # follows a symlink: it removes the link, not its target.
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(err.name, dir_fd=dir_fd)
                except OSError as exc:
                    raise LogPathError(f"cannot remove the stale error file {err}: "
                                       f"{exc.strerror or exc}") from exc
                finally:
                    os.close(dir_fd)
                wlogs = self.logs.open_worker(
                    directory=err.parent, role=spec.role, rank=assignment.global_rank(local_rank),
                    local_rank=local_rank, attempt=assignment.attempt)
                prepared.append((err, wlogs))
        except OSError as exc:
            for _, wlogs in prepared:
                wlogs.close()
            raise WorkerStartError(str(exc)) from exc
        return prepared

    def _prepare_plugin_logs(self, assignment: RankAssignment) -> list[tuple[Path, WorkerLogs]]:
        """--logs-specs: the plugin's ``reify`` sees every worker's environment (and may
        change it, as torch's default sets the error file) and names each stream's file;
        the workers get the environments it leaves."""
        spec = self.spec
        envs = {lr: worker_env(spec, assignment, lr, self._base_env) for lr in range(spec.nproc)}
        try:
            plan = spec.logs_specs.reify(envs)
        except Exception as exc:  # a third party's plugin may raise anything
            raise WorkerStartError(f"--logs-specs {spec.logs_specs.name}: its reify failed "
                                   f"({type(exc).__name__}: {exc})") from None
        prepared: list[tuple[Path, WorkerLogs]] = []
        try:
            for lr in range(spec.nproc):
                err = Path(plan.error_files.get(lr) or envs[lr].get(
                    "TORCHELASTIC_ERROR_FILE") or os.devnull)
                envs[lr]["TORCHELASTIC_ERROR_FILE"] = "" if str(err) == os.devnull else str(err)
                if str(err) != os.devnull:
                    with contextlib.suppress(FileNotFoundError):
                        if not err.is_symlink():
                            err.unlink()  # a stale file would be read as this attempt's
                wlogs = self.logs.open_worker(
                    directory=err.parent, role=spec.role, rank=assignment.global_rank(lr),
                    local_rank=lr, attempt=assignment.attempt,
                    destinations=plugin_destinations(plan, lr))
                prepared.append((err, wlogs))
        except OSError as exc:
            for _, wlogs in prepared:
                wlogs.close()
            raise WorkerStartError(str(exc)) from exc
        self._plugin_envs = envs
        return prepared

    # -- exits ----------------------------------------------------------------------------

    def _on_exited(self, worker: _Worker, fut: asyncio.Future[int]) -> None:
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

    def _make_exit(self, worker: _Worker, rc: int, message: str | None) -> WorkerExit:
        sig_name = None
        if rc < 0:
            try:
                sig_name = signal.Signals(-rc).name
            except ValueError:
                sig_name = f"SIG{-rc}"
        data = _read_error_file(worker.error_file) if message is None else None
        if message is None:
            message = _error_message(data) if data is not None else ""
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
        if not _stacks_on(self.spec):
            return None
        fifo = _stacks_fifo(self.spec, assignment, local_rank)
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
        if not _recorder_on(self.spec):
            return None
        path = _recorder_socket(self.spec, assignment, local_rank)
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
        signum = self.spec.stack_signal if _stacks_on(self.spec) else None
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
        self._signal_all(signal.SIGTERM, {})
        strays = await asyncio.to_thread(self._find_strays)
        self._signal_all(signal.SIGTERM, strays, workers=False)
        if not await self._wait_gone(strays, timeout):
            # Look again: the tree may have grown while it was shutting down.
            strays.update(await asyncio.to_thread(self._find_strays))
            left = [w.global_rank for w in self._workers if not w.exited.done()]
            log.warning("worker processes still running %.1f s after SIGTERM (ranks %s, "
                        "%d other processes of their trees): sending SIGKILL", timeout, left,
                        sum(1 for p in strays.values() if _running(p)))
            self._signal_all(signal.SIGKILL, strays)
            if not await self._wait_gone(strays, KILL_WAIT):
                log.error("some worker processes survived SIGKILL for %.0f s (uninterruptible "
                          "sleep?); giving up on them", KILL_WAIT)
        # Anything still in a worker's group or tree (an orphan that ignored SIGTERM after
        # its parent died) gets SIGKILL, so nothing outlives the group: the keeper's end does
        # it for the tree (at EOF it SIGKILLs every descendant, orphans being reparented to
        # it), while /proc is searched for the rest (a worker's marker outside the tree; not
        # the tree again, a second walk of every process on a restart's path).
        late_scan = asyncio.ensure_future(asyncio.to_thread(self._find_strays, False))
        closing = asyncio.ensure_future(self._close_keeper())
        try:
            late = await late_scan
            self._signal_all(signal.SIGKILL, late)
            await self._wait_gone(late, KILL_WAIT)
            await self._drain()
            for w in self._workers:
                if w.recorder is not None:
                    w.recorder.close()
                if w.stacks is not None:
                    w.stacks.close()
                    if self.assignment is not None:
                        with contextlib.suppress(OSError):
                            os.unlink(_stacks_fifo(self.spec, self.assignment, w.local_rank))
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

    async def _keeper_exit(self, handle: _Keeper) -> None:
        """A keeper that ended its tree exits on its own; killed if it has not after a while."""
        _, pending = await asyncio.wait([handle.exited], timeout=KILL_WAIT)
        if pending:
            log.error("the keeper process %d did not exit %.0f s after the workers' stop; "
                      "killing it", handle.pid, KILL_WAIT)
        assert handle.process is not None
        handle.process.close()  # kills it if it is still there

    def _find_strays(self, tree: bool = True) -> dict[int, psutil.Process]:
        """Processes of the workers' trees other than the workers themselves.

        Children are found by parentage while their worker lives; orphans (reparented to
        init) and daemons (new session) by the worker's error file path in their
        environment, which they inherited. ``tree`` False: only the latter. Runs in a
        thread: it reads /proc.
        """
        me = os.getpid()
        worker_pids = {w.pid for w in self._workers if w.pid}
        roots = [w.pid for w in self._workers if w.pid and not w.exited.done()]
        handle = self._keeper
        if handle is not None and handle.pid and not handle.exited.done():
            roots.append(handle.pid)  # the tree's subreaper: its descendants are the tree
        if not tree:
            roots = []
        found: dict[int, psutil.Process] = {}
        parents = keeper.parents() if roots else {}  # one walk of /proc for every root
        for root in roots:
            for pid in keeper.descendants(root, parents) - worker_pids:
                with contextlib.suppress(psutil.Error):
                    found[pid] = psutil.Process(pid)
        keeper_pid = handle.pid if handle is not None else 0
        markers = [b"\0TORCHELASTIC_ERROR_FILE=" + os.fsencode(w.error_file) + b"\0"
                   for w in self._workers]
        for pid in _with_marker(markers, {*found, *worker_pids, me, keeper_pid}):
            with contextlib.suppress(psutil.Error):
                found[pid] = psutil.Process(pid)
        return found

    def _signal_all(self, sig: signal.Signals, strays: Mapping[int, psutil.Process],
                    workers: bool = True) -> None:
        own_group = os.getpgrp()
        for w in self._workers if workers else ():
            # The group outlives its leader while any member lives: signal it even if the
            # worker itself has exited.
            if w.pid and w.pid != own_group:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(w.pid, sig)
        for proc in strays.values():
            try:
                if not proc.is_running():  # psutil also guards against a reused pid
                    continue
                pgid = os.getpgid(proc.pid)
                if pgid == proc.pid and pgid != own_group:
                    os.killpg(pgid, sig)  # a daemon leading its own group: take its children
                else:
                    proc.send_signal(sig)
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue

    async def _wait_gone(self, strays: Mapping[int, psutil.Process], timeout: float) -> bool:
        """Wait until every worker has exited and every stray is gone; False on timeout."""
        waits: list[asyncio.Future[Any]] = [w.exited for w in self._workers
                                            if not w.exited.done()]
        closers: list[Callable[[], None]] = []
        for proc in strays.values():
            fut, close = _process_gone(proc)
            if fut is not None:
                waits.append(fut)
                closers.append(close)
        try:
            if not waits:
                return True
            _, pending = await asyncio.wait(waits, timeout=timeout)
            return not pending
        finally:
            for close in closers:
                close()

    async def _drain(self) -> None:
        undrained = [w for w in self._workers if not w.logs.drained.is_set()]
        if undrained:
            waits = [asyncio.ensure_future(w.logs.drained.wait()) for w in undrained]
            _, pending = await asyncio.wait(waits, timeout=DRAIN_WAIT)
            if pending:
                # Someone we could not find by parentage or environment still holds a pipe:
                # find it by the pipe itself, kill it, then give up on the pipe.
                inodes = set().union(*(w.pipe_inodes for w in undrained))
                holders = await asyncio.to_thread(_pipe_holders, inodes)
                if holders:
                    log.warning("killing %d process(es) still holding worker output pipes",
                                len(holders))
                    self._signal_all(signal.SIGKILL, holders)
                    await self._wait_gone(holders, KILL_WAIT)
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

def _hung_up(sock: socket.socket) -> bool:
    """Whether the other end of an idle keeper's socket is closed (the keeper died): it writes
    nothing before its request, so anything to read is its EOF. Seen before the loop has
    reaped the keeper, which would take a moment longer."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLHUP)
    return bool(poller.poll(0))


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


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _read_error_file(path: Path) -> dict[str, Any] | None:
    """The worker's error file (torch's ``@record`` format), or None if absent or invalid.

    The file is the worker's, so it is read as untrusted: never through a symlink (which
    could make the agent publish a file the worker chose), only if it is a regular file (a
    FIFO would block the event loop; O_NONBLOCK keeps the open itself from blocking), only
    up to ERROR_FILE_MAX_BYTES, and nesting too deep for ``json`` is only a bad file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else exc
        log.warning("cannot read the error file %s: %s", path, why)
        return None
    with open(fd, "rb") as fp:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            log.warning("cannot read the error file %s: it is not a regular file", path)
            return None
        raw = fp.read(ERROR_FILE_MAX_BYTES + 1)
    if len(raw) > ERROR_FILE_MAX_BYTES:
        log.warning("cannot read the error file %s: larger than %d bytes", path,
                    ERROR_FILE_MAX_BYTES)
        return None
    try:
        data = json.loads(raw.decode("utf-8", "replace"))
    except (ValueError, RecursionError) as exc:
        log.warning("cannot read the error file %s: %s", path, exc)
        return None
    return data if isinstance(data, dict) else None


def _error_message(data: Mapping[str, Any]) -> str:
    """``{"message": {"message": ...}}`` (``@record``) or ``{"message": "..."}``."""
    msg = data.get("message")
    if isinstance(msg, Mapping):
        msg = msg.get("message")
    return msg if isinstance(msg, str) else ""


def _with_marker(markers: Sequence[bytes], skip: set[int]) -> list[int]:
    """Processes of this user (other than ``skip``) whose environment holds one of
    ``markers`` (``\\0NAME=VALUE\\0``), read raw from /proc: a dict of every process's
    environment was most of a stop's time on a busy host."""
    uid = os.getuid()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                env = b"\0" + f.read() + b"\0"
        except OSError:
            continue  # gone, or not ours to read
        if any(m in env for m in markers):
            found.append(int(name))
    return found


def _pipe_holders(inodes: set[int]) -> dict[int, psutil.Process]:
    """Processes of ours with a descriptor on one of these pipes (Linux /proc)."""
    wanted = {f"pipe:[{i}]" for i in inodes}
    me = os.getpid()
    uid = os.getuid()
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["uids"]):
        if proc.pid == me:
            continue
        uids = proc.info["uids"]
        if uids is None or uids.real != uid:
            continue
        fd_dir = f"/proc/{proc.pid}/fd"
        try:
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    if os.readlink(f"{fd_dir}/{fd}") in wanted:
                        found[proc.pid] = proc
                        break
        except OSError:
            continue
    return found


def _process_gone(proc: psutil.Process) -> tuple[asyncio.Future[Any] | None, Callable[[], None]]:
    """A future done when ``proc`` (not our child) is gone, and a clean-up function.

    A pidfd becomes readable when the process terminates, so the loop is told, not asked.
    Where pidfds are missing (not Linux >= 5.3) psutil waits in a thread instead.
    """
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return None, lambda: None
    except (AttributeError, OSError):
        fut = asyncio.ensure_future(asyncio.to_thread(psutil.wait_procs, [proc], KILL_WAIT * 3))
        return fut, fut.cancel
    if not proc.is_running():  # the pid was reused before we opened it: ours is gone
        os.close(fd)
        return None, lambda: None
    fut = loop.create_future()

    def gone() -> None:
        if not fut.done():
            fut.set_result(None)
        loop.remove_reader(fd)

    loop.add_reader(fd, gone)

    def close() -> None:
        loop.remove_reader(fd)
        os.close(fd)

    return fut, close
