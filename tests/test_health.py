"""The health check server: liveness that turns 503 when the loop stalls, and /metrics.

The stall is real: an event loop blocked by a synchronous call, as a bug in the agent would
block its own; the server answers from its own thread meanwhile. Then a real agent: 200 and
metrics whose values are checked against Redis.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import http.client
import json
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.supervision.health import (
    MAX_CONNECTIONS,
    MAX_HEAD_BYTES,
    MAX_PER_PEER,
    PORT_ENV,
    READ_TIMEOUT_S,
    HealthCheckError,
    HealthServer,
    Heartbeat,
    Snapshot,
    _peer_key,
    beat_forever,
    resolve_port,
)
from tests.agents import Agent, wait_until
from tests.test_agent import agent_args, log_lines, of_type

RDZV = "--rdzv-conf=heartbeat_timeout=30,keep_alive_interval=0.5,join_timeout=60"


def get(port: int, path: str, method: str = "GET", host: str = "127.0.0.1",
        timeout: float = 10) -> tuple[int, str, str]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read().decode()
    finally:
        conn.close()


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


class LoopThread:
    """An event loop on a thread of its own, beating into ``heartbeat`` as the agent's does."""

    def __init__(self, heartbeat: Heartbeat) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        snap = Snapshot(job_id="j", workers={"running": 3})
        self.task = asyncio.run_coroutine_threadsafe(
            beat_forever(heartbeat, lambda: snap, interval=0.05), self.loop)

    def stall(self, seconds: float) -> threading.Event:
        """Block the loop for real (a synchronous call on it); set when it is blocked."""
        blocked = threading.Event()

        def block() -> None:
            blocked.set()
            time.sleep(seconds)  # the stall under test: nothing else runs on this loop

        self.loop.call_soon_threadsafe(block)
        return blocked

    def close(self) -> None:
        self.task.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def served():
    heartbeat = Heartbeat(bound_s=0.5)
    beats = LoopThread(heartbeat)
    server = HealthServer(heartbeat, 0, host="127.0.0.1")
    port = server.start()
    yield port, beats
    server.stop()
    beats.close()


def test_liveness_turns_503_while_the_loop_is_stalled_and_back_after(served):
    port, beats = served
    status, ctype, body = get(port, "/healthz")
    assert (status, ctype, json.loads(body)["status"]) == (200, "application/json", "ok")
    beats.stall(3.0).wait(5)
    # Within the bound it may still be fine; past it the answer must turn.
    status, _, body = wait_until(lambda: (r := get(port, "/healthz"))[0] == 503 and r, 2.5,
                                 "a 503 while the loop is blocked")
    doc = json.loads(body)
    # (last_beat_s is rounded to the millisecond: just past the bound may read as the bound)
    assert doc["status"] == "stalled" and doc["last_beat_s"] >= doc["bound_s"], doc
    assert metric(get(port, "/metrics")[2], "elastic_agent_healthy") == 0
    # The loop takes turns again: so does the answer.
    wait_until(lambda: get(port, "/healthz")[0] == 200, 10, "200 after the stall")
    assert get(port, "/")[0] == 200 and get(port, "/livez")[0] == 200


def test_the_server_survives_hostile_requests(served):
    port, _ = served
    assert get(port, "/nope")[0] == 404
    assert get(port, "/healthz", method="POST")[0] == 405
    status, _, body = get(port, "/healthz", method="HEAD")
    assert (status, body) == (200, "")
    long_line = b"GET /healthz HTTP/1.1\r\nX: " + b"a" * (MAX_HEAD_BYTES * 2)
    many_lines = b"GET /healthz HTTP/1.1\r\n" + (b"X: " + b"a" * 200 + b"\r\n") * 100
    for raw in (b"GARBAGE\r\n\r\n", long_line, many_lines, b"\x00\xff\r\n\r\n", b""):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
            reply = s.recv(200)
        assert reply.startswith(b"HTTP/1.1 400"), (raw[:30], reply)
    text = get(port, "/metrics")[2]
    assert metric(text, 'elastic_agent_workers{state="running"}') == 3
    assert get(port, "/healthz")[0] == 200


def test_port_from_torchs_variable_or_the_flag():
    assert resolve_port(None, {}) == (None, "")
    assert resolve_port(None, {PORT_ENV: "8080"}) == (8080, "")
    assert resolve_port(9090, {PORT_ENV: "8080"}) == (9090, "")  # the flag wins
    port, warning = resolve_port(None, {PORT_ENV: "eighty"})
    assert port is None and "not a port number" in warning  # torch: "expecting integer"
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        with pytest.raises(HealthCheckError, match="cannot serve"):
            HealthServer(Heartbeat(), busy.getsockname()[1]).start()


# A job that fails once (rank 0, first attempt) and then waits with both ranks running, so
# the metrics have a restart, a second round and a known number of lines to show.
WORKER = """\
import os, sys, time
from pathlib import Path

rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for i in range(20):
    print(f"rank {rank} attempt {attempt} line {i}", flush=True)
if attempt == 0 and rank == 0:
    sys.exit(3)
go = Path(os.environ["HC_GO"])
while not go.exists():
    time.sleep(0.02)
"""


def test_a_real_agent_serves_liveness_and_true_metrics(redis_url, r: redis.Redis, job_id,
                                                        tmp_path: Path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    go = tmp_path / "go"
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "2", "--max-restarts", "1",
                             "--health-check-port", "0", "--health-check-host", "0.0.0.0",
                             RDZV, str(script)),
                  tmp_path, "agent", env={"HC_GO": str(go)})
    try:
        port = served_port(agent)
        assert get(port, "/healthz")[0] == 200
        assert get(port, "/healthz", host="127.0.0.2")[0] == 200  # every interface, as asked

        def settled() -> str | None:
            text = get(port, "/metrics")[2]
            shipped = metric(text, "elastic_agent_log_lines_shipped_total")
            if (metric(text, 'elastic_agent_workers{state="running"}') == 2
                    and metric(text, "elastic_agent_restarts_used") == 1
                    and metric(text, "elastic_agent_publisher_backlog_records") == 0
                    and shipped is not None and shipped >= 40
                    and shipped == len(log_lines(r, job_id))):
                return text
            return None

        text = wait_until(settled, 60, "metrics of the second attempt")
        rounds = [e.data["round"] for e in of_type(r, job_id, EventType.RENDEZVOUS_COMPLETE)]
        assert len(rounds) == 2 and metric(text, "elastic_agent_rendezvous_round") == rounds[-1]
        assert metric(text, "elastic_agent_max_restarts") == 1
        assert metric(text, "elastic_agent_redis_connected") == 1
        assert metric(text, "elastic_agent_log_lines_dropped_total") == 0
        assert metric(text, "elastic_agent_healthy") == 1
        assert f'job_id="{job_id}"' in text
        status, _, body = get(port, "/healthz")
        assert status == 200 and json.loads(body)["status"] == "ok", body
        assert get(port, "/metrics")[1].startswith("text/plain; version=0.0.4")
        go.touch()
        assert agent.wait(60) == 0, agent.output[-3000:]
    finally:
        agent.kill()
    with pytest.raises(OSError):  # the port closed with the agent
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def served_port(agent: Agent) -> int:
    m = wait_until(lambda: re.search(r"health check on (?:port |\S+:)(\d+)", agent.output), 60,
                   "the health check port")
    return int(m.group(1))


class HalfRequests:
    """The attack of issue 24: clients that each send half a request line, wait until the
    server drops them, and connect again at once."""

    def __init__(self, port: int, clients: int, source: str = "127.0.0.1") -> None:
        self._where, self._source = ("127.0.0.1", port), (source, 0)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.connects = 0
        self.holding = 0  # connections with their half request sent, not yet dropped
        self.peak = 0  # the most held at once since reset_peak
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _client(self) -> None:
        while not self._stop.is_set():
            try:
                s = socket.create_connection(self._where, timeout=0.2,
                                             source_address=self._source)
            except OSError:
                continue
            with s:
                try:
                    s.sendall(b"GET /healthz HT")
                except OSError:
                    continue
                with self._lock:
                    self.connects += 1
                    self.holding += 1
                    self.peak = max(self.peak, self.holding)
                while not self._stop.is_set():  # until dropped
                    try:
                        if not s.recv(4096):
                            break
                    except TimeoutError:
                        continue
                    except OSError:
                        break
                with self._lock:
                    self.holding -= 1

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.holding

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)


# Probes from a process of their own, as a prober is: the flood's threads share nothing
# with them (in this process, the GIL could hold a probe between its connect and its request).
PROBES = """\
import http.client, json, sys

port, count, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
answers = []
for _ in range(count):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/healthz")
        answers.append(conn.getresponse().status)
    except (OSError, http.client.HTTPException) as exc:
        answers.append(type(exc).__name__)
    finally:
        conn.close()
print(json.dumps(answers))
"""


def probes(port: int, count: int, timeout: float = 2.0) -> list[int | str]:
    """``count`` liveness probes one after the other, each given up after ``timeout`` seconds
    (a kubelet's timeoutSeconds): each one's status, or what went wrong."""
    done = subprocess.run([sys.executable, "-c", PROBES, str(port), str(count), str(timeout)],
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout)


SLEEPER = """\
import os, time
from pathlib import Path

go = Path(os.environ["HC_GO"])
while not go.exists():
    time.sleep(0.02)
"""


def test_liveness_answers_through_a_flood_of_half_requests(redis_url, job_id, tmp_path: Path):
    """64 clients sending half a request line and reconnecting when dropped, from the
    probe's own address: every probe, given 2 s, still gets its 200, in each of 3 floods.
    The agent listens on loopback only (the default), so another address of this host is
    refused."""
    script = tmp_path / "worker.py"
    script.write_text(SLEEPER)
    go = tmp_path / "go"
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "1",
                             "--health-check-port", "0", RDZV, str(script)),
                  tmp_path, "agent", env={"HC_GO": str(go)})
    try:
        port = served_port(agent)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=5).close()
        for flood_round in range(3):
            flood = HalfRequests(port, 64)
            try:
                wait_until(lambda f=flood: f.connects >= 256, 60, "the flood's connections")
                flood.reset_peak()
                answers = probes(port, 30, timeout=2.0)
                peak = flood.peak
            finally:
                flood.stop()
            # The flood held more than the probes' address may keep (the server had to
            # choose whom to end) while the probes ran.
            assert peak > MAX_PER_PEER, f"the flood paused during the probes: {peak} held"
            assert answers == [200] * len(answers), (flood_round, collections.Counter(answers))
        go.touch()
        assert agent.wait(60) == 0, agent.output[-3000:]
    finally:
        agent.kill()


@pytest.fixture
def patient():
    """A server that never times a connection out: every close it makes is an eviction. No
    grace: a connection may be ended for its peer's limit as soon as it is accepted."""
    server = HealthServer(Heartbeat(), 0, read_timeout=600, grace=0)
    yield server.start()
    server.stop()


def half(port: int, source: str, sent: bytes = b"GET /healthz HT") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    if sent:
        s.sendall(sent)
    return s


def closed(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (without waiting)."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        s.setblocking(True)


def test_a_peer_over_its_limit_loses_its_own_oldest_half_requests(patient):
    port = patient
    quiet = half(patient, "127.0.0.2", b"")  # connected, nothing sent yet (a probe's moment)
    flood = [half(port, "127.0.0.2") for _ in range(MAX_PER_PEER + 5)]
    other = [half(port, "127.0.0.3") for _ in range(3)]
    try:
        wait_until(lambda: sum(map(closed, flood)) == 6, 10, "6 of the flood's connections ended")
        # The server holds MAX_PER_PEER of 127.0.0.2's: the silent one stays, the oldest half
        # requests went; another peer's connections are not touched.
        assert [closed(s) for s in flood] == [True] * 6 + [False] * (MAX_PER_PEER - 1)
        assert not closed(quiet) and not any(map(closed, other))
        quiet.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")  # the silent one was a probe
        assert quiet.recv(200).startswith(b"HTTP/1.1 200")
        assert get(port, "/healthz")[0] == 200
    finally:
        for s in (quiet, *flood, *other):
            s.close()


def test_a_young_silent_connection_outlives_newer_ones_from_its_own_address():
    """A probe that has connected but not yet got its head across (a loaded prober) is not
    ended for its peer's limit while it is young, however many newer silent connections its
    address opens: they wait for the total's limit instead. Past the grace, the peer's limit
    holds again: its oldest silent connection goes for a newcomer."""
    server = HealthServer(Heartbeat(), 0, read_timeout=600, grace=600)  # young all along
    port = server.start()
    quiet = half(port, "127.0.0.2", b"")
    flood = [half(port, "127.0.0.2", b"") for _ in range(MAX_PER_PEER + 8)]
    try:
        assert get(port, "/healthz", timeout=5)[0] == 200  # every one was accepted by now
        assert not closed(quiet) and not any(map(closed, flood))
        quiet.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
        assert quiet.recv(200).startswith(b"HTTP/1.1 200")
    finally:
        for s in (quiet, *flood):
            s.close()
        server.stop()
    server = HealthServer(Heartbeat(), 0, read_timeout=600, grace=0.2)
    port = server.start()
    held = [half(port, "127.0.0.2", b"") for _ in range(MAX_PER_PEER)]
    try:
        # Newcomers, each given 50 ms, until the grace of the first has passed: then one of
        # them ends it for the peer's limit (the total's is never reached here).
        for _ in range(MAX_CONNECTIONS - MAX_PER_PEER - 1):
            held.append(half(port, "127.0.0.2", b""))
            with contextlib.suppress(AssertionError):
                wait_until(lambda: closed(held[0]), 0.05, "the oldest connection ended")
                break
        assert closed(held[0]), "the oldest silent connection outlived its grace"
        ended = [closed(s) for s in held[:MAX_PER_PEER]]
        assert ended == sorted(ended, reverse=True), ended  # the oldest first
    finally:
        for s in held:
            s.close()
        server.stop()


def test_many_peers_over_the_total_lose_the_busiest_peers_connections(patient):
    port = patient
    peers = [f"127.0.1.{i}" for i in range(1, 6)]  # 5 x MAX_PER_PEER > MAX_CONNECTIONS
    assert len(peers) * MAX_PER_PEER > MAX_CONNECTIONS
    mine = [half(port, "127.0.0.3") for _ in range(3)]
    flood = [half(port, peer) for peer in peers for _ in range(MAX_PER_PEER)]
    try:
        held = len(mine) + len(flood) - MAX_CONNECTIONS
        wait_until(lambda: sum(map(closed, flood)) == held, 10, f"{held} evictions")
        assert not any(map(closed, mine))  # a small peer keeps its connections
        assert get(port, "/healthz", timeout=5)[0] == 200
    finally:
        for s in (*mine, *flood):
            s.close()


def test_a_silent_connection_gets_408_after_the_short_read_timeout():
    assert READ_TIMEOUT_S <= 1.0  # a Kubernetes probe gives up after 1 s (timeoutSeconds)
    server = HealthServer(Heartbeat(), 0)
    port = server.start()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            start = time.monotonic()
            s.sendall(b"GET /healthz HTTP/1.1\r\n")  # and never the end of the head
            reply = s.recv(200)
            waited = time.monotonic() - start
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert waited >= READ_TIMEOUT_S * 0.9, waited
    finally:
        server.stop()


def test_the_bind_address():
    # The default is loopback: another address of this host is refused.
    server = HealthServer(Heartbeat(), 0)
    port = server.start()
    try:
        assert get(port, "/healthz")[0] == 200
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", port), timeout=5).close()
    finally:
        server.stop()
    # "::" is every interface, of both families where the system has dual-stack sockets.
    server = HealthServer(Heartbeat(), 0, host="::")
    port = server.start()
    try:
        assert get(port, "/healthz", host="127.0.0.2")[0] == 200
        assert get(port, "/healthz", host="::1")[0] == 200
    finally:
        server.stop()
    for bad in ("nosuch.invalid", "a" * 300, "bad host\x1b[2J"):
        with pytest.raises(HealthCheckError, match="cannot serve the health check on"):
            HealthServer(Heartbeat(), 0, host=bad).start()


def test_an_unusable_host_is_one_line_and_no_workers(redis_url, job_id, tmp_path: Path):
    script = tmp_path / "worker.py"
    script.write_text("pass\n")
    agent = Agent(agent_args(redis_url, job_id, "--health-check-port", "0",
                             "--health-check-host", "nosuch.invalid", RDZV, str(script)),
                  tmp_path, "agent")
    assert agent.wait(60) == 1
    errors = [ln for ln in agent.output.splitlines() if "error" in ln]
    assert len(errors) == 1 and "cannot serve the health check on nosuch.invalid:0" in errors[0], \
        agent.output
    assert "Traceback" not in agent.output


def test_peers_are_addresses_and_ipv6_slash_64s():
    # A v4 client of a dual-stack socket is its IPv4 address; one IPv6 host or tenant is
    # routinely given a whole /64, so its addresses count as one peer.
    assert _peer_key("::ffff:127.0.0.2") == _peer_key("127.0.0.2") == "127.0.0.2"
    assert _peer_key("2001:db8:1:2::1") == _peer_key("2001:db8:1:2:ffff::9")
    assert _peer_key("2001:db8:1:2::1") != _peer_key("2001:db8:1:3::1")
    assert _peer_key("fe80::1%eth0") == _peer_key("fe80::2")
    assert _peer_key("not an address") == "not an address"


def test_broken_metrics_are_a_500_and_liveness_still_answers():
    heartbeat = Heartbeat()
    heartbeat.beat(Snapshot(workers=None))  # type: ignore[arg-type] - a snapshot gone wrong
    server = HealthServer(heartbeat, 0)
    port = server.start()
    try:
        assert get(port, "/metrics")[0] == 500
        assert get(port, "/healthz")[0] == 200
    finally:
        server.stop()


# A server in a process with few descriptors: its connections' table (MAX_CONNECTIONS) is
# more than the process may open.
FEW_FDS = """\
import resource, sys, time
from elastic_agent.supervision.health import HealthServer, Heartbeat

server = HealthServer(Heartbeat(), 0, read_timeout=600)
port = server.start()
resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
print(port, flush=True)
sys.stdin.read()
"""


def test_out_of_descriptors_the_server_ends_a_connection_and_answers():
    proc = subprocess.Popen([sys.executable, "-c", FEW_FDS], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    held: list[socket.socket] = []
    try:
        port = int(proc.stdout.readline())
        held = [half(port, "127.0.0.2", b"") for _ in range(MAX_PER_PEER)]
        held += [half(port, "127.0.0.3", b"") for _ in range(MAX_PER_PEER)]
        assert get(port, "/healthz", timeout=5)[0] == 200
        assert any(map(closed, held))  # one went to make room
    finally:
        for s in held:
            s.close()
        proc.kill()
        proc.wait(10)
