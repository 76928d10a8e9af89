"""The worker watchdog: torch's file-timer protocol, served natively on the agent's loop.

With ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` the agent serves what torch's ``LocalElasticAgent``
serves (``_setup_local_watchdog``): a FIFO at ``$TORCHELASTIC_TIMER_FILE`` (default: a new
private directory under ``$TMPDIR``), named to every worker in ``TORCHELASTIC_TIMER_FILE``,
where torch's own ``torch.distributed.elastic.timer.FileTimerClient`` writes one JSON line
per request (``expires(after=...)`` acquires on entry, releases on exit)::

    {"version": 1, "pid": 4242, "scope_id": "train.py#12", "expiration_time": 1795300001.5,
     "signal": 9}

``expiration_time`` is the worker's ``time.time()`` deadline; a negative one releases the
timer ``(pid, scope_id)``. When a timer expires, the process ``pid`` gets ``signal`` with
``kill(2)`` (torch's ``FileTimerServer._reap_worker``: that pid only, not its group) and its
other timers are dropped; a timer whose signal is 0 or negative only reports its expiry.

What differs from torch 2.13, on purpose:

* torch kills whatever pid a request names. Here a request counts only for a live worker of
  this agent or a descendant of one (found by parentage); any other pid is ignored and logged.
  The kill goes through a pidfd opened before that check, so a pid reused meanwhile is never
  hit, and the pidfd's readability (the process ended) drops its timers: no polling for dead
  pids as torch's loop does.
* torch's server, after killing a worker, kills its own process (the agent!) with the same
  signal, so torchrun dies with the worker (exit 137 for SIGKILL). Here the agent lives: the
  kill is an ordinary worker failure, reported (``worker_timer_expired`` event, then the
  worker's exit, whose message names the timer) and restarted under ``--max-restarts``.
* Expiry is a loop timer at the deadline, not a 0.1 s polling loop; the FIFO is an event source.
* torch replaces whatever is at ``TORCHELASTIC_TIMER_FILE``. Here only a FIFO of this user
  (a previous run's) is replaced; a file, a symlink or another user's FIFO (in a shared
  sticky directory such as /tmp, where it could not even be removed) stops the agent with one
  line before any worker starts, and is left alone. What is opened must be the FIFO just made
  (``O_NOFOLLOW``, then ``fstat``: type, owner, inode), so a path swapped between ``mkfifo``
  and ``open`` is refused too.
* The FIFO is writable by every worker, so its input is hostile: a line is at most
  ``MAX_REQUEST_BYTES`` (torch's client refuses larger requests: PIPE_BUF keeps them atomic),
  every field is type-checked in :func:`decode_request`, timers are bounded per process and
  tracked processes in total, and nothing a writer sends can raise out of the reader.

A hostile worker can still corrupt a neighbour's request (an unterminated line joins the next
one) or kill another worker of the same agent: it shares the agent's user and could do that
anyway.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import json
import logging
import math
import os
import select
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from elastic_agent.coordination.wire.event_records import EventType

from ..launch.exits import GroupResult, WorkerExit, WorkerStartError
from ..launch.workers import WorkerGroup

log = logging.getLogger(__name__)

ENABLE_ENV = "TORCHELASTIC_ENABLE_FILE_TIMER"
FILE_ENV = "TORCHELASTIC_TIMER_FILE"

#: Longest request line (without its newline): PIPE_BUF on Linux, torch's client limit.
MAX_REQUEST_BYTES = 4096
#: Longest scope kept; torch's default scope is ``file#line``.
MAX_SCOPE_CHARS = 1024
#: Processes with timers at once, and timers per process: beyond, requests are refused.
MAX_TRACKED = 1024
MAX_TIMERS_PER_PROCESS = 256
#: How far up the parentage a requesting pid may be from a worker.
MAX_ANCESTRY = 64
#: Kills remembered for :meth:`Watchdog.explain` (one per expiry; old ones go first).
MAX_REMEMBERED_KILLS = 1024
#: A loop timer is never set further out than this: the deadline is checked again then.
MAX_TIMER_DELAY_S = 3600.0
#: Rejected requests logged one by one; after that one line every this many.
_LOG_FIRST, _LOG_EVERY = 5, 1000


class WatchdogError(WorkerStartError):
    """The watchdog asked for cannot be set up (e.g. ``TORCHELASTIC_TIMER_FILE`` names
    something that is not a FIFO): the workers are not started without it."""


@dataclass(frozen=True)
class TimerRequest:
    """One decoded request. ``expiration < 0`` releases the timer ``(pid, scope)``."""

    pid: int
    scope: str
    expiration: float
    signal: int

    @property
    def is_release(self) -> bool:
        return self.expiration < 0


def decode_request(line: bytes) -> TimerRequest | str:
    """The one guarded decoder of the FIFO: a request, or why the line is not one.

    Accepts exactly what torch's ``FileTimerRequest.to_json`` writes: a JSON object with an
    int ``pid`` > 0, a string ``scope_id``, a finite number ``expiration_time`` and an int
    ``signal`` (0 or negative: report only; else a valid signal number); ``version`` 1 or
    absent. Never raises.
    """
    if len(line) > MAX_REQUEST_BYTES:
        return f"longer than {MAX_REQUEST_BYTES} bytes"
    try:
        data = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "not a JSON line"
    if not isinstance(data, dict):
        return "not a JSON object"
    pid, scope = data.get("pid"), data.get("scope_id")
    expiration, sig = data.get("expiration_time"), data.get("signal", 0)
    version = data.get("version", 1)
    # bool is an int to Python: ``type(x) is int``, never isinstance.
    if type(version) is not int or version != 1:
        return "unknown version"
    if type(pid) is not int or pid <= 0:
        return "pid is not a positive integer"
    if not isinstance(scope, str) or len(scope) > MAX_SCOPE_CHARS:
        return f"scope_id is not a string of at most {MAX_SCOPE_CHARS} characters"
    if type(expiration) not in (int, float) or not math.isfinite(expiration):
        return "expiration_time is not a finite number"
    if type(sig) is not int or (sig > 0 and sig not in _VALID_SIGNALS):
        return "signal is not a signal number"
    return TimerRequest(pid, scope, float(expiration), sig)


_VALID_SIGNALS = frozenset(int(s) for s in signal.valid_signals())


@dataclass(frozen=True)
class WorkerRef:
    """The worker (a process the agent started) a requesting pid belongs to."""

    rank: int
    local_rank: int
    pid: int


@dataclass(frozen=True)
class TimerExpiry:
    """An expired timer. ``deadline`` is the worker's ``time.time()`` deadline; ``late_s``
    how long after it the agent acted (by the agent's clock: one host, one clock)."""

    worker: WorkerRef
    pid: int
    scope: str
    deadline: float
    signal: int
    killed: bool
    late_s: float

    @property
    def signal_name(self) -> str | None:
        if self.signal <= 0:
            return None
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"SIG{self.signal}"

    def message(self) -> str:
        """One line: what expired and what the watchdog did."""
        what = f"timer {self.scope!r} expired (deadline {_clock(self.deadline)})"
        who = "" if self.pid == self.worker.pid else f" in its process {self.pid}"
        if self.killed:
            return f"{what}; the agent's watchdog killed rank {self.worker.rank}{who} " \
                   f"with {self.signal_name}"
        return f"{what}; rank {self.worker.rank}{who} not killed (the timer has no signal)"

    def event_data(self) -> dict[str, Any]:
        """The fields of a ``worker_timer_expired`` event (see docs/PROTOCOL.md)."""
        return {"rank": self.worker.rank, "local_rank": self.worker.local_rank,
                "pid": self.pid, "worker_pid": self.worker.pid, "scope": self.scope,
                "deadline": self.deadline, "signal": self.signal_name, "killed": self.killed,
                "late_s": round(self.late_s, 3), "message": self.message()}


def _clock(ts: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) + f".{int(ts % 1 * 1000):03d}"
    except (OverflowError, OSError, ValueError):
        return f"{ts:.3f}"


class _Tracked:
    """A process with timers: its pidfd (or None where pidfds are missing) and its timers."""

    __slots__ = ("pidfd", "timers", "worker")

    def __init__(self, pidfd: int | None, worker: WorkerRef) -> None:
        self.pidfd = pidfd
        self.worker = worker
        self.timers: dict[str, tuple[TimerRequest, asyncio.TimerHandle]] = {}


@dataclass
class WatchdogStats:
    """Counters for the metrics: requests by outcome, expiries, kills."""

    acquired: int = 0
    released: int = 0
    rejected: int = 0
    expired: int = 0
    killed: int = 0


class Watchdog:
    """The agent's file-timer server (see the module docstring); off unless enabled.

    ``emit`` writes an event (``EventSink.emit``), ``say`` a line on the agent's terminal;
    ``attach`` the worker group whose live workers may hold timers. ``start`` on the agent's
    loop, ``close`` at the end (removes the FIFO it made). Not thread-safe: the loop's.
    """

    def __init__(self, path: Path | None, emit: Callable[..., None],
                 say: Callable[[str], None], *, private_dir: Path | None = None) -> None:
        self.path = path
        self._group: WorkerGroup | None = None
        self._emit = emit
        self._say = say
        self._private_dir = private_dir
        self._tracked: dict[int, _Tracked] = {}
        # pid -> (the attempt's assignment, the expiry): a pid reused by a later attempt's
        # worker is not explained by an old kill.
        self._kills: collections.OrderedDict[int, tuple[object, TimerExpiry]] = \
            collections.OrderedDict()
        self._transport: asyncio.ReadTransport | None = None
        self._keep_open: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._made_fifo = False
        self._fifo_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the FIFO made
        self.stats = WatchdogStats()

    @classmethod
    def from_environ(cls, emit: Callable[..., None], say: Callable[[str], None],
                     environ: Mapping[str, str] | None = None) -> Watchdog:
        """torch's switch: enabled only by ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` exactly; the
        FIFO at ``TORCHELASTIC_TIMER_FILE`` or, without it, in a new private directory
        (torch uses ``$TMPDIR/watchdog_timer_<uuid>``; mkdtemp's 0700 directory keeps other
        users from writing requests). Raises WatchdogError if that directory cannot be made."""
        env = os.environ if environ is None else environ
        if env.get(ENABLE_ENV) != "1":
            return cls(None, emit, say)
        given = env.get(FILE_ENV)
        if given:
            return cls(Path(given), emit, say)
        try:
            private = Path(tempfile.mkdtemp(prefix="elastic-watchdog-"))
        except OSError as exc:
            raise WatchdogError(f"cannot create the watchdog's FIFO directory: "
                                f"{exc.strerror or exc}") from None
        return cls(private / "timer", emit, say, private_dir=private)

    def attach(self, group: WorkerGroup) -> Watchdog:
        """Watch ``group``'s workers (only they may hold timers) and name the FIFO to them in
        ``TORCHELASTIC_TIMER_FILE``, as torchrun does. Returns self."""
        self._group = group
        if self.path is not None:
            spec = group.spec
            group.spec = replace(spec, extra_env={**spec.extra_env, **self.worker_env})
        return self

    @property
    def enabled(self) -> bool:
        return self.path is not None

    @property
    def worker_env(self) -> dict[str, str]:
        """What every worker's environment gets: ``TORCHELASTIC_TIMER_FILE``."""
        return {FILE_ENV: str(self.path)} if self.path is not None else {}

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Make the FIFO and read it on the running loop. No-op when disabled.

        An existing FIFO of this user at the path (a previous run's) is replaced, as torch
        does; anything else there (another user's FIFO, a file, a symlink) is refused with
        WatchdogError: torch would delete it, or stop on a raw PermissionError in a sticky
        directory such as /tmp. What is opened is checked, not only what was made: no
        symlink is followed, and both ends must be one FIFO of this user (in a directory
        others may write, the path could be swapped between ``mkfifo`` and ``open``).
        """
        if self.path is None or self._transport is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._make_fifo(self.path)
        fd = -1
        try:
            # Non-blocking: no writer yet. Our own idle write end keeps the reader from seeing
            # EOF each time a client closes (the loop would spin on it otherwise).
            flags = os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW
            fd = os.open(self.path, os.O_RDONLY | flags)
            self._keep_open = os.open(self.path, os.O_WRONLY | flags)
            _check_own_fifo(fd, self._keep_open, self._fifo_id, self.path)
            self._transport, _ = await self._loop.connect_read_pipe(
                lambda: _FifoProtocol(self._on_line), open(fd, "rb", buffering=0))  # noqa: SIM115
        except (OSError, WatchdogError) as exc:
            if fd >= 0 and self._transport is None:
                os.close(fd)
            self.close()
            if isinstance(exc, WatchdogError):
                raise
            why = ("it was replaced by a symlink" if exc.errno == errno.ELOOP
                   else exc.strerror or exc)
            raise WatchdogError(f"cannot open the watchdog FIFO {self.path}: {why}") from None
        self._say(f"watchdog: serving torch's file timers at {self.path} "
                  f"({FILE_ENV} of every worker)")

    def _make_fifo(self, path: Path) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise WatchdogError(f"{FILE_ENV}={path}: {exc.strerror or exc}") from None
        else:
            if not stat.S_ISFIFO(st.st_mode):
                raise WatchdogError(f"{FILE_ENV}={path} exists and is not a FIFO: refusing to "
                                    "replace it (remove it, or name another path)")
            if st.st_uid != os.geteuid():
                raise WatchdogError(f"{FILE_ENV}={path} is another user's FIFO (uid "
                                    f"{st.st_uid}): refusing to use or replace it (name a path "
                                    f"in a directory of your own, or unset {FILE_ENV} for a "
                                    "private one)")
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise WatchdogError(f"cannot replace the old watchdog FIFO {path}: "
                                    f"{exc.strerror or exc}") from None
        try:
            os.mkfifo(path, 0o600)
            made = os.lstat(path)
        except OSError as exc:
            raise WatchdogError(f"cannot create the watchdog FIFO {path}: "
                                f"{exc.strerror or exc}") from None
        self._made_fifo = True
        self._fifo_id = (made.st_dev, made.st_ino)

    def close(self) -> None:
        """Stop serving: cancel every timer, close the FIFO and remove what ``start`` made."""
        for pid in list(self._tracked):
            self._untrack(pid)
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._keep_open is not None:
            os.close(self._keep_open)
            self._keep_open = None
        if self._made_fifo and self.path is not None:
            with contextlib.suppress(OSError):
                st = os.lstat(self.path)
                # Only the FIFO this agent made, never what took its place (which may have
                # the freed inode's number: the owner is checked too).
                if (self._fifo_id == (st.st_dev, st.st_ino) and stat.S_ISFIFO(st.st_mode)
                        and st.st_uid == os.geteuid()):
                    os.unlink(self.path)
            self._made_fifo = False
            self._fifo_id = None
        if self._private_dir is not None:
            with contextlib.suppress(OSError):
                self._private_dir.rmdir()

    # -- requests ---------------------------------------------------------------------------

    def _on_line(self, line: bytes | None) -> None:
        """A line from the FIFO (None: one too long, already discarded). Never raises: a
        writer's garbage must not stop the reader."""
        try:
            req = decode_request(line) if line is not None else \
                f"longer than {MAX_REQUEST_BYTES} bytes"
            if isinstance(req, str):
                self._reject(req, line)
            elif req.is_release:
                self._release(req)
            else:
                self._acquire(req)
        except Exception:  # a bug here must not end the watchdog
            log.exception("failed to handle a request")

    def _reject(self, why: str, line: bytes | None) -> None:
        self.stats.rejected += 1
        n = self.stats.rejected
        if n <= _LOG_FIRST or n % _LOG_EVERY == 0:
            shown = f": {line[:120]!r}" if line else ""
            log.warning("ignored a timer request (%s)%s%s", why, shown,
                        f" ({n} ignored so far)" if n > _LOG_FIRST else "")

    def _release(self, req: TimerRequest) -> None:
        tracked = self._tracked.get(req.pid)
        entry = tracked.timers.pop(req.scope, None) if tracked else None
        if entry is not None:
            entry[1].cancel()
            self.stats.released += 1

    def _acquire(self, req: TimerRequest) -> None:
        tracked = self._tracked.get(req.pid) or self._track(req.pid)
        if isinstance(tracked, str):
            self._reject(tracked, None)
            return
        old = tracked.timers.pop(req.scope, None)
        if old is not None:
            old[1].cancel()  # acquiring again moves the deadline, as in torch's dict
        elif len(tracked.timers) >= MAX_TIMERS_PER_PROCESS:
            self._reject(f"process {req.pid} holds {MAX_TIMERS_PER_PROCESS} timers", None)
            return
        tracked.timers[req.scope] = (req, self._schedule(req))
        self.stats.acquired += 1

    def _schedule(self, req: TimerRequest) -> asyncio.TimerHandle:
        assert self._loop is not None
        delay = min(max(0.0, req.expiration - time.time()), MAX_TIMER_DELAY_S)
        return self._loop.call_later(delay, self._fire, req)

    def _track(self, pid: int) -> _Tracked | str:
        """Start tracking ``pid`` if it is a live worker of this agent or a descendant of
        one; else why not."""
        if len(self._tracked) >= MAX_TRACKED:
            return f"{MAX_TRACKED} processes already hold timers"
        pidfd = None
        try:
            # Opened before the check: if the check passes, the pidfd is that process (a pid
            # cannot be reused while its process lives), so a later kill cannot hit another.
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return f"no process {pid}"
        except (AttributeError, OSError) as exc:
            if getattr(exc, "errno", None) not in (errno.ENOSYS, errno.EPERM, None):
                return f"cannot watch process {pid}: {exc}"
        worker = _owner(pid, self._live_workers())
        if worker is None:
            if pidfd is not None:
                os.close(pidfd)
            return f"process {pid} is not a worker of this agent (nor a descendant of one)"
        tracked = self._tracked[pid] = _Tracked(pidfd, worker)
        if pidfd is not None:
            assert self._loop is not None
            self._loop.add_reader(pidfd, self._untrack, pid)  # readable: the process ended
        return tracked

    def _untrack(self, pid: int) -> None:
        tracked = self._tracked.pop(pid, None)
        if tracked is None:
            return
        for _, handle in tracked.timers.values():
            handle.cancel()
        if tracked.pidfd is not None:
            if self._loop is not None:
                self._loop.remove_reader(tracked.pidfd)
            os.close(tracked.pidfd)

    # -- expiry -----------------------------------------------------------------------------

    def _fire(self, req: TimerRequest) -> None:
        try:
            self._expire(req)
        except Exception:
            log.exception("failed to handle an expired timer")

    def _expire(self, req: TimerRequest) -> None:
        tracked = self._tracked.get(req.pid)
        if tracked is None or tracked.timers.get(req.scope, (None,))[0] is not req:
            return  # released or replaced meanwhile
        late = time.time() - req.expiration
        if late < 0:  # the wall clock went back, or a far deadline: not yet
            tracked.timers[req.scope] = (req, self._schedule(req))
            return
        del tracked.timers[req.scope]
        killed = False
        if req.signal > 0:
            if not self._kill(req.pid, tracked, req.signal):
                self._untrack(req.pid)  # it was gone already: nothing to report
                return
            killed = True
        expiry = TimerExpiry(tracked.worker, req.pid, req.scope, req.expiration, req.signal,
                             killed, late)
        self.stats.expired += 1
        if killed:
            self.stats.killed += 1
            self._kills[req.pid] = (self._group.assignment if self._group else None, expiry)
            while len(self._kills) > MAX_REMEMBERED_KILLS:
                self._kills.popitem(last=False)
            self._untrack(req.pid)  # torch clears a reaped pid's timers
        self._report(expiry)

    def _kill(self, pid: int, tracked: _Tracked, sig: int) -> bool:
        """``sig`` to that process alone, as torch's ``os.kill(pid, sig)``; False if gone."""
        try:
            if tracked.pidfd is not None:
                ended = select.poll()  # (select() refuses a descriptor past 1,023)
                ended.register(tracked.pidfd, select.POLLIN)
                if ended.poll(0):
                    return False  # it has ended (a zombie would take the signal silently)
                signal.pidfd_send_signal(tracked.pidfd, sig)
            elif _owner(pid, self._live_workers()) is not None:
                os.kill(pid, sig)  # no pidfds here: the pid is checked again just before
            else:
                return False
        except ProcessLookupError:
            return False
        except OSError as exc:
            log.error("cannot send signal %d to process %d: %s", sig, pid, exc)
            return False
        return True

    def _live_workers(self) -> dict[int, WorkerRef]:
        return live_workers(self._group) if self._group is not None else {}

    def _report(self, expiry: TimerExpiry) -> None:
        group = self._group
        data = expiry.event_data()
        data["host"] = socket.gethostname()
        if group is not None and group.assignment is not None:
            data["round"] = data["attempt"] = group.assignment.attempt
        self._emit(EventType.WORKER_TIMER_EXPIRED, **data)
        self._say(f"watchdog: rank {expiry.worker.rank}: {expiry.message()}")

    # -- failures ---------------------------------------------------------------------------

    def explain(self, e: WorkerExit) -> WorkerExit:
        """``e`` with the timer as its message if this watchdog's kill ended it."""
        attempt, expiry = self._kills.get(e.pid, (None, None))
        current = self._group.assignment if self._group else None
        if expiry is None or attempt is not current or e.exit_code != -expiry.signal \
                or e.stopping:
            return e
        return replace(e, message=expiry.message())

    def explain_result(self, res: GroupResult) -> GroupResult:
        """``res`` with :meth:`explain` applied to its exits and failures."""
        if not self._kills:
            return res
        return replace(res, failures=tuple(map(self.explain, res.failures)),
                       exits=tuple(map(self.explain, res.exits)))


def _check_own_fifo(read_fd: int, write_fd: int, made: tuple[int, int] | None,
                    path: Path) -> None:
    """WatchdogError unless both descriptors opened the FIFO this agent made (``made``: its
    st_dev and st_ino), a FIFO owned by this user."""
    st, other = os.fstat(read_fd), os.fstat(write_fd)
    if (not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.geteuid()
            or (st.st_dev, st.st_ino) != made or (other.st_dev, other.st_ino) != made):
        raise WatchdogError(f"the watchdog FIFO {path} was replaced by another file between "
                            f"its creation and its opening: refusing it (name a path in a "
                            f"directory of your own, or unset {FILE_ENV} for a private one)")


def live_workers(group: WorkerGroup) -> dict[int, WorkerRef]:
    """The group's workers that have not exited, by pid."""
    gone = {e.pid for e in group.exits}
    return {w.pid: WorkerRef(w.global_rank, w.local_rank, w.pid)
            for w in group.workers if w.pid and w.pid not in gone}


def _owner(pid: int, workers: Mapping[int, WorkerRef]) -> WorkerRef | None:
    """The worker ``pid`` is, or descends from (by parentage); None if neither."""
    for _ in range(MAX_ANCESTRY):
        if pid in workers:
            return workers[pid]
        if pid <= 1:
            return None
        try:
            pid = psutil.Process(pid).ppid()
        except psutil.Error:
            return None
    return None


class _FifoProtocol(asyncio.Protocol):
    """Cuts the FIFO's bytes into lines. A line longer than ``MAX_REQUEST_BYTES`` is dropped
    whole (``on_line(None)`` once), however long it grows: memory stays bounded."""

    def __init__(self, on_line: Callable[[bytes | None], None]) -> None:
        self._on_line = on_line
        self._buf = bytearray()
        self._skipping = False

    def data_received(self, data: bytes) -> None:
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            if self._skipping:
                self._skipping = False
            elif len(self._buf) + nl - start > MAX_REQUEST_BYTES:
                self._buf.clear()
                self._on_line(None)
            else:
                self._buf += data[start:nl]
                line = bytes(self._buf)
                self._buf.clear()
                if line.strip():
                    self._on_line(line)
            start = nl + 1
        if self._skipping:
            return
        if len(self._buf) + len(data) - start > MAX_REQUEST_BYTES:
            self._buf.clear()
            self._skipping = True
            self._on_line(None)
        else:
            self._buf += data[start:]
