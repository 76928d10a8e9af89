"""The keeper: one small process per worker group and attempt that takes the group's whole
process tree with it when the agent goes away, however it goes.

Why: PR_SET_PDEATHSIG is per process. With it, a SIGKILLed agent takes its workers, but their
own children (a ``subprocess.Popen``, a ``setsid`` helper, a daemon) used to be left to init.

How: the agent starts the keeper (``python -I -S keeper.py FD``: stdlib only, no site, about
10 MiB and 20-30 ms) with one end of a socket pair; the other end is the agent's, close-on-exec
and never inherited, so it closes exactly when the agent is gone. The agent starts it ahead of
time (issue 23): the first one before the rendezvous, the next one in the background while an
attempt runs, so no restart waits for an interpreter to start. Over the socket the agent sends
the workers to start (argv, environment, and the write ends of their stdout and stderr pipes
as SCM_RIGHTS: they did not exist when the keeper was started) and the keeper answers with
each pid (or the exec's errno) and, the moment it reaps one, its exit status. It starts each
worker as ``subprocess`` would with ``start_new_session=True`` and a PR_SET_PDEATHSIG
preexec: own session, stdin on /dev/null, every other descriptor closed, SIGPIPE and SIGXFSZ
back to default, and otherwise the signal dispositions the agent gave it.
With ``--preload`` the keeper is no exec'ed process but a child the node's zygote forked
(:mod:`.zygote`), given its end of the socket as SCM_RIGHTS: the same rules from there on,
with the dispositions the zygote was born with, and workers forked rather than exec'ed.
The next attempt's keeper is forked ahead too, and forks its workers at once (``park``):
each becomes a worker (session, death with the keeper, dispositions, every other
descriptor closed) and waits on a socket of its own, before any user code, until the
request releases it with its argv, environment and pipes (``release``): a restart then
forks nothing. A parked worker reads nothing of the attempt before its release: its
environment is the request's, set by the bootstrap before the script runs, as for any
forked worker; and a request that may not fork (``may_fork``) leaves them unused.

The keeper is a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process of the tree whose
parent dies is reparented to the keeper instead of init, so the keeper's descendants are the
whole tree, whatever sessions, process groups, environments or descriptors they have. At EOF
on its socket (the agent exited, was SIGKILLed, or closed it after a stop) it SIGKILLs every
descendant, reaps until it has no child left (a process forked meanwhile is reparented to it
and caught on the next round), and exits. It ignores SIGTERM, SIGINT, SIGHUP and SIGQUIT: a signal
sent to a whole service reaches the agent too, and the agent, not the keeper, decides how the
workers stop (SIGTERM and the shutdown timeout first).

Covered: every descendant of the workers, in their session or not (``setsid``, double-forked
daemons with an empty environment and no descriptors), as long as the keeper lives. Not
covered: a process that is no descendant (one the job had another daemon start:
``systemd-run``, ``docker run``, ssh); one in uninterruptible sleep, until it wakes; one the
keeper may not signal (a setuid program when the agent is not root); and the tree of a
SIGKILLed keeper itself (OOM killer, ``kill -9``): its workers still die (their PDEATHSIG
names the keeper) and the agent reports them killed, but their children go to init, where
only the agent's next stop may find them (by the error file path in their environment).

Why not cgroup v2's ``cgroup.kill``: it needs a delegated cgroup (not there on hosts with a v1
hierarchy, nor for most unprivileged users) and still a living process to write to it.
"""

from __future__ import annotations

# The C half of `signal`: the same functions and numbers without `enum`, which would cost a
# third of the keeper's start-up, and the start-up is on every restart's path.
import _signal as signal
import ctypes
import errno
import marshal
import os
import select
import sys

#: keeper -> agent: ``(STARTED, index, pid)``, ``(FAILED, index, errno)`` when the worker
#: could not be executed (nothing after it is started), ``(EXITED, index, returncode)``
#: with a negative return code for a signal, as subprocess has it.
STARTED = "started"
FAILED = "failed"
EXITED = "exited"

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_LEN = 4
#: The signals the agent stops on by default (``--signals-to-handle``, as torchrun's): the
#: agent decides what they do to the workers, so the keeper ignores them.
_IGNORED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_WATCHED = (*_IGNORED, signal.SIGCHLD)


def dispositions() -> dict[int, object]:
    """This process's signal dispositions that the keeper changes or a worker resets."""
    born = {s: signal.getsignal(s) for s in (*_WATCHED, signal.SIGPIPE)}
    if hasattr(signal, "SIGXFSZ"):
        born[signal.SIGXFSZ] = signal.getsignal(signal.SIGXFSZ)
    return born


def frame(message: object) -> bytes:
    """One message on the socket: a length, then its ``marshal`` form (both ends run the same
    interpreter, and nothing else can reach the socket)."""
    payload = marshal.dumps(message)
    return len(payload).to_bytes(_LEN, "big") + payload


class Unframer:
    """Bytes from the socket -> the messages completed by them."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[object]:
        self._buf += data
        out = []
        while len(self._buf) >= _LEN:
            size = int.from_bytes(self._buf[:_LEN], "big")
            if len(self._buf) < _LEN + size:
                break
            out.append(marshal.loads(bytes(self._buf[_LEN:_LEN + size])))
            del self._buf[:_LEN + size]
        return out


#: Descriptors one request may carry (two per worker).
_MAX_FDS = 4096


def read_request(ctl: int, unframer: Unframer) -> list | None:
    """The agent's request, each worker's pipe descriptors (sent as SCM_RIGHTS, replaced by
    their index in the message: see ``zygote.send_request``) put back; None at EOF. With the
    C module ``_socket``: ``socket`` would import ``enum``."""
    import _socket
    import array

    sock = _socket.socket(fileno=os.dup(ctl))
    fds: list[int] = []
    size = _socket.CMSG_LEN(_MAX_FDS * 4)
    try:
        while True:
            try:
                data, ancillary, flags, _ = sock.recvmsg(1 << 16, size)
            except ConnectionResetError:
                data, ancillary, flags = b"", [], 0
            for level, kind, payload in ancillary:
                if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(payload[:len(payload) - len(payload) % got.itemsize])
                    fds += got
            if flags & _socket.MSG_CTRUNC:  # descriptors lost: no worker could get its pipes
                data = b""
            if not data:
                for fd in fds:
                    os.close(fd)
                return None
            messages = unframer.feed(data)
            if messages:
                break
    finally:
        sock.close()  # the dup, not ctl
    request = messages[0]
    assert isinstance(request, list)
    return [(argv, env, fds[o], fds[e], *rest) for argv, env, o, e, *rest in request]


class _Keeper:
    def __init__(self, ctl: int, zygote: object = None, park: int = 0) -> None:
        self.ctl = ctl
        #: With ``--preload``: the :class:`.zygote.Zygote` whose policy lets ``spawn`` fork
        #: a worker that runs its script in-process (a request then carries its recipe).
        self.zygote = zygote
        #: Workers to fork before the request comes (a keeper forked ahead of its attempt):
        #: parked, each on its socket (pid, our end), until the request releases them.
        self.park_count = park
        self.parked: list[tuple[int, int]] = []
        # A forked worker gets the dispositions this interpreter was born with (Python's):
        # a keeper forked by the zygote was born with the zygote's, before its loop began.
        born = dispositions() if zygote is None else zygote.born  # type: ignore[attr-defined]
        self.initial = dict(born)
        self.me = os.getpid()
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.workers: dict[int, int] = {}  # pid -> index
        self.agent_gone = False
        # What the workers must inherit: the agent's dispositions, not the keeper's. Only an
        # ignored signal survives exec; the two Python ignores go back to default, as with
        # subprocess's restore_signals.
        self.restore = {s: signal.SIG_IGN if born[s] == signal.SIG_IGN
                        else signal.SIG_DFL for s in _WATCHED}
        self.restore[signal.SIGPIPE] = signal.SIG_DFL
        if hasattr(signal, "SIGXFSZ"):
            self.restore[signal.SIGXFSZ] = signal.SIG_DFL

    def send(self, message: object) -> None:
        if self.agent_gone:
            return
        data = frame(message)
        try:
            while data:
                data = data[os.write(self.ctl, data):]
        except OSError:
            self.agent_gone = True

    def run(self) -> int:
        if self.libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            print(f"elastic-agent keeper: cannot become a child subreaper: "
                  f"{os.strerror(ctypes.get_errno())}", file=sys.stderr)
        for sig in _IGNORED:
            signal.signal(sig, signal.SIG_IGN)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        # A handler (not SIG_DFL) so that SIGCHLD writes to the wakeup pipe.
        signal.signal(signal.SIGCHLD, lambda *_: None)

        self.park(self.park_count)
        unframer = Unframer()
        spec = read_request(self.ctl, unframer)
        if spec is None:
            self.kill_tree()
            return self.done()
        assert isinstance(spec, list)
        failed = False
        for index, (argv, env, out_fd, err_fd, *how) in enumerate(spec):
            if not failed and not self.agent_gone:
                warm = bool(how and how[0] and self.zygote is not None
                            and self.zygote.may_fork(env))
                if warm:
                    pid = self.release(argv, env, out_fd, err_fd, how[0])
                    pid, err = (pid, 0) if pid else self.fork_worker(
                        argv, env, out_fd, err_fd, how[0])
                else:
                    pid, err = self.spawn(argv, env, out_fd, err_fd)
                if err:
                    self.send((FAILED, index, err))
                    failed = True  # the agent stops the group: start no more of it
                else:
                    self.workers[pid] = index
                    self.send((STARTED, index, pid))
                    if warm and index + 1 < len(spec):
                        _store_lead(env, pid)
            # From here on the pipes are the workers' alone: their EOF is the tree's.
            os.close(out_fd)
            os.close(err_fd)
        for _, sock in self.parked:  # not needed: EOF, and each exits before any user code
            os.close(sock)
        self.parked = []

        poller = select.poll()
        poller.register(self.ctl, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        while not self.agent_gone:
            self.reap(block=False)
            if self.agent_gone:
                break
            for fd, _ in poller.poll():
                if fd == wake_r:
                    while True:
                        try:
                            if not os.read(wake_r, 512):
                                break
                        except BlockingIOError:
                            break
                elif not _more_from(self.ctl, unframer):
                    self.agent_gone = True
        self.kill_tree()
        return self.done()

    def done(self) -> int:
        """The tree is gone: say so by closing the socket (EOF for the agent) before this
        process's own exit, whose teardown takes a while in a big process (a keeper forked
        by a zygote that imported torch): the agent's stop waits for the tree, not for that."""
        try:  # noqa: SIM105 - no contextlib: the keeper imports as little as it can
            os.close(self.ctl)
        except OSError:
            pass
        return 0

    def spawn(self, argv: list[bytes], env: dict[bytes, bytes], out_fd: int,
              err_fd: int) -> tuple[int, int]:
        """Fork and exec one worker; its pid and 0, or -1 and the errno of the failed exec."""
        err_r, err_w = os.pipe()  # close-on-exec: EOF without data means the exec worked
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child, until exec
            code = 0
            try:
                _become_worker(self.libc, self.me, self.restore, out_fd, err_fd)
                os.closerange(3, err_w)
                os.closerange(err_w + 1, os.sysconf("SC_OPEN_MAX"))
                os.execvpe(argv[0], argv, env)
            except (OSError, ValueError) as exc:  # ValueError: e.g. "=" in a variable's name
                code = getattr(exc, "errno", None) or errno.EINVAL
            finally:
                try:
                    os.write(err_w, str(code or 1).encode())
                finally:
                    os._exit(127)
        os.close(err_w)
        chunks = []
        while chunk := os.read(err_r, 64):
            chunks.append(chunk)
        os.close(err_r)
        if chunks:
            os.waitpid(pid, 0)
            return -1, int(b"".join(chunks))
        return pid, 0

    def zygote_module(self):
        return sys.modules["__main__"]

    def fork_worker(self, argv: list[bytes], env: dict[bytes, bytes], out_fd: int,
                    err_fd: int, how: tuple) -> tuple[int, int]:
        """Fork a worker that runs ``how`` in the preloaded interpreter (see
        :mod:`.zygote`); its pid and 0. The child leaves this stack by raising
        ``BecomeWorker``, and never returns here."""
        become = self.zygote_module().BecomeWorker
        pid = os.fork()
        if pid:
            return pid, 0
        try:  # pragma: no cover - the child
            _become_worker(self.libc, self.me, self.initial, out_fd, err_fd)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))
            environ = {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}
            orig = [os.fsdecode(a) for a in argv]
        except BaseException:
            os._exit(127)
        raise become(how, environ, orig)

    def park(self, count: int) -> None:
        """Fork ``count`` workers ahead of the request (a keeper the zygote forked ahead of
        its attempt), each parked before any user code until :meth:`release` hands it its
        argv, environment and pipes: the request then starts no process. Parks none if
        forking is unsafe now (the request's own checks then warn and fall back)."""
        if self.zygote is None or count <= 0 or self.zygote.fork_hazard(None) is not None:
            return
        import _socket

        for index in range(count):
            ours, theirs = (s.detach() for s in _socket.socketpair(
                _socket.AF_UNIX, _socket.SOCK_STREAM))
            pid = os.fork()
            if pid == 0:  # pragma: no cover - the parked child, until released
                os.close(ours)
                self.parked_worker(theirs, index)
            os.close(theirs)
            self.parked.append((pid, ours))

    def parked_worker(self, sock: int, index: int) -> None:  # pragma: no cover - a parked child
        """In a worker forked ahead: become a worker (session, death with the keeper, the
        signal dispositions it is born with) with only ``sock`` open, wait on it for the
        request that releases it, then leave this stack as ``fork_worker``'s child does.
        Exits without running anything if the keeper lets it go (EOF). Until then ``ps``
        names it a parked worker of the local rank it is parked for (``index``: the request
        releases them in order), never the script it may run."""
        become = self.zygote_module().BecomeWorker
        try:
            _become_worker(self.libc, self.me, self.initial, -1, -1)
            self.zygote.show("parked worker", f"local rank {index}")  # type: ignore[attr-defined]
            os.closerange(3, sock)
            os.closerange(sock + 1, os.sysconf("SC_OPEN_MAX"))
            request = read_request(sock, Unframer())
            if not request:
                os._exit(0)
            argv, env, out_fd, err_fd, how = request[0]
            os.close(sock)
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            os.close(out_fd)
            os.close(err_fd)
            environ = {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}
            orig = [os.fsdecode(a) for a in argv]
        except BaseException:
            os._exit(127)
        raise become(how, environ, orig)

    def release(self, argv: list[bytes], env: dict[bytes, bytes], out_fd: int, err_fd: int,
                how: tuple) -> int:
        """Hand a parked worker its argv, environment, recipe and pipes; its pid, or 0 if
        none is parked (or alive): the caller forks one now."""
        import _socket
        import array

        while self.parked:
            pid, sock = self.parked.pop(0)
            data = frame([(argv, env, 0, 1, how)])
            conn = _socket.socket(fileno=sock)
            try:
                sent = conn.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS,
                                              array.array("i", [out_fd, err_fd]))])
                if sent < len(data):  # not otherwise: it may have read it all and closed
                    conn.sendall(data[sent:])
            except OSError:
                continue  # it died while parked (reaped with the others): the next one
            finally:
                conn.close()
            return pid
        return 0

    def reap(self, block: bool) -> bool:
        """Reap every exited child (reporting workers' exits); False once none is left."""
        flags = 0 if block else os.WNOHANG
        while True:
            try:
                pid, status = os.waitpid(-1, flags)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            index = self.workers.pop(pid, None)
            if index is not None:
                self.send((EXITED, index, os.waitstatus_to_exitcode(status)))
            flags = os.WNOHANG

    def kill_tree(self) -> None:
        """SIGKILL every descendant until there is none: a process forked while this runs is
        reparented here when its parent dies, and found on the next round."""
        self.agent_gone = True
        while True:
            if not _has_children():
                return  # a subreaper without children has no descendants: no /proc walk
            tree = descendants(self.me, parents())
            for pid in tree:
                _kill(pid, tree | {self.me})
            if not self.reap(block=True):
                return


def _become_worker(libc: ctypes.CDLL, keeper_pid: int, dispositions: dict[int, object], out_fd: int,
                   err_fd: int) -> None:  # pragma: no cover - runs in the forked child
    """In a child just forked to be a worker: the signal handlers it is born with, its own
    session, death with the keeper, and the worker's pipes as stdout and stderr (a worker
    parked ahead of its request, ``out_fd`` -1, gets them when released)."""
    signal.set_wakeup_fd(-1)
    for sig, disposition in dispositions.items():
        signal.signal(sig, disposition)
    os.setsid()
    # If the keeper is gone, nobody could stop this worker: don't start it.
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != keeper_pid:
        os._exit(1)
    if out_fd >= 0:
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)


#: How long the keeper waits for a warm rank 0 to listen on MASTER_PORT before it starts the
#: node's other workers (see ``_store_lead``).
STORE_LEAD = 0.1


def _store_lead(env: dict[bytes, bytes], pid: int) -> None:
    """After starting global rank 0 (``pid``) from a zygote that preloaded torch.distributed:
    wait until something listens on its MASTER_PORT, the store that
    ``init_process_group("env://")`` has rank 0 serve, before starting the other ranks; or
    until rank 0 waits for something else (it sleeps without listening: a script that
    serves no store there), or :data:`STORE_LEAD` at most. Workers forked or released at
    once would otherwise connect before it listens, and torch's store client then waits up
    to about a second before it tries again (seen here: 0.4-0.9 s added to a restart in 3
    runs of 6). Exec'ed workers need no lead: each imports torch first, for seconds. Polls
    /proc every millisecond: the kernel has no event for another process's listen."""
    port = env.get(b"MASTER_PORT", b"")
    if env.get(b"RANK") != b"0" or not port.isdigit() or "torch.distributed" not in sys.modules:
        return
    import time

    suffix = b":%04X" % int(port)
    deadline = time.monotonic() + STORE_LEAD
    while (time.monotonic() < deadline and not _listening(suffix)
           and _state(pid) in (b"R", b"D")):
        select.select([], [], [], 0.001)


def _state(pid: int) -> bytes:
    """A process's state letter in /proc (R running, S sleeping, ...); b"" if gone."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return b""
    try:
        fields = os.read(fd, 4096).rpartition(b")")[2].split(None, 1)
    except OSError:
        return b""
    finally:
        os.close(fd)
    return fields[0] if fields else b""


def _listening(suffix: bytes) -> bool:
    """Whether a TCP socket of this network namespace listens on the port ``suffix``
    (``:PPPP``, hex, as /proc/net/tcp writes local addresses)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, "rb") as f:
                next(f, None)  # the header
                for line in f:
                    fields = line.split(None, 4)
                    if len(fields) > 3 and fields[3] == b"0A" and fields[1].endswith(suffix):
                        return True
        except OSError:
            continue
    return False


def _has_children() -> bool:
    """Whether this process has a child, exited or not (nothing is reaped)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def _more_from(fd: int, unframer: Unframer) -> bool:
    """Read what the agent sent (nothing is expected after the start); False at EOF."""
    try:
        data = os.read(fd, 1 << 16)
    except BlockingIOError:
        return True
    except OSError:
        return False
    if data:
        unframer.feed(data)
    return bool(data)


def parents() -> dict[int, int]:
    """pid -> parent pid for every process in /proc."""
    parents = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            fd = os.open(f"/proc/{name}/stat", os.O_RDONLY)
        except OSError:
            continue
        try:
            stat = os.read(fd, 4096)
        except OSError:
            continue
        finally:
            os.close(fd)
        # The command name is in parentheses and may hold anything, parentheses included.
        fields = stat.rpartition(b")")[2].split()
        if len(fields) > 1:
            parents[int(name)] = int(fields[1])
    return parents


def descendants(root: int, parents: dict[int, int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _kill(pid: int, tree: set[int]) -> None:
    """SIGKILL ``pid`` if it is still the process seen in the tree: the pidfd pins it, and its
    parent is checked again after pinning, so a pid reused meanwhile is left alone."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfds (Linux < 5.3): a narrower window remains
        if _parent_of(pid) in tree:
            try:  # noqa: SIM105 - no contextlib: the keeper imports as little as it can
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return
    try:
        if _parent_of(pid) in tree:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(pidfd)


def _parent_of(pid: int) -> int | None:
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        fields = os.read(fd, 4096).rpartition(b")")[2].split()
    except OSError:
        return None
    finally:
        os.close(fd)
    return int(fields[1]) if len(fields) > 1 else None


def main(argv: list[str]) -> int:
    """``keeper.py FD``: FD is the keeper's end of the agent's socket pair."""
    return _Keeper(int(argv[1])).run()


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stderr.flush()
    os._exit(code)  # the tree is gone: the agent's stop waits only for the finalizer otherwise
