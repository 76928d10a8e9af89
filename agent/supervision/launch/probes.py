"""The agent's end of the probes inside each worker, made and closed with the worker.

A Python worker carries two probes, armed by the bootstrap before any user code
(:func:`.zygote.arm_stacks`, :func:`.zygote.arm_recorder`):

- a faulthandler that writes every thread's stack to a FIFO when the agent sends the stack
  signal (``ELASTIC_STACKS=SIG:PATH``); the agent's end is :class:`StackPipe`;
- a thread that answers collective-trace requests on a Unix socket (``ELASTIC_RECORDER=PATH``,
  :mod:`.recorder_probe`); the agent's end is :class:`RecorderLink`.

Both live in this agent process's private runtime directory (:func:`runtime_dir`). This module
is the channel only: what is asked, and what the answers mean, is diagnosis's
(:mod:`..diagnosis.stacks`, :mod:`..diagnosis.recorder`). Launch owns the channels because a
worker's start creates them and its stop closes them; diagnosis never imports launch's process
group, and launch never imports diagnosis.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import signal
import stat
import struct
import sys
import tempfile
import termios
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from elastic_agent.coordination.wire import trace_records

from ..records.log_files import open_private_dir
from . import zygote

DEFAULT_SIGNAL = signal.SIGRTMIN + 4
STACKS_ENV = zygote.STACKS_ENV
RECORDER_ENV = zygote.RECORDER_ENV
FIFO_NAME = "stacks.fifo"
#: How long ranks have to answer a request (they are asked all at once).
ANSWER_TIMEOUT = 2.0
#: Silence after a whole line that ends a dump when the handler's end cannot be seen.
QUIET_S = 0.1
#: How often, once a whole line came, the agent looks whether the handler has returned.
POLL_S = 0.002

NOT_PYTHON = "not a Python worker (--no-python)"
NOT_RUNNING = "worker not running"
NO_HANDLER = "no stack handler (the worker is still starting, or replaced its program)"
NOT_LINKED = "no recorder thread (not a Python worker, still starting, or --flight-recorder 0)"

#: The bootstrap every Python worker starts through (its frames are the agent's, not the job's).
ZYGOTE_FILE = os.path.abspath(zygote.__file__)
#: The worker's collective-trace thread: the agent's, not the job's.
PROBE_FILE = os.path.join(os.path.dirname(ZYGOTE_FILE), "recorder_probe.py")


# -- arming a worker -------------------------------------------------------------------------

def is_python_entrypoint(entrypoint: Sequence[str]) -> bool:
    """An entrypoint the bootstrap can run: ``[sys.executable, "-u", SCRIPT|-m M|-c C, ...]``
    (what ``elastic-agent`` builds for a Python worker; never with ``--no-python``)."""
    argv = list(entrypoint)
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-u" and (
        (argv[2] in ("-m", "-c") and len(argv) >= 4) or not argv[2].startswith("-"))


def boot_argv(entrypoint: Sequence[str]) -> list[str]:
    """The exec path's argv: the same worker, started through the zygote's ``--worker``
    bootstrap (registers the stack handler, then runs the script as ``python -u`` would)."""
    argv = list(entrypoint)
    return [argv[0], "-u", ZYGOTE_FILE, zygote.WORKER_FLAG, *argv[2:]]


_RUNTIME_DIR: Path | None = None


def runtime_dir() -> Path:
    """This agent process's private directory for its workers' stack FIFOs (``mkdtemp``: new,
    0700, unpredictable; removed at exit). Not the log tree: that is torch's layout, which a
    test compares file by file with torchrun's, and a --logs-specs plugin may put anywhere."""
    global _RUNTIME_DIR
    if _RUNTIME_DIR is None or not _RUNTIME_DIR.is_dir():
        _RUNTIME_DIR = Path(tempfile.mkdtemp(prefix="elastic-agent-stacks-"))
        atexit.register(shutil.rmtree, _RUNTIME_DIR, ignore_errors=True)
    return _RUNTIME_DIR


def fifo_path(key: str) -> Path:
    """The FIFO of the worker named by ``key`` (run directory, attempt, local rank)."""
    return runtime_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.{FIFO_NAME}"


def worker_vars(signum: int, fifo: Path) -> dict[str, str]:
    """The one variable of ours in a Python worker's environment."""
    return {STACKS_ENV: f"{signum}:{fifo}"}


def open_fifo(fifo: Path, base: Path) -> int:
    """Make ``fifo`` anew (a stale one of an earlier run is replaced) in its private directory
    and return a non-blocking read-write descriptor of it: held open, so the worker's open
    never waits and the agent never sees EOF between dumps. Raises OSError."""
    dir_fd = open_private_dir(fifo.parent, base=base)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(fifo.name, dir_fd=dir_fd)
        os.mkfifo(fifo.name, 0o600, dir_fd=dir_fd)
        fd = os.open(fifo.name, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{fifo} is not a FIFO")
    return fd


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (``SigCgt`` in its status)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read(8192)
    except OSError:
        return False
    m = re.search(rb"^SigCgt:\s*([0-9a-fA-F]{1,64})$", status, re.MULTILINE)
    return m is not None and bool(int(m.group(1), 16) >> (signum - 1) & 1)


def _signal_masks(pid: int) -> tuple[int, dict[int, int]] | None:
    """(signals pending for the whole process, {tid: signals that thread blocks | its own
    pending ones}) from /proc, or None when it cannot be read (gone, or not ours to read)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    shared = 0
    threads: dict[int, int] = {}
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status", "rb") as f:
                status = f.read(8192)
        except OSError:
            continue  # that thread ended
        fields = dict(_MASK_RE.findall(status))
        try:
            shared |= int(fields.get(b"ShdPnd", b"0"), 16)
            threads[int(tid)] = (int(fields.get(b"SigBlk", b"0"), 16)
                                 | int(fields.get(b"SigPnd", b"0"), 16))
        except ValueError:
            return None
    return (shared, threads) if threads else None


_MASK_RE = re.compile(rb"^(ShdPnd|SigPnd|SigBlk):\s*([0-9a-fA-F]{1,64})$", re.MULTILINE)


def blocking_threads(pid: int, signum: int) -> frozenset[int] | None:
    """The threads of ``pid`` that block (or have pending) ``signum`` now; None: unknown."""
    masks = _signal_masks(pid)
    if masks is None:
        return None
    bit = 1 << (signum - 1)
    return frozenset(tid for tid, mask in masks[1].items() if mask & bit)


def handler_done(pid: int, signum: int, before: frozenset[int]) -> bool:
    """Whether the run of ``signum``'s handler that a signal sent after ``before`` was taken
    has returned: the signal pending nowhere, blocked in no thread beyond ``before`` (the
    kernel blocks it in the thread that runs the handler, until the handler returns)."""
    masks = _signal_masks(pid)
    if masks is None:
        return False
    bit = 1 << (signum - 1)
    shared, threads = masks
    return not shared & bit and not any(
        mask & bit for tid, mask in threads.items() if tid not in before)


# -- the stack FIFO --------------------------------------------------------------------------

class StackPipe(asyncio.Protocol):
    """The agent's end of one worker's FIFO. Bytes are kept only while a dump is awaited."""

    def __init__(self) -> None:
        self.transport: asyncio.ReadTransport | None = None
        self._buf: bytearray | None = None
        self._cut = False
        self._got = asyncio.Event()
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, fd: int) -> StackPipe:
        pipe = cls()
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_read_pipe(lambda: pipe, open(fd, "rb", buffering=0))  # noqa: SIM115
        except BaseException:
            os.close(fd)
            raise
        return pipe

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        if buf is None:
            return  # nobody asked: dropped, so the worker never blocks on a full pipe
        room = trace_records.MAX_STACK_TEXT_BYTES - len(buf)
        if len(data) > room:
            self._cut = True
        buf += data[:max(0, room)]
        self._got.set()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _unread(self) -> int:
        """Bytes in the FIFO the loop has not read yet (1 when that cannot be known)."""
        pipe = self.transport.get_extra_info("pipe") if self.transport is not None else None
        try:
            return struct.unpack("i", fcntl.ioctl(pipe.fileno(), termios.FIONREAD,
                                                  b"\0\0\0\0"))[0]
        except (AttributeError, OSError, ValueError):
            return 1

    async def dump(self, pid: int, signum: int, timeout: float) -> tuple[str, bool, str]:
        """Signal ``pid`` and read its dump: ``(text, truncated, error)``. Complete once the
        handler has returned (see the module docstring), or after :data:`QUIET_S` of silence
        after a whole line when that cannot be seen."""
        async with self._lock:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            self._buf, self._cut = bytearray(), False
            before = blocking_threads(pid, signum)
            try:
                os.kill(pid, signum)
            except OSError:
                self._buf = None
                return "", False, NOT_RUNNING
            try:
                quiet_since = loop.time()
                while (left := deadline - loop.time()) > 0:
                    whole = bool(self._buf) and self._buf.endswith(b"\n")
                    if (whole and before is not None and handler_done(pid, signum, before)
                            and not self._unread()):
                        break  # the handler has returned and all it wrote has been read
                    if whole and loop.time() - quiet_since >= QUIET_S:
                        break  # a whole line, then silence: the handler has returned
                    self._got.clear()
                    wait = (POLL_S if before is not None else QUIET_S) if whole else left
                    try:
                        await asyncio.wait_for(self._got.wait(), min(left, wait))
                        quiet_since = loop.time()
                    except asyncio.TimeoutError:
                        pass
                buf, cut = self._buf, self._cut
            finally:
                self._buf = None
            if not buf:
                return "", False, f"no answer within {timeout:g} s"
            return (buf.decode("utf-8", "replace"), cut or not buf.endswith(b"\n"), "")


@dataclass(frozen=True)
class LocalDump:
    """What one local worker answered: faulthandler text, or why there is none."""

    rank: int
    local_rank: int
    pid: int
    text: str = ""
    truncated: bool = False
    error: str = ""


async def dump_workers(targets: Iterable[tuple[int, int, int, bool, StackPipe | None]],
                       signum: int | None, timeout: float = ANSWER_TIMEOUT) -> list[LocalDump]:
    """Ask every ``(rank, local_rank, pid, alive, pipe)`` at once; one :class:`LocalDump` each,
    by rank. ``pipe`` None: not a Python worker this agent can ask."""
    async def one(rank: int, local_rank: int, pid: int, alive: bool,
                  pipe: StackPipe | None) -> LocalDump:
        if pipe is None or signum is None:
            return LocalDump(rank, local_rank, pid, error=NOT_PYTHON)
        if not alive or not pid:
            return LocalDump(rank, local_rank, pid, error=NOT_RUNNING)
        if not catches(pid, signum):
            return LocalDump(rank, local_rank, pid, error=NO_HANDLER)
        text, cut, error = await pipe.dump(pid, signum, timeout)
        return LocalDump(rank, local_rank, pid, text, cut, error)

    dumps = await asyncio.gather(*(one(*t) for t in targets))
    return sorted(dumps, key=lambda d: d.rank)


# -- the recorder socket ----------------------------------------------------------------------

def socket_path(key: str) -> Path:
    """The socket of the worker named by ``key`` (run directory, attempt, local rank): a
    short name, since a Unix socket's path is at most 107 bytes."""
    return runtime_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.fr"


class RecorderLink:
    """The agent's end of one worker's recorder socket (one connection: the worker's)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.server: asyncio.AbstractServer | None = None
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()

    @classmethod
    async def listen(cls, path: Path) -> RecorderLink:
        """Listen at ``path`` (a stale socket of an earlier run is replaced). Raises OSError."""
        link = cls(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        link.server = await asyncio.start_unix_server(link._accept, path=str(path),
                                                      limit=trace_records.MAX_TRACE_BYTES * 2)
        os.chmod(path, 0o600)
        return link

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._conn is not None:  # one worker per socket: a second caller is not ours
            writer.close()
            return
        self._conn = (reader, writer)

    async def ask(self, request: str, timeout: float = ANSWER_TIMEOUT) -> bytes | str:
        """The worker's answer to ``request`` (raw JSON bytes, at most MAX_TRACE_BYTES), or why
        there is none. A request that times out drops the connection (a reply cut by the
        timeout would leave the stream out of step); the worker's thread then ends."""
        if self._conn is None:
            return NOT_LINKED
        async with self._lock:
            try:
                return await asyncio.wait_for(self._exchange(request), timeout)
            except asyncio.TimeoutError:
                self._drop()
                return f"no answer within {timeout:g} s"
            except (OSError, asyncio.IncompleteReadError, struct.error):
                self._drop()
                return "the worker's recorder thread is gone"

    async def _exchange(self, request: str) -> bytes | str:
        assert self._conn is not None
        reader, writer = self._conn
        writer.write(request.encode() + b"\n")
        await writer.drain()
        size = struct.unpack(">I", await reader.readexactly(4))[0]
        if size > trace_records.MAX_TRACE_BYTES:
            self._drop()
            return f"the worker's answer is {size} bytes (at most {trace_records.MAX_TRACE_BYTES})"
        return await reader.readexactly(size)

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None

    def close(self) -> None:
        self._drop()
        if self.server is not None:
            self.server.close()
            self.server = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)
