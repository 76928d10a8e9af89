"""A `--standalone` job ends cleanly for the console attached to it: its embedded Redis stops
with the agent, and the console shows how the job ended and that its Redis stopped, never the
"Redis unreachable — reconnecting…" banner of an outage.

Real agents (a worker that ends when the test says so), their own embedded redis-server, the
console under Pilot and once, installed, in tmux."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import redis
from textual.pilot import Pilot
from textual.worker import WorkerState

from elastic_agent.coordination.transport.connection import make_client
from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.coordination.wire.event_records import EventType, decode_event, encode_event
from elastic_agent.coordination.wire.keyspace import console_client_name
from elastic_console.job.state import JobView
from tests.agents import Agent, wait_until
from tests.test_console_app import App, run, screen_text
from tests.test_console_tmux import CONSOLE, Tmux, require_tmux
from tests.waiting import wait_until_async

# Runs until the test creates the file named by SE_GO (the console is attached by then).
WORKER = """\
import os, time
from pathlib import Path

go = Path(os.environ["SE_GO"])
print("waiting for the test's go", flush=True)
while not go.exists():
    time.sleep(0.02)
print("done", flush=True)
"""

RECONNECTING = "Redis unreachable"
LINGER = 4  # seconds the agent keeps its Redis up for an attached console after the end


def standalone_agent(job_id: str, tmp_path: Path, linger: float = LINGER) -> tuple[Agent, Path]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    go = tmp_path / "go"
    agent = Agent(["--standalone", "--job-id", job_id, "--nproc-per-node", "1", str(script)],
                  tmp_path, "agent", env={"SE_GO": str(go), "ELASTIC_STANDALONE_LINGER": str(linger)})
    return agent, go


def redis_url_of(agent: Agent) -> str:
    """The embedded server's URL, once the agent printed it."""
    pattern = re.compile(r"standalone Redis on (redis://[^;\s]+);")
    found = wait_until(lambda: pattern.search(agent.output), 30, "the agent's Redis URL")
    return found.group(1)


def test_the_console_shows_the_end_and_that_the_embedded_redis_stopped(job_id, tmp_path):
    agent, go = standalone_agent(job_id, tmp_path)
    try:
        url = redis_url_of(agent)
        app = App(job_id, endpoint=parse_endpoint(url))
        shown: list[tuple[str | None, str]] = []

        async def body(pilot: Pilot[int], app: App) -> None:
            banner_show = app.banner.show

            def record(message: str | None, tone: str = "alert") -> None:
                if not shown or shown[-1] != (message, tone):
                    shown.append((message, tone))
                banner_show(message, tone)

            app.banner.show = record  # type: ignore[method-assign]
            await wait_until_async(lambda: app.loaded and app.view.ranks, 30, "the job on screen")
            go.touch()
            # The job's end, then the announcement: the countdown, while Redis is still up.
            await wait_until_async(lambda: app.view.redis_stops_ms is not None, 30,
                                   "the redis_stopping event")
            await wait_until_async(lambda: "embedded Redis stops when you detach" in
                                   screen_text(app), 5, "the countdown banner")
            assert "SUCCEEDED" in screen_text(app).splitlines()[0]
            # The agent stops its Redis after the linger (the console stays attached) ...
            await wait_until_async(lambda: agent.proc.poll() is not None, LINGER + 20,
                                   "the agent to exit")
            await wait_until_async(lambda: app.view.redis_gone, 10, "the lost server")
            await pilot.pause()
            text = screen_text(app)
            assert "job succeeded; its embedded Redis has stopped" in text, text
            assert "○ stopped with the job" in text.splitlines()[1], text
            # ... and the console stops reading: no reconnecting, quietly or not.
            await wait_until_async(lambda: not [
                w for w in app.workers if w.group in ("reader", "poll")
                and w.state not in (WorkerState.SUCCESS, WorkerState.CANCELLED)], 10,
                "the reader and the poller to end")
            await asyncio.sleep(1.5)  # a reconnecting reader would have spoken by now
            text = screen_text(app)
            assert "job succeeded; its embedded Redis has stopped" in text, text
            assert not app.main_screen.has_class("-disconnected")

        run(app, body, timeout=90)
        assert agent.wait(10) == 0, agent.output
        assert "a console is attached" in agent.output, agent.output
        messages = [m for m, _ in shown if m]
        assert not any(RECONNECTING in m for m in messages), messages
        assert messages[-1] == "job succeeded; its embedded Redis has stopped (q to leave)"
        assert shown[-1][1] == "ended-ok"
        assert not any("reconnected" in n for n, _ in app.notes), app.notes
    finally:
        agent.kill()


def test_without_a_console_the_embedded_redis_stops_at_once(job_id, tmp_path):
    """Only a console of this job holds the server up: not a stray client (redis-cli, a
    leftover process retrying the default port), nor a console of another job."""
    agent, go = standalone_agent(job_id, tmp_path, linger=120)
    url = redis_url_of(agent)
    stray = make_client(url)
    other = redis.Redis.from_url(url, client_name=console_client_name(job_id + "-other"))
    try:
        stray.ping()
        other.ping()
        go.touch()
        start = time.monotonic()
        assert agent.wait(60) == 0, agent.output
        assert time.monotonic() - start < 30, agent.output
        assert "a console is attached" not in agent.output, agent.output
    finally:
        stray.close()
        other.close()
        agent.kill()


def test_the_announcement_is_folded_and_survives_hostile_values():
    view = JobView("j")
    view.set_connection(True, "redis://x")
    t0 = 1_700_000_000_000
    view.apply_event(decode_event(f"{t0}-0", encode_event(EventType.JOB_SUCCEEDED, "n-1-a", {})))
    view.apply_event(decode_event(f"{t0 + 1}-0", encode_event(
        EventType.REDIS_STOPPING, "n-1-a", {"final_state": "succeeded", "linger_s": 15})))
    assert view.redis_stops_ms == t0 + 1 + 15_000 and not view.redis_gone
    assert "embedded Redis" in view.timeline[-1].text
    view.set_connection(False, "redis://x", "connection refused")
    assert view.redis_gone
    # The announcement alone (the job's end trimmed away) still tells how the job ended;
    # nonsense in it neither breaks the fold nor invents a state.
    for data, state in (({"final_state": "failed", "linger_s": "nan"}, "failed"),
                        ({"final_state": ["x"], "linger_s": 1e300}, "waiting"),
                        ({"final_state": "exploded", "linger_s": True}, "waiting")):
        other = JobView("j")
        other.apply_event(decode_event(f"{t0}-0", encode_event(EventType.REDIS_STOPPING,
                                                               "n-1-a", data)))
        assert other.state == state and other.redis_stops_ms == t0, data
        assert other.ignored == 0


def test_in_tmux_the_end_of_a_standalone_job_is_never_an_outage(job_id, tmp_path):
    require_tmux()
    agent, go = standalone_agent(job_id, tmp_path)
    url = redis_url_of(agent)
    tmux = Tmux([str(CONSOLE), "attach", job_id, "--redis", url])
    screens: list[str] = []

    def screen() -> str:
        text = tmux.screen()
        screens.append(text)
        return text

    with tmux.ending_with(agent):
        wait_until(lambda: job_id in screen() and "waiting for the test's go" in screens[-1],
                   30, "the console showing the running job")
        go.touch()
        wait_until(lambda: "embedded Redis stops when you detach" in screen(), 30,
                   "the countdown banner")
        wait_until(lambda: all(s in screen() for s in (
            "job succeeded; its embedded Redis has stopped", "SUCCEEDED",
            "stopped with the job")), LINGER + 20, "the end on screen")
        assert agent.wait(10) == 0, agent.output
        assert not any(RECONNECTING in s for s in screens), next(
            s for s in screens if RECONNECTING in s)
        tmux.keys("q")
        wait_until(lambda: not tmux.alive(), 15, "the console to detach")



# -- the embedded server dies with its agent, however the agent ends -----------------------

def _redis_child_of(pid: int) -> int:
    """The pid of the redis-server that process ``pid`` started (its child)."""
    for child in psutil.Process(pid).children():
        if child.name() == "redis-server":
            return child.pid
    return 0


def _ended(pidfd: int, timeout: float) -> bool:
    """Whether the process of ``pidfd`` ended within ``timeout`` s (a zombie counts: it holds
    no port; whoever it was reparented to may reap it late)."""
    return bool(select.select([pidfd], [], [], timeout)[0])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def test_a_sigkilled_standalone_agent_takes_its_redis_with_it(job_id, tmp_path):
    agent, _ = standalone_agent(job_id, tmp_path)
    try:
        url = redis_url_of(agent)
        port = int(url.rsplit(":", 1)[1])
        redis_pid = wait_until(lambda: _redis_child_of(agent.pid), 10, "the agent's redis-server")
        pidfd = os.pidfd_open(redis_pid)
        try:
            assert _answers(port)
            os.kill(agent.pid, signal.SIGKILL)
            assert _ended(pidfd, 10), "the embedded redis-server outlived its SIGKILLed agent"
        finally:
            os.close(pidfd)
        assert not _answers(port)
        assert agent.wait(10) == -signal.SIGKILL
    finally:
        agent.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(redis_pid, signal.SIGKILL)


# Starts a server from a thread that then ends (asyncio.to_thread's pool, a bench's helper):
# the server must live on, and die with the process.
OWNER = """\
import sys, threading
from elastic_agent.supervision.hosting.standalone import RedisServer

servers = []
t = threading.Thread(target=lambda: servers.append(RedisServer().start()))
t.start()
t.join()
print(servers[0].port, servers[0].proc.pid, flush=True)
sys.stdin.read()
"""


def test_a_server_started_from_a_passing_thread_lives_until_its_process_dies(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    owner = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    redis_pid = 0
    try:
        assert owner.stdout is not None
        port, redis_pid = (int(x) for x in owner.stdout.readline().split())
        pidfd = os.pidfd_open(redis_pid)
        try:
            # The thread that forked it has ended. A parent death signal tied to that thread
            # is sent as the thread exits, about when join() returns: half a second is a
            # margin of orders of magnitude for it to have arrived.
            assert not _ended(pidfd, 0.5), "the server died with the thread that started it"
            assert _answers(port)
            owner.kill()
            assert _ended(pidfd, 10), "the server outlived its SIGKILLed process"
        finally:
            os.close(pidfd)
    finally:
        owner.kill()
        owner.wait()
        if redis_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(redis_pid, signal.SIGKILL)
