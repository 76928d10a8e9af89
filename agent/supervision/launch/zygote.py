"""Warm workers (``--preload MODULES``): a zygote that has imported those modules forks each
attempt's keeper, which forks each worker and runs the training script in the forked process,
instead of exec'ing a new interpreter that imports them again.

``--preload auto``, the default (issue 23): every Python worker (``python -u SCRIPT`` or
``-m MODULE``) is forked from the node's zygote, so no restart waits for interpreters to
start; and when the script starts with imports that include torch, before any other
statement (:func:`auto_preload`), the zygote imports torch first, as with ``--preload
torch``: no restart waits for the workers to import it again. ``--no-python``,
``--run-path``, ``--numa-binding`` and ``--preload off`` are exec'ed as before. In that mode
the zygote is silent when torch fails to import (the workers import it again and report
their own error). What a worker gives up by default is the list of known differences below
(its own hash seed, the zygote's modules already imported), and torch's import-time messages
are printed once, on the agent's stderr, not in each rank's log.

Two halves in one stdlib-only file (it never imports torch itself: only what ``--preload``
names, by name, at run time):

* the agent's half: :func:`recipe` (what a worker runs, or None for the exec path),
  :func:`command` (how the zygote is started), :func:`fork_keeper` (an attempt's keeper,
  its end of the agent's socket passed as SCM_RIGHTS) and :func:`send_request` (the workers
  to start, their pipes' descriptors passed the same way: the keeper was forked before the
  pipes existed);
* the zygote's half, run as ``python -u zygote.py FD SYS_PATH0 MODULES auto|user JOB NODE
  [ROOM...]``: one per worker group (node), started before the rendezvous and kept across
  attempts. It imports MODULES
  and nothing else, then serves FD in one thread (a poll loop; SIGCHLD wakes it to reap):
  for each ``FORK`` it checks :meth:`Zygote.fork_hazard`, forks, and answers with the
  child's pid and a pidfd of it, opened before it could reap the child, which the agent
  watches (the keeper is no child of the agent). It never runs user code and never keeps a
  tree itself; at FD's EOF it exits, and the keepers live on, each until its own socket's EOF.
  The forked child leaves the zygote's stack by raising :class:`BecomeKeeper` and is an
  ordinary keeper (:mod:`.keeper`, same socket protocol, same subreaper and
  death-with-the-agent rules) whose ``spawn`` forks; asked ``(FORK, PARK)`` (the next
  attempt's keeper, forked while an attempt runs), it forks PARK workers at once and parks
  them before any user code until its request hands each its argv, environment and pipes
  (``keeper._Keeper.park``). A worker it forks leaves the keeper's
  stack by raising :class:`BecomeWorker` and runs the script at the top level of this file,
  so the interpreter's own exit path (SystemExit, atexit, threading shutdown, flushing,
  KeyboardInterrupt's death by SIGINT) is the worker's, as with ``python -u``.

What a forked worker sees, as with ``python -u script.py args`` (or ``-m module``): a new
``__main__`` module, ``sys.argv``, ``sys.path[0]`` (the script's resolved directory; the
working directory for ``-m``), the agent's working directory, the complete worker environment
in ``os.environ`` (and the C environment) before any user code, the signal dispositions the
zygote had at birth (Python's own: SIGINT raises KeyboardInterrupt, SIGPIPE/SIGXFSZ ignored),
unbuffered stdio on the agent's pipes, stdin /dev/null, its own session and process group,
PR_SET_PDEATHSIG naming the keeper, and the command line ``ps`` shows (below). Known
differences: the hash seed (``PYTHONHASHSEED`` random) is the zygote's, shared by all forked
workers; modules the preload imported are already in ``sys.modules``; ``random`` is reseeded
after the fork by Python itself and ``numpy.random`` here.

What ``ps`` shows (:func:`set_cmdline`): a worker, forked or exec'ed through the bootstrap,
rewrites its argv area to ``python -u SCRIPT ARGS`` (or ``-m MODULE``), as exec would have
laid it out, and its comm to its interpreter's name, before any user code; the zygote, a
keeper it forked and a parked worker name themselves (``elastic-agent zygote (job J, node
N)``, ``elastic-agent keeper (...)``, ``elastic-agent parked worker (job J, local rank K)``),
so that ``pgrep -f SCRIPT`` finds the workers only. Forked processes share the zygote's argv
area, so the agent starts the zygote with room (:func:`command`) for the workers' whole
command line. Cost: a few system calls per worker (/proc/self/stat, cmdline, mem, comm).

The exec path (no ``--preload``) runs its Python workers through this file too, as
``python -u zygote.py --worker SCRIPT|-m MODULE|-c CODE ARGS``: the same :func:`_run_worker`,
without the preload, so both paths register the stack handler (:func:`arm_stacks`, issue 13)
before any user code and then run it as ``python -u`` would (``sys.orig_argv`` and the
command line ``ps`` shows without the bootstrap; its frames left out of tracebacks).

Safety, checked before every fork (:meth:`Zygote.fork_hazard`): no Python thread besides the
main one and CUDA not initialised (before the zygote forks a keeper, and again before the
keeper forks each worker), and every environment variable read at interpreter start-up or by
the preloaded modules' import (anything but the launcher's per-rank variables) equal to the
zygote's own (before each worker). If one fails, the worker is exec'ed as without
``--preload`` (a refused keeper is exec'ed too, as without ``--preload``), with one warning
on the agent's stderr. ``import torch`` 2.13 (CPU) leaves a native thread that is no Python
thread (seen here: 2 OS threads, the main one and one more, both named ``python`` in
``/proc/self/task/*/comm``; ``threading.active_count()`` is 1). A fork copies only the forking
thread, and torch's ``pthread_atfork`` handlers reset its thread pools in the child.

Memory: forked workers share the zygote's pages copy-on-write, so count them by PSS (shared
pages divided among their sharers), not RSS. The node holds one copy of the preload (about
155 MiB PSS for torch 2.13 CPU), shared by the zygote, the attempt's keeper and its workers:
no second interpreter imports it while an attempt runs or across restarts. The zygote calls
``gc.freeze()`` before each fork so that no collection in a child writes to (and so copies)
the pages of the objects it inherited (about 40 MiB PSS of 4 torch workers here). Measured
by ``bench/preload_bench.py --repeat 3`` (4 workers, 2 cores): peak PSS of the node 997 MiB
with ``--preload torch``, 969 MiB without, 1073 MiB under torchrun (0.93x; the spare zygote
of the earlier design made it 1161 MiB, 1.08x). The next attempt's keeper and its parked
workers, forked while an attempt runs, add about 1 MiB of private pages each. Known
differences that
follow: a forked worker starts with those objects in the permanent generation
(``gc.get_freeze_count()`` > 0), and a keeper's exit status is the zygote's to reap (the
agent sees only that it exited).
"""

from __future__ import annotations

import array
import os
import sys
from collections.abc import Mapping, Sequence

#: Variables the launcher sets per rank, after the zygote started: they may differ from the
#: zygote's environment (nothing reads them at interpreter start-up or at ``import torch``;
#: CUDA reads CUDA_VISIBLE_DEVICES only when initialised, which the zygote never is).
LAUNCHER_VARS = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_ERROR_FILE", "ELASTIC_REDIS_URL", "ELASTIC_JOB_ID", "CUDA_VISIBLE_DEVICES",
    "ELASTIC_STACKS", "TORCHELASTIC_SIGNALS_TO_HANDLE", "ELASTIC_RECORDER",
})
#: ``SIGNUM:FIFO``: where a worker's stack handler writes (see supervision/diagnosis/stacks.py).
STACKS_ENV = "ELASTIC_STACKS"
#: ``PATH``: the agent's socket a worker's collective-trace thread serves (issue 22,
#: supervision/launch/recorder_probe.py).
RECORDER_ENV = "ELASTIC_RECORDER"
#: ``python -u zygote.py --worker SCRIPT|-m MODULE|-c CODE ARGS``: the exec path's worker,
#: started through the same code as a forked one (:func:`_run_worker`), minus the preload.
WORKER_FLAG = "--worker"
#: agent -> zygote: ``(FORK,)`` or ``(FORK, PARK)`` with the keeper's socket end as
#: SCM_RIGHTS (PARK: workers the keeper forks at once, parked until its request; see
#: ``keeper._Keeper.park``); zygote -> agent: ``(FORKED, pid)`` with a pidfd of the keeper,
#: or ``(REFUSED, why)``.
FORK = "fork"
#: The most workers a keeper parks (a node's workers: ``--nproc-per-node``'s own bound).
MAX_PARK = 4096
FORKED = "forked"
REFUSED = "refused"
_MAX_REQUEST = 64 << 20
_HERE = __file__


# -- the agent's half -------------------------------------------------------------------------

def recipe(entrypoint: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """``("file", script, args)`` or ``("module", name, args)`` for an entrypoint the zygote
    can run (``[sys.executable, "-u", SCRIPT|-m MODULE, ...]`` with SCRIPT a regular file),
    else None: that worker is exec'ed."""
    argv = list(entrypoint)
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-u":
        return None
    if argv[2] == "-m":
        return ("module", argv[3], argv[4:]) if len(argv) > 3 and argv[3] else None
    if argv[2].startswith("-") or not os.path.isfile(argv[2]):
        return None
    return ("file", argv[2], argv[3:])


def command(entrypoint: Sequence[str], modules: Sequence[str], fd: int,
            auto: bool = False, job: str = "", node: str = "") -> list[str] | None:
    """The zygote's command line for this entrypoint, or None if it cannot be forked from.
    ``auto``: the modules are ``--preload auto``'s choice, not the user's (the zygote then
    says nothing when one fails to import: the workers import it again and say it).
    ``job`` and ``node`` name the zygote and its forks in ``ps`` (:func:`set_cmdline`).

    It ends with room: blank arguments that make its argv area (which every fork shares,
    and which :func:`set_cmdline` rewrites in place) at least as long as the entrypoint's,
    so that a forked worker shows its whole command line however long its arguments."""
    how = recipe(entrypoint)
    if how is None:
        return None
    kind, target, _ = how
    path0 = (os.getcwd() if kind == "module"
             else os.path.dirname(os.path.realpath(target)))
    argv = [sys.executable, "-u", os.path.abspath(__file__), str(fd), path0, ",".join(modules),
            "auto" if auto else "user", job, node]
    return argv + _room(_area_size(entrypoint) - _area_size(argv))


#: The longest blank argument of the zygote's room (the kernel's own limit is 128 KiB).
ROOM_CHUNK = 1 << 16


def _area_size(argv: Sequence[str]) -> int:
    """Bytes of ``argv`` in a process's argv area (each argument and its NUL)."""
    return sum(len(os.fsencode(a)) + 1 for a in argv)


def _room(short: int) -> list[str]:
    """Blank arguments taking ``short`` bytes of argv area (none if ``short`` <= 0)."""
    room = []
    while short > 0:
        take = min(short, ROOM_CHUNK)
        room.append(" " * (take - 1))
        short -= take
    return room


#: The largest script ``auto_preload`` reads.
AUTO_MAX_BYTES = 1 << 20
#: What ``--preload auto`` preloads, by the top-level package a script imports.
AUTO_MODULES = ("torch",)


def auto_preload(entrypoint: Sequence[str]) -> tuple[str, ...]:
    """``--preload auto``: the packages of :data:`AUTO_MODULES` (torch) that a script run as
    ``python -u SCRIPT`` imports in the imports it starts with, before any other statement
    (a docstring aside); else ``()``: the zygote imports nothing of the script's.

    Why only leading imports: a statement before them may change what the import does (an
    ``os.environ`` set for torch to read); a forked worker finds torch already imported by
    the zygote, with the zygote's environment (the workers' own, minus the per-rank
    variables). An ``import torch`` inside a function, a ``try``, or after code does not
    count. ``-m`` modules, ``-c`` and anything unreadable or unparsable are not looked at."""
    how = recipe(entrypoint)
    if how is None or how[0] != "file":
        return ()
    try:
        with open(how[1], "rb") as f:
            source = f.read(AUTO_MAX_BYTES + 1)
    except OSError:
        return ()
    if len(source) > AUTO_MAX_BYTES:
        return ()
    import ast

    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return ()
    found: list[str] = []
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module] if node.level == 0 and node.module else []
        elif i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        else:
            break
        for name in names:
            top = name.partition(".")[0]
            if top in AUTO_MODULES and top not in found:
                found.append(top)
    return tuple(found)


def send_request(sock: object, requests: list[tuple]) -> bytes:
    """Send the workers to start to a keeper (forked or exec'ed: ``keeper.read_request``):
    each request's two pipe descriptors travel as SCM_RIGHTS and are replaced by their index
    in the message. On a blocking socket, all of it (the keeper is reading); on a
    non-blocking one, what fits in its buffer, with the descriptors: returns the rest, to be
    sent as its room comes (BlockingIOError if nothing fitted)."""
    import socket

    from elastic_agent.supervision.launch.keeper import frame
    assert isinstance(sock, socket.socket)
    fds: list[int] = []
    message = []
    for argv, env, out_fd, err_fd, *rest in requests:
        message.append((argv, env, len(fds), len(fds) + 1, *rest))
        fds += [out_fd, err_fd]
    data = frame(message)
    sent = sock.sendmsg([data[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                       array.array("i", fds))])
    rest = memoryview(data)[sent:]
    if sock.getblocking():
        sock.sendall(rest)
        return b""
    while rest:
        try:
            rest = rest[sock.send(rest):]
        except BlockingIOError:
            break
    return bytes(rest)


async def fork_keeper(sock: object, keeper_fd: int,
                      park: int = 0) -> tuple[int, int] | str | None:
    """Ask the zygote on ``sock`` to fork a keeper whose end of the agent's socket is
    ``keeper_fd`` (sent as SCM_RIGHTS; the caller closes its copy) and that forks ``park``
    workers at once, parked until its request (a keeper forked ahead of its attempt). Returns the keeper's pid
    and a pidfd of it (the caller's to close: the keeper is no child of the agent, and the
    zygote opened the pidfd before it could reap the keeper, so it names that process even
    if it has exited); None if the zygote refused (on a hazard it has warned about, once, on
    its stderr); why not if it is gone. The caller then execs a keeper. Event-driven on the
    loop; if cancelled, the reply is left unread and the caller must drop the zygote."""
    import asyncio
    import socket

    from elastic_agent.supervision.launch.keeper import Unframer, frame
    assert isinstance(sock, socket.socket)
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    data = frame((FORK, park) if park else (FORK,))
    try:  # a few bytes on an idle socket: the send buffer has room
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                      array.array("i", [keeper_fd]))])
        if sent < len(data):
            await loop.sock_sendall(sock, data[sent:])
    except OSError as exc:
        return f"the zygote cannot be reached ({exc})"
    unframer = Unframer()
    fds: list[int] = []
    reply: asyncio.Future[object] = loop.create_future()

    def readable() -> None:
        try:
            got_data, got, _, _ = socket.recv_fds(sock, 1 << 12, 4)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            got_data, got = b"", []
        fds.extend(got)
        if reply.done():
            return
        if not got_data:
            reply.set_result(None)
        elif messages := unframer.feed(got_data):
            reply.set_result(messages[0])

    loop.add_reader(sock.fileno(), readable)
    try:
        message = await reply
    except BaseException:  # cancelled: the caller drops this zygote (its reply is unread)
        for fd in fds:
            os.close(fd)
        raise
    finally:
        loop.remove_reader(sock.fileno())
    pidfds = fds
    if (isinstance(message, tuple) and len(message) == 2 and message[0] == FORKED
            and type(message[1]) is int and len(pidfds) == 1):
        return message[1], pidfds[0]
    for fd in pidfds:
        os.close(fd)
    if isinstance(message, tuple) and len(message) == 2 and message[0] == REFUSED:
        return None
    return "the zygote exited" if message is None else "the zygote answered nonsense"


# -- the zygote's half ------------------------------------------------------------------------

class BecomeWorker(BaseException):
    """Raised in a forked child to unwind the keeper's stack and run the worker."""

    def __init__(self, how: tuple[str, str, list[str]], env: Mapping[str, str],
                 orig_argv: list[str]) -> None:
        super().__init__()
        self.how = how
        self.env = env
        self.orig_argv = orig_argv


class BecomeKeeper(BaseException):
    """Raised in a child the zygote forked to be an attempt's keeper: it unwinds the
    zygote's loop, whose descriptors it closes, and keeps at the top level of this file."""

    def __init__(self, keeper_fd: int, close: Sequence[int], park: int = 0) -> None:
        super().__init__()
        self.keeper_fd = keeper_fd
        self.close = close
        self.park = park


class Zygote:
    """The fork policy of the zygote and of the keepers it forks, and the zygote's loop."""

    def __init__(self, keeper: object, auto: bool = False, job: str = "",
                 node: str = "") -> None:
        #: The keeper module, loaded by path (the zygote has no package on its path).
        self.keeper = keeper
        #: Started by ``--preload auto``, not by the user's ``--preload``.
        self.auto = auto
        #: Whose processes these are, as ``ps`` shows them (see :meth:`show`).
        self.job = job
        self.node = node
        self.birth_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        #: The dispositions this interpreter was born with, before the zygote ignored or
        #: handled any: what a forked worker gets, and what an exec'ed one inherits.
        self.born = keeper.dispositions()  # type: ignore[attr-defined]
        self.warned = False

    def show(self, role: str, where: str = "") -> None:
        """Name this process (the zygote, or a keeper or parked worker it forked, before it
        runs a worker) in ``ps``: ``elastic-agent ROLE (job J, node N)``, or ``WHERE``
        instead of the node. One argument: no tool mistakes it for a worker's script."""
        inside = [f"job {label(self.job)}" if self.job else "",
                  where or (f"node {label(self.node)}" if self.node else "")]
        detail = ", ".join(part for part in inside if part)
        set_cmdline([f"elastic-agent {role}" + (f" ({detail})" if detail else "")],
                    COMMS.get(role, ""))

    def fork_hazard(self, env: Mapping[bytes, bytes] | None) -> str | None:
        """Why forking now (a worker with ``env``; a keeper without) would be unsafe or
        unfaithful, or None."""
        threading = sys.modules.get("threading")
        if threading is not None and threading.active_count() > 1:
            names = [t.name for t in threading.enumerate()]
            return f"the zygote runs Python threads {names}"
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
            return "CUDA is initialised in the zygote"
        if env is None:
            return None
        wanted = {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()
                  if os.fsdecode(k) not in LAUNCHER_VARS}
        if wanted != self.birth_env:
            diff = sorted(set(wanted.items()) ^ set(self.birth_env.items()))
            return f"the worker's environment differs from the zygote's ({diff[0][0]}, ...)"
        return None

    def may_fork(self, env: Mapping[bytes, bytes] | None) -> bool:
        hazard = self.fork_hazard(env)
        if hazard is not None:
            self.warn(hazard)
        return hazard is None

    def warn(self, hazard: str) -> None:
        if not self.warned:
            self.warned = True
            what = "the warm start (--preload auto)" if self.auto else "--preload"
            print(f"elastic-agent zygote: {hazard}: starting workers with a new interpreter "
                  f"instead ({what} gains nothing)", file=sys.stderr, flush=True)

    def serve(self, ctl: int) -> int:
        """Fork a keeper for each request on ``ctl`` until its EOF (the agent closed it or is
        gone), then exit: the keepers live on, each until its own socket's EOF. One thread,
        one poll loop: a SIGCHLD wakes it to reap the keepers that exited."""
        import gc
        import select
        import socket

        k = self.keeper
        signal = k.signal  # type: ignore[attr-defined]
        for sig in k._IGNORED:  # type: ignore[attr-defined]
            signal.signal(sig, signal.SIG_IGN)  # as a keeper: the agent decides
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so it wakes the poll
        try:
            os.close(os.pidfd_open(os.getpid()))
            no_pidfd = None
        except (AttributeError, OSError) as exc:
            no_pidfd = f"no pidfd for the agent to watch a keeper with ({exc})"
        sock = socket.socket(fileno=ctl)
        unframer = k.Unframer()  # type: ignore[attr-defined]
        fds: list[int] = []
        poller = select.poll()
        poller.register(ctl, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == wake_r:
                    _drain(wake_r)
                    _reap()
                    continue
                try:
                    data, got, flags, _ = socket.recv_fds(sock, 1 << 12, 16)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data, got, flags = b"", [], 0
                fds += got
                if not data or flags & socket.MSG_CTRUNC:
                    return 0  # the agent is gone (or sent garbage): the keepers live on
                for message in unframer.feed(data):
                    park = _fork_request(message)
                    if park is None or not fds:
                        continue  # nothing else is asked; a FORK always brings its fd
                    keeper_fd = fds.pop(0)
                    hazard = no_pidfd or self.fork_hazard(None)
                    if hazard is not None:
                        self.warn(hazard)
                        os.close(keeper_fd)
                        self._reply(sock, (REFUSED, hazard), None)
                        continue
                    # The keeper and its workers keep the preload's objects, shared: no
                    # collection of theirs should write to (and so copy) those pages.
                    gc.freeze()
                    pid = os.fork()
                    if pid == 0:  # pragma: no cover - the keeper, until it keeps
                        sock.detach()  # closed below by number, not again by the object
                        raise BecomeKeeper(keeper_fd, [ctl, wake_r, wake_w, *fds], park)
                    os.close(keeper_fd)
                    pidfd = os.pidfd_open(pid)  # before any reap: it names this process
                    try:
                        self._reply(sock, (FORKED, pid), pidfd)
                    finally:
                        os.close(pidfd)

    def _reply(self, sock: object, message: tuple, fd: int | None) -> None:
        import socket

        assert isinstance(sock, socket.socket)
        data = self.keeper.frame(message)  # type: ignore[attr-defined]
        try:  # small: the agent reads it while it waits; blocking (nothing else to do)
            sock.setblocking(True)
            sock.sendmsg([data], [] if fd is None else [
                (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        except OSError:
            pass  # the agent is gone: EOF comes next


def _fork_request(message: object) -> int | None:
    """``(FORK,)`` -> 0, ``(FORK, PARK)`` -> PARK; None for anything else."""
    if not isinstance(message, tuple) or not message or message[0] != FORK:
        return None
    if len(message) == 1:
        return 0
    park = message[1]
    return park if len(message) == 2 and type(park) is int and 0 <= park <= MAX_PARK else None


def _drain(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 512):
                return
        except BlockingIOError:
            return


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


# -- what ps shows ----------------------------------------------------------------------------

#: ``/proc/PID/comm`` (what ``top`` and ``pgrep NAME`` read, 15 bytes at most) of the zygote
#: and of what it forks before a worker runs; a worker gets its interpreter's, as exec gives.
COMMS = {"zygote": "elastic-zygote", "keeper": "elastic-keeper",
         "parked worker": "elastic-parked"}
#: The longest job or node id a title shows.
LABEL_MAX = 64


def label(text: str) -> str:
    """An id as a title shows it: printable ASCII only (a terminal renders ``ps``), bounded."""
    return "".join(c if " " <= c <= "~" else "?" for c in text[:LABEL_MAX])


def set_cmdline(argv: Sequence[str], comm: str = "") -> bool:
    """Make this process's ``/proc/PID/cmdline`` (what ``ps``, ``top``, ``htop``, ``pgrep
    -f`` and psutil read) ``argv``, laid out as exec lays it (each argument and its NUL), and
    its ``/proc/PID/comm`` ``comm`` if given. False if the command line could not be set
    (it is left as it was).

    The kernel reads a command line from the process's argv area, the bytes exec copied
    to its stack (``arg_start``..``arg_end`` in /proc/self/stat); this writes there through
    /proc/self/mem (no ctypes in a worker that did not import it) and fills the rest with
    NULs, which ``ps``, ``top``, ``htop`` and ``pgrep`` drop (a NUL split of the file ends
    with empty strings). Nothing reads the area again: Python keeps its own copies
    (``sys.argv``, ``sys.orig_argv``), and glibc's ``program_invocation_name``, which points
    at its start, reads ``argv[0]``. Never past the area: what follows it is the
    environment /proc/PID/environ shows (strays.py reads it); what does not fit is cut at
    the area's end (:func:`command`'s room makes every forked worker's fit; an exec'ed
    worker's bootstrap argv is longer than the command line it shows).

    Not the setproctitle package: it writes one string, the arguments joined by spaces, so
    a NUL split (psutil, nvidia-smi) sees one argument, or splits one that holds a space;
    it writes over the environment; and it sets comm to the title's first 15 bytes."""
    # os-level calls: this runs on every worker's start, on the restart's path.
    try:
        fd = os.open("/proc/self/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            fields = os.read(fd, 4096).rpartition(b")")[2].split()
        finally:
            os.close(fd)
        start, end = int(fields[45]), int(fields[46])  # proc(5)'s fields 48 and 49
        size = end - start
        data = b"\0".join(os.fsencode(a) for a in argv)[:size - 1].ljust(size, b"\0")
        fd = os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
        try:
            # A last byte that is no NUL: someone's title ran past the area (the kernel then
            # reads the command line as one string); not the layout this writes: leave it.
            if size <= 0 or os.pread(fd, 1, end - 1) != b"\0" or os.pwrite(fd, data, start) != size:
                return False
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError, OverflowError):
        return False
    if comm:
        try:
            fd = os.open("/proc/self/comm", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, os.fsencode(comm)[:15])
            finally:
                os.close(fd)
        except OSError:
            pass
    return True


def arm_stacks(env: Mapping[str, str]) -> None:
    """Register faulthandler on the agent's stack signal, writing to the rank's FIFO (see
    supervision/diagnosis/stacks.py), before any user code. Never fails the worker: without the
    variable, or without a FIFO the agent holds open, the worker runs without it."""
    signum, _, path = env.get(STACKS_ENV, "").partition(":")
    if not signum.isdigit() or not path:
        return
    try:  # non-blocking: a FIFO without its reader fails (ENXIO) instead of waiting
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if os.fstat(fd).st_mode & 0o170000 != 0o010000:  # S_ISFIFO, without importing stat
            raise OSError("not a FIFO")
        os.set_blocking(fd, True)  # a dump waits for the reader rather than losing its tail
        import faulthandler

        faulthandler.register(int(signum), file=fd, all_threads=True, chain=False)
    except (OSError, ValueError, RuntimeError):
        os.close(fd)


def arm_recorder(env: Mapping[str, str]) -> None:
    """Start the thread that answers the agent's collective-trace requests (loaded by path,
    as the keeper is: the bootstrap has no package on its path). Never fails the worker."""
    path = env.get(RECORDER_ENV, "")
    if not path:
        return
    try:
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "_elastic_agent_recorder_probe",
            os.path.join(os.path.dirname(os.path.abspath(_HERE)), "recorder_probe.py"))
        if spec is None or spec.loader is None:
            return
        probe = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(probe)
        probe.arm(path)
    except Exception:
        return


def worker_recipe(args: Sequence[str]) -> tuple[str, str, list[str]]:
    """``--worker``'s arguments -> what :func:`_become` runs."""
    if args[0] in ("-m", "-c"):
        return ("module" if args[0] == "-m" else "code", args[1], list(args[2:]))
    return ("file", args[0], list(args[1:]))


def _unwrapped(argv: list[str]) -> list[str]:
    """``sys.orig_argv`` as ``python -u SCRIPT`` would have it: without the bootstrap."""
    if len(argv) > 3 and argv[3] == WORKER_FLAG and os.path.basename(argv[2]) == "zygote.py":
        return [*argv[:2], *argv[4:]]
    return argv


def _become(exc: BecomeWorker) -> None:
    """Run the worker in this (forked) process, as ``python -u`` would."""
    kind, target, args = exc.how
    os.environ.clear()
    os.environ.update(exc.env)
    sys.orig_argv = _unwrapped(exc.orig_argv)
    # What torchrun's worker shows (`python -u SCRIPT ARGS`), not the bootstrap or a title.
    set_cmdline(sys.orig_argv, os.path.basename(sys.orig_argv[0]))
    nprandom = sys.modules.get("numpy.random")
    if nprandom is not None:
        nprandom.seed()
    sys.modules.pop("_elastic_agent_keeper", None)
    if kind == "module":
        import runpy

        sys.argv = ["-m", *args]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(target, alter_argv=True)  # what `python -m` calls
        return
    if kind == "code":  # `python -c CODE ARGS` (torchrun's --run-path bootstrap)
        import types

        sys.argv = ["-c", *args]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        main.__dict__.update(__builtins__=__builtins__)
        sys.modules["__main__"] = main
        exec(compile(target, "<string>", "exec", dont_inherit=True), main.__dict__)
        return
    sys.argv = [target, *args]
    path = os.path.abspath(target)
    sys.path[0] = os.path.dirname(os.path.realpath(target))
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as err:
        print(f"{sys.executable}: can't open file {path!r}: [Errno {err.errno}] "
              f"{err.strerror}", file=sys.stderr)
        raise SystemExit(2) from None
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __package__=None, __spec__=None,
                         __builtins__=__builtins__,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    code = compile(source, path, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _run_worker(exc: BecomeWorker) -> None:
    arm_stacks(exc.env)
    arm_recorder(exc.env)
    try:
        _become(exc)
    except (SystemExit, KeyboardInterrupt):
        raise  # the interpreter's own handling: exit status, death by SIGINT
    except BaseException as err:
        tb = err.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == _HERE:
            tb = tb.tb_next  # the worker's frames only, as the interpreter would show them
        sys.excepthook(type(err), err.with_traceback(tb), tb)
        raise SystemExit(1) from None


def _serve(argv: list[str]) -> int:
    """``zygote.py FD SYS_PATH0 MODULES auto|user JOB NODE [ROOM...]``: preload, then fork
    keepers until EOF on FD."""
    import importlib
    import importlib.util

    fd, path0, modules = int(argv[1]), argv[2], [m for m in argv[3].split(",") if m]
    auto = argv[4:5] == ["auto"]
    job, node = (*argv[5:7], "", "")[:2]
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[0] = path0  # as the worker will have it, not this file's directory
    spec = importlib.util.spec_from_file_location("_elastic_agent_keeper",
                                                  os.path.join(here, "keeper.py"))
    assert spec is not None and spec.loader is not None
    keeper = importlib.util.module_from_spec(spec)
    sys.modules["_elastic_agent_keeper"] = keeper
    spec.loader.exec_module(keeper)
    zygote = Zygote(keeper, auto, job, node)
    zygote.show("zygote")  # before the preload: importing torch takes seconds
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as err:
            if auto:
                continue  # the workers import it again, and their error is theirs to show
            print(f"elastic-agent zygote: --preload {name}: {type(err).__name__}: {err}",
                  file=sys.stderr, flush=True)
    global _ZYGOTE
    _ZYGOTE = zygote
    return zygote.serve(fd)


def _keep(exc: BecomeKeeper) -> int:
    """In a child the zygote forked: be the keeper of one attempt (see :mod:`.keeper`)."""
    assert _ZYGOTE is not None
    keeper = _ZYGOTE.keeper
    keeper.signal.set_wakeup_fd(-1)  # type: ignore[attr-defined]
    for fd in exc.close:
        os.close(fd)
    _ZYGOTE.show("keeper")
    return keeper._Keeper(exc.keeper_fd, zygote=_ZYGOTE,  # type: ignore[attr-defined]
                          park=exc.park).run()


_ZYGOTE: Zygote | None = None


if __name__ == "__main__":
    _child: BecomeWorker | None = None
    _keeper: BecomeKeeper | None = None
    if sys.argv[1:2] == [WORKER_FLAG] and len(sys.argv) > 2:  # the exec path's worker
        _child = BecomeWorker(worker_recipe(sys.argv[2:]), dict(os.environ), sys.orig_argv)
    else:
        try:
            _code = _serve(sys.argv)
        except BecomeKeeper as _keeper_exc:  # a forked keeper: the zygote's loop is gone
            _keeper = _keeper_exc.with_traceback(None)
        if _keeper is not None:
            try:
                _code = _keep(_keeper)
            except BecomeWorker as _become_exc:  # a forked worker: the keeper's stack too
                _child = _become_exc
        if _child is None:
            sys.stderr.flush()
            os._exit(_code)
    # Outside the except clause, so the worker's own exceptions chain to nothing of ours.
    _run_worker(_child)
