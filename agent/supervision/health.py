"""The health check server: liveness for probes and Prometheus metrics, over HTTP.

torch 2.13 reads ``TORCHELASTIC_HEALTH_CHECK_PORT`` in ``LocalElasticAgent._setup_healthcheck``
and calls ``create_healthcheck_server(alive_callback, port, timeout=60)``: the agent counts as
alive while ``now - alive_callback() < timeout``, where the callback is the last progress time
of its watchdog loop (else "now"). The open-source server is a no-op (it logs "No health check
server started"); torch defines no path and no wire format. Here, with
``TORCHELASTIC_HEALTH_CHECK_PORT`` or ``--health-check-port`` (the flag wins), the agent
serves HTTP/1.1 on that port of ``--health-check-host`` (default :data:`DEFAULT_HOST`,
loopback: an exec probe or a sidecar on the host; a Kubernetes ``httpGet`` probe comes to the
pod's IP and needs ``--health-check-host 0.0.0.0`` or ``::``):

* ``GET /healthz`` (also ``/`` and ``/livez``): 200 and ``{"status": "ok", ...}`` while the
  agent's event loop beat within :data:`LIVENESS_BOUND_S`; 503 and ``{"status": "stalled",
  ...}`` once it has not. The loop runs the monitor (worker exits, membership, commands), the
  publisher and the watchdog: when it stops advancing, nothing of the agent does. A beat comes
  every :data:`BEAT_INTERVAL_S`; the bound leaves room for a loaded host and stays far under
  torch's 60 s. ``HEAD`` answers the same without a body.
* ``GET /metrics``: Prometheus text (prometheus-client) from a snapshot the loop takes at each
  beat: workers by state, restarts used and allowed, rendezvous round, log lines shipped and
  dropped, publisher backlog, Redis connected, watchdog expiries, the liveness itself, and
  each local worker's training read from its output (``elastic_worker_step``,
  ``elastic_worker_steps_per_second``, ``elastic_worker_metric{name=...}``; docs/METRICS.md).

The server runs on a thread of its own, so it still answers (503) while the agent's loop is
stuck. Requests are hostile input, and liveness must answer whatever other clients do (a
failed probe restarts the pod, which ends the job): see :class:`HealthServer` for how a flood
of half requests only recycles its own connections. The head is bounded
(:data:`MAX_HEAD_BYTES`, sent within :data:`READ_TIMEOUT_S`), only GET and HEAD are served,
and every answer closes its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import json
import logging
import math
import os
import re
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .launch.exits import WorkerStartError

log = logging.getLogger(__name__)

PORT_ENV = "TORCHELASTIC_HEALTH_CHECK_PORT"
#: The agent is live while its loop beat within this many seconds.
LIVENESS_BOUND_S = 30.0
#: How often the loop beats (and refreshes the metrics' snapshot).
BEAT_INTERVAL_S = 1.0
#: Where the server listens unless --health-check-host says otherwise: this host only.
DEFAULT_HOST = "127.0.0.1"
MAX_HEAD_BYTES = 8192
#: Seconds a connection may take to send its request head and read the answer: a probe sends
#: its head at once, and a Kubernetes probe gives up after 1 s anyway (timeoutSeconds).
READ_TIMEOUT_S = 1.0
#: Connections waiting for their head, in all and per peer (an IPv4 address, an IPv6 /64).
MAX_CONNECTIONS = 128
MAX_PER_PEER = 32
#: A connection younger than this is never ended for its peer's limit, only when the table
#: is full (MAX_CONNECTIONS). A probe sends its head right after connecting, but on a loaded
#: host the prober, or this thread, may take a while to get it across: until then it is a
#: silent connection like any of a flood's. Ended for the peer's limit, oldest silent first,
#: a flood from the probe's own address of newer silent connections ended it (1 or 2 probes
#: in 30, with 64 clients holding half a request); protected while young, it is answered.
GRACE_S = 0.5
#: Connections accepted per turn of the loop, and the kernel's queue of those not yet accepted.
ACCEPT_BATCH = 64
BACKLOG = 1024
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
    #: Each local worker's training state read from its output (diagnosis/metrics.py), by
    #: local rank: (global rank, step, steps a second, {metric: latest value}); names are
    #: already restricted (``[A-Za-z0-9_./-]``) and at most 32 a rank: bounded labels.
    training: Mapping[int, tuple[int, int | None, float | None, Mapping[str, float]]] = field(
        default_factory=dict)


def _training(agent: Any) -> dict[int, tuple[int, int | None, float | None, dict[str, float]]]:
    """The local ranks' latest step, rate and metrics (O(local ranks x 32))."""
    tracker = getattr(agent, "metrics", None)
    if tracker is None:
        return {}
    local = {w.global_rank: w.local_rank for w in agent.group.workers}
    out = {}
    for rank, r in tracker.ranks.items():
        if rank in local:
            snap = r.snapshot()
            rate = snap.get("rate")
            out[local[rank]] = (rank, r.step, rate if isinstance(rate, float) else None,
                                dict(r.values))
    return out


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
        watchdog=vars(wd.stats).copy() if wd.enabled else None, training=_training(agent))


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
        if s.training:
            labels = ["local_rank", "rank"]
            step = GaugeMetricFamily("elastic_worker_step", "The latest training step the "
                                     "worker printed (docs/METRICS.md).", labels=labels)
            rate = GaugeMetricFamily("elastic_worker_steps_per_second",
                                     "The worker's training steps a second.", labels=labels)
            metric = GaugeMetricFamily("elastic_worker_metric", "The latest value of each "
                                       "metric the worker printed (loss, lr, ...).",
                                       labels=[*labels, "name"])
            for local_rank, (rank, at, per_s, values) in sorted(s.training.items()):
                ids = [str(local_rank), str(rank)]
                if at is not None:
                    step.add_metric(ids, at)
                if per_s is not None:
                    rate.add_metric(ids, per_s)
                for name, value in sorted(values.items()):
                    metric.add_metric([*ids, name], value)
            yield step
            yield rate
            yield metric

    class _Collector:
        def collect(self) -> Iterator[Any]:
            return families()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())  # type: ignore[arg-type]
    return generate_latest(registry)


class _Conn:
    """One accepted connection: what it sent so far, then its answer."""

    __slots__ = ("born", "deadline", "inbox", "outbox", "peer", "sock")
    # outbox: None while reading the request, then what is left of the answer; b"" once it
    # is sent and the connection drains until the client closes.

    def __init__(self, sock: socket.socket, peer: str, born: float, deadline: float) -> None:
        self.sock, self.peer, self.born, self.deadline = sock, peer, born, deadline
        self.inbox = b""
        self.outbox: bytes | None = None  # None: still reading the request


class HealthServer:
    """HTTP on ``host``:``port`` (port 0: any free one) answered from ``heartbeat`` (see the
    module docstring). ``start`` binds, in the caller's thread, so a busy port fails there
    (HealthCheckError); then serves on a thread of its own until ``stop``.

    One selector loop, no task per connection. A request whose head is there when the
    connection is accepted (a probe sends it at once) is answered then. Connections wait in
    a table (for the rest of their head, or for the client to close after the answer): at
    most ``per_peer`` per peer and ``max_open`` in all, each for ``read_timeout`` seconds. A
    new connection over a limit ends one of its own peer's (over ``max_open``: of the peer
    holding most; see :func:`_victim`), never itself, so a flood of half requests only
    recycles its own connections, whoever it comes from. Connections younger than ``grace``
    seconds are not ended for their peer's limit (a probe may not have got its head across
    yet), only for ``max_open``.
    """

    def __init__(self, heartbeat: Heartbeat, port: int, host: str = DEFAULT_HOST, *,
                 per_peer: int = MAX_PER_PEER, max_open: int = MAX_CONNECTIONS,
                 read_timeout: float = READ_TIMEOUT_S, grace: float = GRACE_S) -> None:
        self.heartbeat = heartbeat
        self._want = port
        self._host = host
        self._per_peer, self._max_open, self._timeout = per_peer, max_open, read_timeout
        self._grace = grace
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._open: dict[socket.socket, _Conn] = {}  # oldest first
        self._by_peer: dict[str, list[_Conn]] = {}
        self.port = 0

    def start(self) -> int:
        """Bind and serve; returns the port. Raises HealthCheckError if it cannot bind."""
        try:
            if len(self._host) > 255:
                raise ValueError("not a host name or address (too long)")
            sock = _listen(self._host, self._want)
        except (OSError, OverflowError, ValueError) as exc:  # Overflow: a port over 65535
            raise HealthCheckError(
                f"cannot serve the health check on {_shown(self._host[:80])}:{self._want}: "
                f"{getattr(exc, 'strerror', None) or exc}") from None
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._wake = socket.socketpair()
        for end in self._wake:
            end.setblocking(False)
        self._thread = threading.Thread(target=self._serve, name="health-check", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        """Stop serving and close the port. Idempotent."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stopping.set()
            assert self._wake is not None
            with contextlib.suppress(OSError):
                self._wake[1].send(b"x")
            thread.join(5)
        for conn in list(self._open.values()):
            self._drop(conn)
        for sock in (self._sock, *(self._wake or ())):
            if sock is not None:
                sock.close()
        self._sock = self._wake = None

    def _serve(self) -> None:
        assert self._sock is not None and self._wake is not None
        sel = selectors.DefaultSelector()
        try:
            sel.register(self._sock, selectors.EVENT_READ)
            sel.register(self._wake[0], selectors.EVENT_READ)
            while not self._stopping.is_set():
                oldest = next(iter(self._open.values()), None)
                wait = 1.0 if oldest is None else oldest.deadline - time.monotonic()
                for key, _ in sel.select(max(0.0, min(wait, 1.0))):
                    conn = self._open.get(key.fileobj)  # type: ignore[call-overload]
                    try:
                        if key.fileobj is self._sock:
                            self._accept(sel)
                        elif key.fileobj is self._wake[0]:
                            with contextlib.suppress(OSError):
                                self._wake[0].recv(64)
                        elif conn is not None:
                            self._pump(conn, sel)
                    except Exception:  # a bug must cost one connection, never the probe
                        log.exception("health: a request failed")
                        if conn is not None:
                            self._drop(conn, sel)
                self._expire(sel)
        except Exception:
            log.exception("health: the server stopped")
        finally:
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        # A bounded batch, so connections already open get their turn in a flood.
        assert self._sock is not None
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and self._by_peer:
                    # Out of descriptors: free one, or the listener stays ready and spins.
                    self._drop(_victim(max(self._by_peer.values(), key=len),
                                       time.monotonic() - self._grace), sel)
                return
            sock.setblocking(False)
            now = time.monotonic()
            conn = _Conn(sock, _peer_key(addr[0]), now, now + self._timeout)
            self._open[sock] = conn
            self._by_peer.setdefault(conn.peer, []).append(conn)
            sel.register(sock, selectors.EVENT_READ)
            if not self._pump(conn, sel):  # a probe's head is usually there: answered at once
                continue
            mine = self._by_peer[conn.peer]
            young_after = now - self._grace
            if len(mine) > self._per_peer:
                victim = _victim(mine, young_after)
                if not _young(victim, young_after):  # all young: only max_open ends them
                    self._evict(victim, sel)
            if len(self._open) > self._max_open:
                self._evict(_victim(max(self._by_peer.values(), key=len), young_after), sel)

    def _evict(self, conn: _Conn, sel: selectors.BaseSelector) -> None:
        """End ``conn`` to make room, unless what it sent meanwhile can be answered."""
        if conn.outbox is None and not self._pump(conn, sel):
            return
        self._drop(conn, sel)

    def _pump(self, conn: _Conn, sel: selectors.BaseSelector) -> bool:
        """Read, answer or drain what the socket takes now; False once the connection is done.

        After the answer the connection is half-closed and drained until the client closes
        (a lingering close): closing with unread input would reset it, and a reset can destroy
        the answer before the client reads it."""
        try:
            if conn.outbox is None:
                while True:
                    chunk = conn.sock.recv(MAX_HEAD_BYTES + 1 - len(conn.inbox))
                    conn.inbox += chunk
                    request = _parse_head(conn.inbox, eof=not chunk)
                    if request is not _INCOMPLETE:
                        conn.inbox = b""
                        conn.outbox = self._response(request)
                        sel.modify(conn.sock, selectors.EVENT_WRITE)
                        break
            if conn.outbox:
                conn.outbox = conn.outbox[conn.sock.send(conn.outbox):]
                if conn.outbox:
                    return True
                conn.sock.shutdown(socket.SHUT_WR)
                sel.modify(conn.sock, selectors.EVENT_READ)
            for _ in range(4):  # bounded: a client that keeps sending waits for its deadline
                if not conn.sock.recv(65536):
                    break
            else:
                return True
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            pass
        self._drop(conn, sel)
        return False

    def _expire(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        while self._open:  # oldest first: stop at the first still in time
            conn = next(iter(self._open.values()))
            if conn.deadline > now:
                break
            if conn.outbox is None:  # too slow to ask: say so if the socket takes it
                with contextlib.suppress(OSError):
                    conn.sock.send(self._response(_TIMED_OUT))
            self._drop(conn, sel)

    def _drop(self, conn: _Conn, sel: selectors.BaseSelector | None = None) -> None:
        if self._open.pop(conn.sock, None) is None:
            return
        mine = self._by_peer[conn.peer]
        mine.remove(conn)
        if not mine:
            del self._by_peer[conn.peer]
        if sel is not None:
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(conn.sock)
        conn.sock.close()

    def _response(self, request: tuple[str, str] | None) -> bytes:
        status, ctype, body, head_only = self._answer(request)
        head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\n"
                + ("Allow: GET, HEAD\r\n" if status == 405 else "")
                + "Connection: close\r\n\r\n").encode()
        return head if head_only else head + body

    def _answer(self, request: tuple[str, str] | None) -> tuple[int, str, bytes, bool]:
        """(status, content type, body, HEAD) for a request line, None if unreadable."""
        text = "text/plain; charset=utf-8"
        if request is _TIMED_OUT:
            return 408, text, b"request head not received in time\n", False
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
            try:
                return 200, _METRICS_TYPE, metrics_text(healthy, age, snap), head_only
            except Exception:
                log.exception("health: the metrics failed")
                return 500, text, b"metrics failed: see the agent's log\n", head_only
        return 404, text, b"not found: try /healthz or /metrics\n", head_only


def _victim(conns: list[_Conn], young_after: float = -math.inf) -> _Conn:
    """Which of a peer's connections (oldest first) to end for a new one: one already
    answered, else one that sent part of a head (slow by proof: a client sends its head at
    once), else the oldest silent one (a probe may be a moment away from its request); of
    the unanswered, those accepted after ``young_after`` (see :data:`GRACE_S`) last."""
    def rank(c: _Conn) -> int:
        if c.outbox is not None:
            return 0
        return (3 if c.born > young_after else 1) + (0 if c.inbox else 1)

    return min(conns, key=rank)


def _young(conn: _Conn, young_after: float) -> bool:
    """Unanswered and accepted after ``young_after``: not ended for its peer's limit."""
    return conn.outbox is None and conn.born > young_after


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 500: "Internal Server Error", 503: "Service Unavailable"}
_INCOMPLETE: Any = object()  # the head is not all there yet
_TIMED_OUT: Any = ("", "")  # a request that took longer than the read timeout
_HEAD_END = re.compile(rb"\r?\n\r?\n")


def _parse_head(data: bytes, eof: bool) -> Any:
    """The method and path of a request head (headers ignored), None if it is not one,
    _INCOMPLETE while more may come."""
    end = _HEAD_END.search(data)
    if end is None or end.start() > MAX_HEAD_BYTES:
        return None if eof or len(data) > MAX_HEAD_BYTES else _INCOMPLETE
    first = data[:end.start()].split(b"\n", 1)[0]
    parts = first.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return None
    return parts[0], parts[1].split("?", 1)[0]


def _peer_key(address: str) -> str:
    """Whose connection this is, for the per-peer limit: the IPv4 address, or the /64 of an
    IPv6 one (one host or one tenant is routinely given a whole /64)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host`` (an address or a name; ``::`` is every interface of
    both families where the system allows it)."""
    family, _, _, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    both = (family == socket.AF_INET6 and ipaddress.ip_address(address[0]).is_unspecified
            and socket.has_dualstack_ipv6())
    return socket.create_server(address[:2], family=family, backlog=BACKLOG,
                                dualstack_ipv6=both)


def _shown(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class HealthCheck:
    """The agent's side: the port (or none), the beat on the agent's loop, the server.

    ``start`` on the agent's loop; ``stop`` at the end. Without a port both do nothing.
    """

    def __init__(self, port: int | None, snapshot: Callable[[], Snapshot],
                 say: Callable[[str], None], *, host: str = DEFAULT_HOST,
                 bound_s: float = LIVENESS_BOUND_S, interval: float = BEAT_INTERVAL_S) -> None:
        self.port = port
        self.host = host
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
        return cls(port, lambda: snapshot_of(agent), agent.say,
                   host=getattr(agent.cfg, "health_check_host", DEFAULT_HOST))

    def start(self) -> None:
        if self.port is None or self._server is not None:
            return
        with contextlib.suppress(Exception):  # the beat task logs a broken snapshot
            self.heartbeat.beat(self._snapshot())
        self._server = HealthServer(self.heartbeat, self.port, self.host)
        port = self._server.start()
        self._task = asyncio.get_running_loop().create_task(
            beat_forever(self.heartbeat, self._snapshot, self._interval), name="health-beat")
        self._say(f"health check on {_shown(self.host)}:{port}: GET /healthz (liveness), "
                  "/metrics (Prometheus)")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._server is not None:
            self._server.stop()
            self._server = None
