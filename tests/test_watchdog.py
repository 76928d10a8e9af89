"""The worker watchdog: torch's own FileTimerClient against a real agent, and hostile FIFO input.

A real elastic-agent with TORCHELASTIC_ENABLE_FILE_TIMER=1, real workers that use
``torch.distributed.elastic.timer`` (FileTimerClient + expires), a real redis-server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import redis

from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.supervision.diagnosis.watchdog import (
    MAX_REQUEST_BYTES,
    TimerRequest,
    Watchdog,
    WatchdogError,
    _FifoProtocol,
    decode_request,
)
from elastic_agent.supervision.launch.exits import WorkerInfo
from elastic_console.job.state import JobView
from tests.agents import Agent, wait_until
from tests.conftest import require_program
from tests.test_agent import agent_args, events, of_type
from tests.waiting import wait_until_async

# One node; a heartbeat timeout far above the 2 s of test_agent's FAST, so that a loaded CI
# host never re-forms the group (SIGTERM to the workers) in the middle of the test.
RDZV = "--rdzv-conf=heartbeat_timeout=30,keep_alive_interval=0.5,join_timeout=60"

# Rank 0 holds a timer and releases it in time, then lives on past that timer's deadline (it
# must not be killed). Rank 1 then overruns its own timer and must be killed with SIGKILL.
# The test writes garbage into the FIFO between the two.
WORKER = """\
import os, select, sys, time
from pathlib import Path
from torch.distributed.elastic import timer

d = Path(os.environ["WD_DIR"])
rank = int(os.environ["RANK"])
timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))

def wait_for(name):
    while not (d / name).exists():
        time.sleep(0.01)  # a worker polls the test's file (tests.waiting is not importable here)

if rank == 0:
    (d / "fifo.tmp").write_text(os.environ["TORCHELASTIC_TIMER_FILE"])
    os.rename(d / "fifo.tmp", d / "fifo")
    t0 = time.time()
    # A generous timer (a loaded host must not make the 0.1 s step overrun it), released in time.
    with timer.expires(after=3, scope="quick-step"):
        time.sleep(0.1)  # the step the timer covers
    wait_for("go")
    time.sleep(max(0.0, t0 + 3.3 - time.time()))  # past quick-step's deadline: no kill
    print("rank 0 finished in time", flush=True)
    (d / "r0.tmp").write_text(str(os.getpid()))
    os.rename(d / "r0.tmp", d / "r0-done")
else:
    wait_for("r0-done")
    # Rank 0 must have exited before this timer can fail the group (a slow interpreter exit
    # on a loaded host would otherwise meet the stop's SIGTERM).
    select.select([os.pidfd_open(int((d / "r0-done").read_text()))], [], [])
    with timer.expires(after=1, scope="slow-step"):
        time.sleep(60)  # the overrun under test: the watchdog ends it
    print("rank 1 was not stopped", flush=True)
"""


def request(pid: int, scope: str, expiration: float, sig: int = 9) -> bytes:
    return json.dumps({"version": 1, "pid": pid, "scope_id": scope,
                       "expiration_time": expiration, "signal": sig}).encode() + b"\n"


def garbage(foreign_pids: list[int], worker_pid: int) -> list[bytes]:
    past = time.time() - 5
    # Expired timers for processes that are not workers of the agent come first: torch would
    # kill them at once; the first rejections are each logged.
    lines = [request(pid, "foreign", past) for pid in foreign_pids]
    lines += [
        b"not json at all\n",
        b"[" * 2000 + b"]" * 2000 + b"\n",  # RecursionError in json, within the size bound
        b"x" * 100_000 + b"\n",  # over the bound: dropped whole, never buffered
        b"\xff\xfe\xfd\n",
        b'{"pid": true, "scope_id": "s", "expiration_time": 1, "signal": 9}\n',
        b'{"pid": 1, "scope_id": "s", "expiration_time": NaN, "signal": 9}\n',
        b'{"pid": 1, "scope_id": ["s"], "expiration_time": 1, "signal": 9}\n',
        b'{"version": 2, "pid": 1, "scope_id": "s", "expiration_time": 1, "signal": 9}\n',
        request(worker_pid, "bad-signal", past, sig=99999),
        b"\n\n",
    ]
    return lines


def test_torch_file_timer_kills_an_overrunning_worker_only(redis_url, r: redis.Redis, job_id,
                                                           tmp_path: Path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    sleeper = subprocess.Popen(["sleep", "120"])
    env = {"TORCHELASTIC_ENABLE_FILE_TIMER": "1", "WD_DIR": str(tmp_path)}
    assert "TORCHELASTIC_TIMER_FILE" not in os.environ  # the agent must make its own FIFO
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "2", "--max-restarts", "0",
                             RDZV, str(script)), tmp_path, "agent", env=env)
    try:
        fifo = Path(wait_until(lambda: (tmp_path / "fifo").exists()
                               and (tmp_path / "fifo").read_text(), 90, "the FIFO's path"))
        pids = wait_until(lambda: of_type(r, job_id, EventType.WORKERS_STARTED), 10,
                          "workers_started")[0].data["pids"]
        # Written the way torch's client writes (the agent holds the read end open).
        with open(fifo, "wb", buffering=0) as f:
            for line in garbage([sleeper.pid, agent.pid], pids[0]):
                f.write(line)
        started = time.time()
        (tmp_path / "go").touch()
        code = agent.wait(90)
    finally:
        alive = sleeper.poll() is None
        sleeper.kill()
        sleeper.wait()
        agent.kill()
    out = agent.output
    assert alive, f"the watchdog killed a process that is not a worker\n{out[-4000:]}"
    # torch's server also kills its own process (torchrun exits 137); ours reports the failure.
    assert code == 1, out[-4000:]

    expired = of_type(r, job_id, EventType.WORKER_TIMER_EXPIRED)
    assert len(expired) == 1, [e.data for e in expired]
    d = expired[0].data
    assert (d["rank"], d["local_rank"], d["pid"], d["scope"], d["signal"], d["killed"]) == (
        1, 1, pids[1], "slow-step", "SIGKILL", True), d
    assert started < d["deadline"] < time.time(), d
    assert 0 <= d["late_s"] < 5, d

    exits = {e.data["rank"]: e.data for e in of_type(r, job_id, EventType.WORKER_EXITED)}
    assert exits[0]["exit_code"] == 0, exits[0]  # released in time: not killed
    assert "rank 0 finished in time" in out
    assert (exits[1]["exit_code"], exits[1]["signal"]) == (-9, "SIGKILL"), exits[1]
    assert "timer 'slow-step' expired" in exits[1]["message"], exits[1]

    cause = of_type(r, job_id, EventType.JOB_FAILED)[0].data["root_cause"]
    assert cause["rank"] == 1 and "timer 'slow-step' expired" in cause["message"], cause
    assert "killed rank 1 with SIGKILL" in cause["message"], cause
    assert "message   : timer 'slow-step' expired" in out, out[-3000:]
    failures = of_type(r, job_id, EventType.GROUP_FAILED)[0].data["failures"]
    assert [f["rank"] for f in failures] == [1], failures
    assert "timer 'slow-step' expired" in failures[0]["message"], failures

    # The garbage was read and refused, each kind for its reason; nobody was killed for it.
    assert f"process {sleeper.pid} is not a worker of this agent" in out, out[-4000:]
    assert f"process {agent.pid} is not a worker of this agent" in out, out[-4000:]
    assert "not a JSON line" in out, out[-4000:]
    # The FIFO and its private directory are gone with the agent.
    assert not fifo.exists() and not fifo.parent.exists()

    # The console's timeline shows the expiry.
    view = JobView(job_id)
    view.apply_events(events(r, job_id))
    entries = [t for t in view.timeline if t.kind == "watchdog"]
    assert len(entries) == 1 and "rank 1" in entries[0].text, entries
    assert "slow-step" in entries[0].text and "killed with SIGKILL" in entries[0].text, entries
    assert str(d["deadline"]) in entries[0].detail, entries


# -- the decoder and the line cutter: hostile input, no agent --------------------------------

@pytest.mark.parametrize("line, why", [
    (b"nope", "not a JSON line"),
    (b"[" * 3000 + b"]" * 3000, "longer than"),
    (b"[" * 2000 + b"]" * 2000, "not a JSON line"),
    (b"\xff", "not a JSON line"),
    (b"[1]", "not a JSON object"),
    (b'{"pid": true, "scope_id": "s", "expiration_time": 1}', "pid"),
    (b'{"pid": 0, "scope_id": "s", "expiration_time": 1}', "pid"),
    (b'{"pid": 5, "scope_id": 3, "expiration_time": 1}', "scope_id"),
    (b'{"pid": 5, "scope_id": "' + b"s" * 2000 + b'", "expiration_time": 1}', "scope_id"),
    (b'{"pid": 5, "scope_id": "s", "expiration_time": Infinity}', "expiration_time"),
    (b'{"pid": 5, "scope_id": "s", "expiration_time": "1"}', "expiration_time"),
    (b'{"pid": 5, "scope_id": "s", "expiration_time": 1, "signal": 1.5}', "signal"),
    (b'{"pid": 5, "scope_id": "s", "expiration_time": 1, "signal": 4096}', "signal"),
    (b'{"pid": 5, "scope_id": "s", "expiration_time": 1, "version": "1"}', "version"),
])
def test_decode_request_refuses_what_torch_never_writes(line, why):
    result = decode_request(line)
    assert isinstance(result, str) and why in result, result


def test_decode_request_accepts_torchs_own_requests():
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerRequest

    acquire = FileTimerRequest(worker_pid=42, scope_id="a.py#3", expiration_time=17.5, signal=9)
    release = FileTimerRequest(worker_pid=42, scope_id="a.py#3", expiration_time=-1, signal=0)
    assert decode_request(acquire.to_json().encode()) == TimerRequest(42, "a.py#3", 17.5, 9)
    got = decode_request(release.to_json().encode())
    assert isinstance(got, TimerRequest) and got.is_release


def test_line_cutter_bounds_memory_and_keeps_the_next_request():
    seen: list[bytes | None] = []
    proto = _FifoProtocol(seen.append)
    good = request(7, "s", 1.0)
    # An endless line in many chunks is dropped once, never held; the next line survives,
    # and a request split across reads is joined.
    for _ in range(50):
        proto.data_received(b"y" * 10_000)
        assert len(proto._buf) <= MAX_REQUEST_BYTES
    proto.data_received(b"tail\n" + good[:10])
    proto.data_received(good[10:] + good)
    assert seen == [None, good[:-1], good[:-1]]


# -- the server on a loop of its own, with real processes as workers -------------------------

class _Group:
    """What the watchdog reads of a WorkerGroup: its workers, their exits, the attempt."""

    def __init__(self, pids: list[int]) -> None:
        self.workers = [WorkerInfo(i, 10 + i, pid) for i, pid in enumerate(pids)]
        self.exits: list = []
        self.assignment = None
        self.spec = None


def test_signals_descendants_no_signal_and_ended_processes(tmp_path: Path):
    # Worker 10 runs a child (a descendant holds timers too); worker 11 holds a timer with no
    # signal (report only); worker 12 ends before its timer would expire (dropped, no report).
    w10 = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE,
                           text=True)
    child = int(w10.stdout.readline())
    w11 = subprocess.Popen(["sleep", "60"])
    w12 = subprocess.Popen(["sleep", "60"])
    fifo = tmp_path / "timer"
    fifo.write_text("a regular file is refused, never replaced")
    seen: list[dict] = []
    said: list[str] = []
    wd = Watchdog(fifo, lambda _type, **data: seen.append(data), said.append)
    wd._group = _Group([w10.pid, w11.pid, w12.pid])

    async def scenario() -> None:
        with pytest.raises(WatchdogError, match="not a FIFO"):
            await wd.start()
        assert fifo.read_text().startswith("a regular file")
        fifo.unlink()
        await wd.start()
        now = time.time()
        with open(fifo, "wb", buffering=0) as f:
            f.write(request(child, "child-step", now + 0.3, sig=signal.SIGTERM))
            f.write(request(w11.pid, "report-only", now + 0.3, sig=0))
            f.write(request(w12.pid, "ends-first", now + 2))
            f.write(request(w12.pid, "moved", now + 0.3))
            f.write(request(w12.pid, "moved", now + 30))  # acquiring again moves the deadline
        # w12 ends while the watchdog holds its timers: all five requests were read.
        await wait_until_async(lambda: wd.stats.acquired == 5, 10, "the five timers held")
        w12.kill()
        await wait_until_async(lambda: len(seen) >= 2, 10, "two expiries")
        # Not a wait: the stretch up to past ends-first's deadline, in which no report of it
        # may come (its process is gone).
        await asyncio.sleep(max(0.0, now + 2.3 - time.time()))
        wd.close()

    try:
        asyncio.run(scenario())
        by_scope = {d["scope"]: d for d in seen}
        assert set(by_scope) == {"child-step", "report-only"}, seen
        c = by_scope["child-step"]
        assert (c["rank"], c["pid"], c["worker_pid"], c["signal"], c["killed"]) == (
            10, child, w10.pid, "SIGTERM", True), c
        assert w10.wait(10) == 0  # its child died of the signal; the worker itself lives on
        r = by_scope["report-only"]
        assert (r["rank"], r["killed"], r["signal"]) == (11, False, None), r
        assert w11.poll() is None
        assert wd.stats.killed == 1 and wd.stats.expired == 2
        assert not fifo.exists()
    finally:
        for p in (w10, w11, w12):
            p.kill()
            p.wait()


# -- a FIFO path in a directory other users may write -----------------------------------------

NOBODY = 65534
# Root without any capability: the kernel's rules for an unprivileged user (a sticky
# directory refuses to unlink another user's file), the same files readable (see FIELD-NOTES).
NO_CAPS = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]


def foreign_fifo(tmp_path: Path) -> Path:
    """A FIFO of user nobody in a sticky, world-writable directory of nobody (like /tmp)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    os.chown(shared, NOBODY, NOBODY)
    fifo = shared / "timer"
    os.mkfifo(fifo, 0o600)
    os.chown(fifo, NOBODY, NOBODY)
    return fifo


@pytest.mark.parametrize("privileged", [False, True], ids=["unprivileged", "root"])
def test_another_users_fifo_is_refused_in_one_line(redis_url, job_id, tmp_path: Path,
                                                  privileged: bool):
    """Unprivileged, it could not be removed (a raw PermissionError once stopped the agent);
    as root it would have been deleted and replaced. Either way: one line, nothing touched."""
    if not privileged:
        require_program("setpriv")  # util-linux: drops the capabilities
    fifo = foreign_fifo(tmp_path)
    before = os.lstat(fifo)
    env = {"TORCHELASTIC_ENABLE_FILE_TIMER": "1", "TORCHELASTIC_TIMER_FILE": str(fifo)}
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "1", "-m", "platform"),
                  tmp_path, "agent", env=env, prefix=None if privileged else NO_CAPS)
    code = agent.wait(60)
    out = agent.output
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert code == 1, out
    assert "Traceback" not in out, out
    assert len(errors) == 1 and "another user's FIFO" in errors[0], out
    after = os.lstat(fifo)
    assert (after.st_ino, after.st_uid) == (before.st_ino, NOBODY), "the FIFO was replaced"


def test_a_fifo_swapped_after_mkfifo_is_refused(tmp_path: Path):
    """Between ``mkfifo`` and ``open`` another user may swap the path, in a directory they
    may write: for a symlink to their FIFO, or a FIFO of their own. Neither is served, and
    what took the place of ours is not removed at close."""
    theirs = foreign_fifo(tmp_path)
    path = tmp_path / "timer"
    said: list[str] = []

    def swapped_for_symlink(self: Watchdog, p: Path) -> None:
        Watchdog._make_fifo(self, p)
        p.unlink()
        p.symlink_to(theirs)

    def swapped_for_foreign(self: Watchdog, p: Path) -> None:
        Watchdog._make_fifo(self, p)
        p.unlink()
        os.mkfifo(p, 0o600)
        os.chown(p, NOBODY, NOBODY)

    for swap, why in ((swapped_for_symlink, "replaced by a symlink"),
                      (swapped_for_foreign, "replaced by another file")):
        wd = Watchdog(path, lambda *_a, **_k: None, said.append)
        wd._make_fifo = swap.__get__(wd)  # type: ignore[method-assign]
        with pytest.raises(WatchdogError, match=why):
            asyncio.run(wd.start())
        assert not said, "a refused FIFO is not announced as served"
        assert os.path.lexists(path), "the other user's file was removed at close"
        path.unlink()
    assert stat.S_ISFIFO(os.lstat(theirs).st_mode)
