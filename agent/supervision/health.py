"""The health check server: liveness for probes and Prometheus metrics, over HTTP.

torch 2.13 reads ``TORCHELASTIC_HEALTH_CHECK_PORT`` in ``LocalElasticAgent._setup_healthcheck``
and calls ``create_healthcheck_server(alive_callback, port, timeout=60)``: the agent counts as
alive while ``now - alive_callback() < timeout``, where the callback is the last progress time
of its watchdog loop (else "now"). The open-source server is a no-op (it logs "No health check
server started"); torch defines no path and no wire format. Here, with
``TORCHELASTIC_HEALTH_CHECK_PORT`` or ``--health-check-port`` (the flag wins), the agent
serves HTTP/1.1 on that port on every interface (a Kubernetes probe comes to the pod's IP):

* ``GET /healthz`` (also ``/`` and ``/livez``): 200 and ``{"status": "ok", ...}`` while the
  agent's event loop beat within :data:`LIVENESS_BOUND_S`; 503 and ``{"status": "stalled",
  ...}`` once it has not. The loop runs the monitor (worker exits, membership, commands), the
  publisher and the watchdog: when it stops advancing, nothing of the agent does. A beat comes
  every :data:`BEAT_INTERVAL_S`; the bound leaves room for a loaded host and stays far under
  torch's 60 s. ``HEAD`` answers the same without a body.
* ``GET /metrics``: Prometheus text (prometheus-client) from a snapshot the loop takes at each
  beat: workers by state, restarts used and allowed, rendezvous round, log lines shipped and
  dropped, publisher backlog, Redis connected, watchdog expiries, and the liveness itself.

The server runs on a thread of its own with its own event loop, so it still answers (503)
while the agent's loop is stuck. Requests are hostile input: the head is bounded
(:data:`MAX_HEAD_BYTES`, read within :data:`READ_TIMEOUT_S`), connections are capped
(:data:`MAX_CONNECTIONS`), only GET and HEAD are served, and every answer closes its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .workers import WorkerStartError

log = logging.getLogger(__name__)

PORT_ENV = "TORCHELASTIC_HEALTH_CHECK_PORT"
#: The agent is live while its loop beat within this many seconds.
LIVENESS_BOUND_S = 30.0
#: How often the loop beats (and refreshes the metrics' snapshot).
BEAT_INTERVAL_S = 1.0
MAX_HEAD_BYTES = 8192
READ_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 32
LIVENESS_PATHS = frozenset({"/", "/healthz", "/livez"})
METRICS_PATH = "/metrics"
# What prometheus-client's generate_latest writes (newer clients name 1.0.0 as "latest", which
# older Prometheus servers refuse).
_METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
WORKER_STATES = ("running", "succeeded", "failed", "stopped")


class HealthCheckError(WorkerStartError):
    """The health check port cannot be served: the agent starts no workers (a probe would
    fail them soon anyway)."""


def resolve_port(flag: int | None, environ: Mapping[str, str] | None = None
                 ) -> tuple[int | None, str]:
    """The port to serve (None: no server) and a warning for the terminal ("" if none).

    ``--health-check-port`` wins over ``TORCHELASTIC_HEALTH_CHECK_PORT``. An unusable value
    of the variable starts no server, as in torch ("expecting integer"), but says so.
    """
    if flag is not None:
        return flag, ""
    raw = (os.environ if environ is None else environ).get(PORT_ENV)
    if raw is None or raw == "":
        return None, ""
    value = raw.strip()
    if not value.isdigit() or int(value) > 65535:
        return None, (f"{PORT_ENV}={raw[:40]!r} is not a port number (0-65535): no health "
                      "check server")
    return int(value), ""


@dataclass(frozen=True)
class Snapshot:
    """What the metrics show, taken on the agent's loop (the server thread only reads it)."""

    job_id: str = ""
    node: str = ""
    host: str = ""
    workers: Mapping[str, int] = field(default_factory=dict)
    restarts_used: int = 0
    max_restarts: int = 0
    round: int | None = None
    log_lines_shipped: int = 0
    log_lines_dropped: int = 0
    publisher_backlog: int = 0
    publisher_backlog_bytes: int = 0
    redis_connected: bool = False
    watchdog: Mapping[str, int] | None = None  # None: the watchdog is off


def snapshot_of(agent: Any) -> Snapshot:
    """A :class:`Snapshot` of an ``ElasticAgent`` (read on its loop)."""
    group = agent.group
    exits = {e.pid: e for e in group.exits}
    states = dict.fromkeys(WORKER_STATES, 0)
    for w in group.workers:
        e = exits.get(w.pid) if w.pid else None
        if w.pid and e is None:
            states["running"] += 1
        elif e is not None and e.exit_code == 0:
            states["succeeded"] += 1
        elif e is not None and e.stopping:
            states["stopped"] += 1
        else:
            states["failed"] += 1
    pub = agent.publisher.stats()
    rnd = agent._round.result.round if agent._round is not None else None
    wd = agent.watchdog
    return Snapshot(
        job_id=agent.cfg.job_id, node=agent.node_id, host=agent.host, workers=states,
        restarts_used=agent._restarts_used, max_restarts=agent.cfg.max_restarts, round=rnd,
        log_lines_shipped=agent.publisher.sent_weight, log_lines_dropped=pub.dropped_weight,
        publisher_backlog=pub.buffered, publisher_backlog_bytes=pub.buffered_bytes,
        redis_connected=pub.connected,
        watchdog=vars(wd.stats).copy() if wd.enabled else None)


class Heartbeat:
    """The agent loop's beats, read by the server thread: when it last beat, what it saw.

    One tuple is swapped in per beat, so a reader never sees a time of one beat with the
    snapshot of another.
    """

    def __init__(self, bound_s: float = LIVENESS_BOUND_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bound_s = bound_s
        self._clock = clock
        self._state: tuple[float, Snapshot] = (clock(), Snapshot())

    def beat(self, snapshot: Snapshot | None = None) -> None:
        self._state = (self._clock(), snapshot if snapshot is not None else self._state[1])

    def status(self) -> tuple[bool, float, Snapshot]:
        """(healthy, seconds since the last beat, the last snapshot)."""
        at, snap = self._state
        age = max(0.0, self._clock() - at)
        return age <= self.bound_s, age, snap


async def beat_forever(heartbeat: Heartbeat, snapshot: Callable[[], Snapshot],
                       interval: float = BEAT_INTERVAL_S) -> None:
    """Beat on the running loop every ``interval`` until cancelled. Periodic by nature: a beat
    is the proof that the loop still takes turns; a broken snapshot still beats."""
    while True:
        try:
            snap = snapshot()
        except Exception:
            log.exception("health: the metrics snapshot failed")
            snap = None
        heartbeat.beat(snap)
        await asyncio.sleep(interval)


def metrics_text(healthy: bool, age: float, s: Snapshot) -> bytes:
    """Prometheus text for a snapshot (prometheus-client imported here: only when served)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def families() -> Iterator[Any]:
        info = GaugeMetricFamily("elastic_agent_info", "This agent: job, node and host.",
                                 labels=["job_id", "node", "host"])
        info.add_metric([s.job_id, s.node, s.host], 1)
        yield info
        yield GaugeMetricFamily("elastic_agent_healthy", "1 while the agent's event loop "
                                f"beat within {LIVENESS_BOUND_S:g} s (the liveness answer).",
                                value=int(healthy))
        yield GaugeMetricFamily("elastic_agent_heartbeat_age_seconds",
                                "Seconds since the agent's event loop last beat.", value=age)
        workers = GaugeMetricFamily("elastic_agent_workers",
                                    "Workers of the current attempt on this node, by state.",
                                    labels=["state"])
        for state in WORKER_STATES:
            workers.add_metric([state], s.workers.get(state, 0))
        yield workers
        yield GaugeMetricFamily("elastic_agent_restarts_used",
                                "Job-wide restarts spent on failures.", value=s.restarts_used)
        yield GaugeMetricFamily("elastic_agent_max_restarts", "--max-restarts.",
                                value=s.max_restarts)
        if s.round is not None:
            yield GaugeMetricFamily("elastic_agent_rendezvous_round",
                                    "The rendezvous round the workers run in.", value=s.round)
        yield CounterMetricFamily("elastic_agent_log_lines_shipped",
                                  "Worker log lines acknowledged by Redis.",
                                  value=s.log_lines_shipped)
        yield CounterMetricFamily("elastic_agent_log_lines_dropped",
                                  "Worker log lines dropped by a full outage buffer.",
                                  value=s.log_lines_dropped)
        yield GaugeMetricFamily("elastic_agent_publisher_backlog_records",
                                "Records waiting to be written to Redis.",
                                value=s.publisher_backlog)
        yield GaugeMetricFamily("elastic_agent_publisher_backlog_bytes",
                                "Bytes of the records waiting to be written to Redis.",
                                value=s.publisher_backlog_bytes)
        yield GaugeMetricFamily("elastic_agent_redis_connected",
                                "1 if the last write to Redis succeeded.",
                                value=int(s.redis_connected))
        if s.watchdog is not None:
            timers = CounterMetricFamily("elastic_agent_watchdog_requests",
                                         "File-timer requests, by outcome.", labels=["outcome"])
            for outcome in ("acquired", "released", "rejected"):
                timers.add_metric([outcome], s.watchdog.get(outcome, 0))
            yield timers
            yield CounterMetricFamily("elastic_agent_watchdog_expired",
                                      "Worker timers that expired.",
                                      value=s.watchdog.get("expired", 0))
            yield CounterMetricFamily("elastic_agent_watchdog_kills",
                                      "Processes the watchdog killed.",
                                      value=s.watchdog.get("killed", 0))

    class _Collector:
        def collect(self) -> Iterator[Any]:
            return families()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())  # type: ignore[arg-type]
    return generate_latest(registry)


class HealthServer:
    """HTTP on ``port`` (0: any free one) answered from ``heartbeat`` (see the module
    docstring). ``start`` binds, in the caller's thread, so a busy port fails there
    (HealthCheckError); then serves on a thread of its own until ``stop``."""

    def __init__(self, heartbeat: Heartbeat, port: int, host: str | None = None) -> None:
        self.heartbeat = heartbeat
        self._want = port
        self._host = host
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._active = 0
        self.port = 0

    def start(self) -> int:
        """Bind and serve; returns the port. Raises HealthCheckError if it cannot bind."""
        try:
            if self._host is None and socket.has_dualstack_ipv6():
                sock = socket.create_server(("", self._want), family=socket.AF_INET6,
                                            dualstack_ipv6=True)
            else:
                sock = socket.create_server((self._host or "", self._want))
        except (OSError, OverflowError) as exc:  # OverflowError: a port beyond 65535
            raise HealthCheckError(f"cannot serve the health check on port {self._want}: "
                                   f"{getattr(exc, 'strerror', None) or exc}") from None
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,),
                                        name="health-check", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self.port

    def stop(self) -> None:
        """Stop serving and close the port. Idempotent."""
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is not None and thread is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                loop.call_soon_threadsafe(loop.stop)
            thread.join(5)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _serve(self, ready: threading.Event) -> None:
        loop = self._loop
        assert loop is not None and self._sock is not None
        asyncio.set_event_loop(loop)
        try:
            server = loop.run_until_complete(asyncio.start_server(
                self._handle, sock=self._sock, limit=MAX_HEAD_BYTES))
            ready.set()
            loop.run_forever()
            server.close()
            # Connections still open end with the loop; their handlers are cancelled here.
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0))
        except Exception:
            log.exception("health: the server stopped")
        finally:
            ready.set()
            loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._active >= MAX_CONNECTIONS:
            writer.close()
            return
        self._active += 1
        try:
            try:
                request = await asyncio.wait_for(_read_head(reader), READ_TIMEOUT_S)
            except (asyncio.TimeoutError, ValueError, ConnectionError,
                    asyncio.IncompleteReadError):
                request = None
            status, ctype, body, head_only = self._answer(request)
            reason = {200: "OK", 400: "Bad Request", 404: "Not Found",
                      405: "Method Not Allowed", 503: "Service Unavailable"}[status]
            head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                    f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\n"
                    + ("Allow: GET, HEAD\r\n" if status == 405 else "")
                    + "Connection: close\r\n\r\n").encode()
            writer.write(head if head_only else head + body)
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)
        except Exception:
            log.exception("health: a request failed")
        finally:
            self._active -= 1
            writer.close()

    def _answer(self, request: tuple[str, str] | None) -> tuple[int, str, bytes, bool]:
        """(status, content type, body, HEAD) for a request line, None if unreadable."""
        text = "text/plain; charset=utf-8"
        if request is None:
            return 400, text, b"bad request\n", False
        method, path = request
        head_only = method == "HEAD"
        if method not in ("GET", "HEAD"):
            return 405, text, b"only GET and HEAD\n", False
        healthy, age, snap = self.heartbeat.status()
        if path in LIVENESS_PATHS:
            body = json.dumps({"status": "ok" if healthy else "stalled",
                               "last_beat_s": round(age, 3),
                               "bound_s": self.heartbeat.bound_s}).encode() + b"\n"
            return (200 if healthy else 503), "application/json", body, head_only
        if path == METRICS_PATH:
            return 200, _METRICS_TYPE, metrics_text(healthy, age, snap), head_only
        return 404, text, b"not found: try /healthz or /metrics\n", head_only


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, str] | None:
    """The method and path of a request; its headers are read (bounded) and ignored."""
    first = await reader.readline()
    total = len(first)
    while True:
        line = await reader.readline()
        total += len(line)
        if total > MAX_HEAD_BYTES:
            raise ValueError("request head too large")
        if line in (b"\r\n", b"\n", b""):
            break
    parts = first.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return None
    return parts[0], parts[1].split("?", 1)[0]


class HealthCheck:
    """The agent's side: the port (or none), the beat on the agent's loop, the server.

    ``start`` on the agent's loop; ``stop`` at the end. Without a port both do nothing.
    """

    def __init__(self, port: int | None, snapshot: Callable[[], Snapshot],
                 say: Callable[[str], None], *, bound_s: float = LIVENESS_BOUND_S,
                 interval: float = BEAT_INTERVAL_S) -> None:
        self.port = port
        self._snapshot = snapshot
        self._say = say
        self._interval = interval
        self.heartbeat = Heartbeat(bound_s)
        self._server: HealthServer | None = None
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def for_agent(cls, agent: Any) -> HealthCheck:
        port, warning = resolve_port(getattr(agent.cfg, "health_check_port", None))
        if warning:
            agent.say(warning)
        return cls(port, lambda: snapshot_of(agent), agent.say)

    def start(self) -> None:
        if self.port is None or self._server is not None:
            return
        with contextlib.suppress(Exception):  # the beat task logs a broken snapshot
            self.heartbeat.beat(self._snapshot())
        self._server = HealthServer(self.heartbeat, self.port)
        port = self._server.start()
        self._task = asyncio.get_running_loop().create_task(
            beat_forever(self.heartbeat, self._snapshot, self._interval), name="health-beat")
        self._say(f"health check on port {port}: GET /healthz (liveness), /metrics (Prometheus)")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._server is not None:
            self._server.stop()
            self._server = None
