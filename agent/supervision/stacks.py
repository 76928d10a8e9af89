"""Every worker's Python stacks on demand, without root or ptrace.

How: every Python worker registers ``faulthandler.register(SIG, fd, all_threads=True,
chain=False)`` before any user code (:func:`.zygote.arm_stacks`, run by both launch paths:
the exec path starts ``python -u zygote.py --worker SCRIPT|-m MODULE|-c CODE ARGS``, which
reproduces ``python -u`` as a forked ``--preload`` worker does). On a request the agent sends
SIG to the worker's pid; faulthandler's C handler writes every thread's stack to the fd from
the signal handler itself: no GIL, no Python code in the worker, so a worker deadlocked or
stuck in a C call that holds the GIL answers too. Nothing is attached with ptrace (no
CAP_SYS_PTRACE, any ``kernel.yama.ptrace_scope``); the user's program is not changed.

SIG (``--stack-signal``, default ``SIGRTMIN+4``) is a real-time signal: none of torchrun's
(SIGTERM, SIGINT, SIGHUP, SIGQUIT), nor SIGUSR1/SIGUSR2 that programs and SLURM use. A
real-time signal's default action is to terminate, so the agent sends it only to a worker
whose ``/proc/PID/status`` says it catches it (``SigCgt``): a worker still starting, one that
exec'd another program, or a ``--no-python`` one is not signalled.

The fd: a FIFO per rank in the agent process's private runtime directory (:func:`runtime_dir`,
``mkdtemp``: only the agent's user may enter it; not in the log tree, which is torch's layout),
named to the worker by one variable, ``ELASTIC_STACKS=SIG:PATH``.
The agent creates it and holds it open read-write before the worker starts, and reads it with
the event loop (``connect_read_pipe``): no file to poll, nothing left on disk that grows, and
no change to the keeper's descriptor passing (a FIFO is found by path, by an exec'd worker and
a forked one alike). The worker opens it non-blocking (a missing reader cannot hang it), then
blocking, so that no dump is cut short by a full pipe while the agent reads. Bytes that arrive
when no capture is waiting are read and dropped, so a worker can never block on it.

A dump has no end marker. It is written by one run of the signal handler, so it is complete
once that run has returned: faulthandler registers the handler without ``SA_NODEFER``, so the
kernel blocks SIG in the thread running it until it returns. The agent notes which threads
block SIG before it signals (``SigBlk`` in ``/proc/PID/task/*/status``); once a whole line has
come, the dump is complete when SIG is pending nowhere in the process and blocked in no
thread that did not block it before (:func:`handler_done`, checked every
:data:`POLL_S`): a few milliseconds after the worker wrote its last line, instead of a
silence, which is what it falls back to (:data:`QUIET_S` after a whole line, for a process
whose ``/proc`` cannot be read). The whole capture is bounded (:data:`ANSWER_TIMEOUT`, 2 s)
and ranks are asked concurrently. The stop of a restart waits for this capture (the evidence
before the kill): every millisecond of it is on the restart's path.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import hashlib
import logging
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
from typing import Any

import redis

from ..coordination import protocol
from ..coordination.stack_dumps import (
    Frame,
    RankStack,
    ThreadStack,
    group_record,
    group_stacks,
    parse_faulthandler,
    render_faulthandler,
)
from . import zygote
from .logs import open_private_dir
from .reply_publisher import ReplyPublisher

log = logging.getLogger(__name__)

DEFAULT_SIGNAL = signal.SIGRTMIN + 4
STACKS_ENV = zygote.STACKS_ENV
FIFO_NAME = "stacks.fifo"
#: How long ranks have to answer a request (they are asked all at once).
ANSWER_TIMEOUT = 2.0
#: Silence after a whole line that ends a dump when the handler's end cannot be seen.
QUIET_S = 0.1
#: How often, once a whole line came, the agent looks whether the handler has returned.
POLL_S = 0.002
#: Groups an event carries (the rest are on the stacks stream under its request id).
EVENT_GROUPS = 20
#: Signals a stack signal must never be: torchrun's own, and the user signals others use.
RESERVED = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                      signal.SIGUSR1, signal.SIGUSR2})

NOT_PYTHON = "not a Python worker (--no-python)"
NOT_RUNNING = "worker not running"
NO_HANDLER = "no stack handler (the worker is still starting, or replaced its program)"

_ZYGOTE_FILE = os.path.abspath(zygote.__file__)
#: The worker's collective-trace thread (issue 22): the agent's, not the job's; left out.
_PROBE_FILE = os.path.join(os.path.dirname(_ZYGOTE_FILE), "recorder_probe.py")
_RT_RE = re.compile(r"(?:SIG)?RT(MIN|MAX)(?:([+-])(\d{1,2}))?")


def parse_stack_signal(value: str) -> int | None:
    """``--stack-signal``: ``SIGRTMIN+N``, ``SIGRTMAX-N``, ``RTMIN+N`` or a number, a real-time
    signal; ``off`` (or ``0``) disables stacks. ValueError with a one-line reason otherwise."""
    text = value.strip().upper()
    if text in ("OFF", "NONE", "0"):
        return None
    m = _RT_RE.fullmatch(text)
    if m is not None:
        base = signal.SIGRTMIN if m.group(1) == "MIN" else signal.SIGRTMAX
        n = int(m.group(3) or 0)
        signum = base + n if m.group(2) == "+" else base - n
    elif text.isdigit() and len(text) < 4:
        signum = int(text)
    else:
        raise ValueError(f"{value!r} is not a signal: use SIGRTMIN+N, SIGRTMAX-N, a number "
                         "or off")
    if signum in RESERVED or not signal.SIGRTMIN <= signum <= signal.SIGRTMAX:
        raise ValueError(f"{value!r} is not a real-time signal (SIGRTMIN={int(signal.SIGRTMIN)}"
                         f"..SIGRTMAX={int(signal.SIGRTMAX)}); torchrun's signals and "
                         "SIGUSR1/2 are the job's")
    return int(signum)


# -- the worker's launch -------------------------------------------------------------------

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
    return [argv[0], "-u", _ZYGOTE_FILE, zygote.WORKER_FLAG, *argv[2:]]


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


# -- reading dumps ---------------------------------------------------------------------------

@dataclass(frozen=True)
class LocalDump:
    """What one local worker answered: faulthandler text, or why there is none."""

    rank: int
    local_rank: int
    pid: int
    text: str = ""
    truncated: bool = False
    error: str = ""


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
        room = protocol.MAX_STACK_TEXT_BYTES - len(buf)
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


# -- the agent's collector -------------------------------------------------------------------

def _ours(frame: Frame) -> bool:
    return frame.file == _ZYGOTE_FILE


def to_rank_stack(dump: LocalDump, node: str, host: str) -> RankStack:
    """A dump parsed, the bootstrap's own frames (``zygote.py``) left out, as a traceback
    leaves them out."""
    if dump.error:
        return RankStack(dump.rank, node, host, dump.pid, (), dump.error)
    threads = tuple(ThreadStack(t.thread_id, t.current,
                                tuple(f for f in t.frames if not _ours(f)))
                    for t in parse_faulthandler(dump.text)
                    if not any(f.file == _PROBE_FILE for f in t.frames))
    return RankStack(dump.rank, node, host, dump.pid, threads)


class StackCollector(ReplyPublisher):
    """This agent's side of stack requests: capture the local workers, publish per rank."""

    async def capture_local(self, timeout: float = ANSWER_TIMEOUT,
                            ranks: Iterable[int] | None = None,
                            live_only: bool = False) -> list[RankStack]:
        """The stacks of this agent's workers of the current attempt (``ranks``: only those),
        at most ``timeout`` seconds; ``live_only`` leaves out workers that already exited."""
        dumps = await self.group.dump_stacks(ranks=ranks, timeout=timeout, live_only=live_only)
        return [to_rank_stack(d, self.node, self.host) for d in dumps]

    async def publish(self, request_id: str, stacks: Iterable[RankStack]) -> None:
        """One entry per rank on the job's stacks stream. Raises redis errors / OSError."""
        await self._publish(self.keys.stacks, protocol.STACKS_MAXLEN, (
            protocol.encode_stack_reply(protocol.StackReply(
                request=request_id, node=self.node, host=self.host, rank=s.rank, pid=s.pid,
                text=render_faulthandler(s.threads), error=s.error))
            for s in stacks))

    async def evidence(self, request_id: str,
                       timeout: float = ANSWER_TIMEOUT) -> dict[str, Any] | None:
        """Before workers are stopped: the live ones' stacks, published under ``request_id``;
        ``{"request", "groups"}`` for the event, or None when no worker could be asked."""
        try:
            stacks = await self.capture_local(timeout, live_only=True)
        except Exception:
            log.exception("capturing the workers' stacks before stopping them failed")
            return None
        if not any(s.threads for s in stacks):
            return None
        try:  # bounded too: during an outage the stop must not wait for Redis
            await asyncio.wait_for(self.publish(request_id, stacks), ANSWER_TIMEOUT)
        except (redis.RedisError, OSError, asyncio.TimeoutError) as exc:
            log.warning("cannot publish the stacks captured before the stop: %s",
                        exc or "Redis did not answer in time")
        groups = group_stacks(stacks)
        return {"request": request_id,
                "groups": [group_record(g) for g in groups[:EVENT_GROUPS]],
                "ranks": len(stacks)}
