"""The health check server: liveness that turns 503 when the loop stalls, and /metrics.

The stall is real: an event loop blocked by a synchronous call, as a bug in the agent would
block its own; the server answers from its own thread meanwhile. Then a real agent: 200 and
metrics whose values are checked against Redis.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import redis

from elastic_agent.coordination.protocol import EventType
from elastic_agent.supervision.health import (
    MAX_HEAD_BYTES,
    PORT_ENV,
    HealthCheckError,
    HealthServer,
    Heartbeat,
    Snapshot,
    beat_forever,
    resolve_port,
)
from tests.agents import Agent, wait_until
from tests.test_agent import agent_args, log_lines, of_type

RDZV = "--rdzv-conf=heartbeat_timeout=30,keep_alive_interval=0.5,join_timeout=60"


def get(port: int, path: str, method: str = "GET") -> tuple[int, str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
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
    assert doc["status"] == "stalled" and doc["last_beat_s"] > 0.5, doc
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
                             "--health-check-port", "0", RDZV, str(script)),
                  tmp_path, "agent", env={"HC_GO": str(go)})
    try:
        port = int(wait_until(lambda: re.search(r"health check on port (\d+)", agent.output),
                              60, "the health check port").group(1))
        assert get(port, "/healthz")[0] == 200

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
