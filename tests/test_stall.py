"""Stall detection (issue 13, point 2): real agents, real (torch-free) workers, a real Redis.

tests/scripts/stall.py hangs every rank but one in a wait and the odd one in a sleep (no
output, no CPU): the stall is reported once by one agent with every rank's stacks, naming
the odd rank; ``--on-stall restart`` restarts (counted) and the job then completes;
``--on-stall stop`` fails the job. A job printing steadily, one computing silently and one
with ``--stall-timeout 0`` are never reported. The shared progress hash is hostile input.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest
import redis

from elastic_agent.coordination.transport.connection import make_async_client
from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.coordination.wire.event_records import EventType, decode_event
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.supervision.config import UsageError, parse_args
from elastic_agent.supervision.diagnosis.stall import ProgressMeter, StallWatch
from elastic_console.tui.app import ConsoleApp
from elastic_console.tui.widgets.stacks import StacksScreen
from tests.agents import EXAMPLES, SCRIPTS, Agent, wait_until
from tests.waiting import wait_until_async

SCRIPT = str(SCRIPTS / "stall.py")


def events(r: redis.Redis, job: str, etype: str | None = None) -> list:
    evs = (decode_event(i, f) for i, f in r.xrange(JobKeys(job).events))
    return [e for e in evs if e is not None and (etype is None or e.type == etype)]


def agents(redis_url: str, job: str, tmp: Path, nodes: int, nproc: int, flags: list[str],
           script: list[str]) -> list[Agent]:
    return [Agent(["--redis", redis_url, "--job-id", job, "--nnodes", str(nodes),
                   "--nproc-per-node", str(nproc), "--local-addr", "127.0.0.1",
                   "--shutdown-timeout", "2", "--monitor-interval", "0.1", *flags,
                   SCRIPT, *script], tmp, f"agent{i}") for i in range(nodes)]


def finish(procs: list[Agent]) -> None:
    for a in procs:
        a.kill()
    for a in procs:
        a.wait(30)


def test_a_hang_is_reported_once_with_the_odd_rank(redis_url, r, job_id, tmp_path):
    procs = agents(redis_url, job_id, tmp_path, 2, 2, ["--stall-timeout", "2"], ["hang", "3"])
    try:
        ev = wait_until(lambda: events(r, job_id, EventType.STALLED), 40, "a stalled event")[0]
        d = ev.data
        assert d["odd_ranks"] == [3], d
        assert d["odd_hosts"] == [socket.gethostname()]
        assert d["policy"] == "observe" and d["round"] == 0
        assert d["idle_s"] >= 2
        assert d["request"]  # the capture on the stacks stream
        assert [g["ranks"] for g in d["groups"]] == [[3], [0, 1, 2]]
        assert "straggler" in d["groups"][0]["summary"]
        assert "wait_for_peer" in d["groups"][1]["summary"]
        # Every rank answered the capture: its replies are on the stacks stream.
        replies = r.xrange(JobKeys(job_id).stacks)
        assert {f[b"rank"] for _, f in replies if f[b"request"] == d["request"].encode()} == {
            b"0", b"1", b"2", b"3"}
        started = next(e for e in events(r, job_id, EventType.WORKERS_STARTED))
        assert ev.server_ms - started.server_ms >= 2000
        # Observe: the workers keep running, and the same stall is not reported again.
        claim = r.get(JobKeys(job_id).stall(0))
        assert claim is not None and r.pttl(JobKeys(job_id).stall(0)) == -1  # reported for good
        asyncio.run(asyncio.wait_for(_console_shows_the_stall(redis_url, job_id, d), 60))
    finally:
        finish(procs)
    assert len(events(r, job_id, EventType.STALLED)) == 1
    assert not events(r, job_id, EventType.RESTARTING)


async def _console_shows_the_stall(redis_url: str, job_id: str, d: dict) -> None:
    """The console marks the odd rank and the ranks waiting for it, and enter on the stall in
    the timeline opens the stacks it captured."""
    app = ConsoleApp(job_id, endpoint=parse_endpoint(redis_url), cursor_blink=False)
    async with app.run_test(size=(140, 40)) as pilot:
        await wait_until_async(lambda: app.loaded and any(
            e.kind == "stalled" for e in app.timeline.entries), 20, "the stall in the timeline")
        states = {r: app.view.ranks[r].state for r in range(4)}
        assert states == {0: "waiting", 1: "waiting", 2: "waiting", 3: "stalled"}
        await wait_until_async(lambda: "stalled" in screen_text(app), 5, "the rank table")
        i = next(i for i, e in enumerate(app.timeline.entries) if e.kind == "stalled")
        entry = app.timeline.entries[i]
        assert entry.ref == d["request"] and "odd rank 3" in entry.text
        app.timeline.focus()
        await pilot.pause()
        app.timeline.highlighted = i
        await pilot.press("enter")
        await wait_until_async(lambda: isinstance(app.screen, StacksScreen), 5, "the stacks")
        assert app.screen.request_id == d["request"]


def screen_text(app: ConsoleApp) -> str:
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


def test_on_stall_restart_restarts_and_the_job_completes(redis_url, r, job_id, tmp_path):
    procs = agents(redis_url, job_id, tmp_path, 2, 2,
                   ["--stall-timeout", "2", "--on-stall", "restart", "--max-restarts", "1"],
                   ["hang", "0"])
    try:
        codes = [a.wait(90) for a in procs]
    finally:
        finish(procs)
    assert codes == [0, 0], [a.output[-3000:] for a in procs]
    (stalled,) = events(r, job_id, EventType.STALLED)
    assert stalled.data["odd_ranks"] == [0] and stalled.data["policy"] == "restart"
    (restarting,) = events(r, job_id, EventType.RESTARTING)
    assert restarting.data["reason"] == "stalled"
    assert restarting.data["restarts_used"] == 1
    assert "no rank made progress" in restarting.data["detail"]
    assert events(r, job_id, EventType.JOB_SUCCEEDED)
    assert r.get(JobKeys(job_id).restarts) == b"1"


@pytest.mark.parametrize("policy,max_restarts", [("stop", "3"), ("restart", "0")],
                         ids=["stop", "restart-with-none-left"])
def test_on_stall_stop_fails_the_job(redis_url, r, job_id, tmp_path, policy, max_restarts):
    procs = agents(redis_url, job_id, tmp_path, 2, 2,
                   ["--stall-timeout", "2", "--on-stall", policy, "--max-restarts", max_restarts],
                   ["hang", "2"])
    try:
        codes = [a.wait(90) for a in procs]
    finally:
        finish(procs)
    assert codes == [1, 1], [a.output[-3000:] for a in procs]
    (failed,) = events(r, job_id, EventType.JOB_FAILED)
    cause = failed.data["root_cause"]
    assert cause["reason"] == "stalled" and cause["rank"] == 2, cause
    assert "no rank made progress" in cause["message"]
    assert r.hget(JobKeys(job_id).meta, "final_state") == b"failed"
    assert not events(r, job_id, EventType.RESTARTING)  # no node spent a restart on it
    assert any("stalled: no rank made progress" in a.output for a in procs)


@pytest.mark.parametrize("script,flags", [
    (["chatty", "3"], ["--stall-timeout", "2"]),  # prints steadily
    (["compute", "3"], ["--stall-timeout", "2"]),  # silent, but its CPU time advances
    (["quiet", "2"], ["--stall-timeout", "0"]),  # silent and idle, but detection is off
], ids=["printing", "computing", "off"])
def test_progress_or_no_detection_is_never_a_stall(redis_url, r, job_id, tmp_path, script,
                                                   flags):
    (agent,) = agents(redis_url, job_id, tmp_path, 1, 1, flags, script)
    try:
        assert agent.wait(60) == 0, agent.output[-3000:]
    finally:
        finish([agent])
    assert events(r, job_id, EventType.JOB_SUCCEEDED)
    assert not events(r, job_id, EventType.STALLED)
    if flags[-1] == "0":
        assert not r.exists(JobKeys(job_id).progress)  # off: not a single write


def test_bad_stall_flags_are_one_line_usage_errors():
    for argv, why in ((["--stall-timeout", "nan"], "not a number of seconds"),
                      (["--stall-timeout", "-1"], "at least 0"),
                      (["--stall-timeout", "soon"], "is not a number"),
                      (["--on-stall", "panic"], "invalid choice")):
        with pytest.raises(UsageError, match=why):
            parse_args([*argv, SCRIPT], {})
    cfg = parse_args([SCRIPT], {})
    assert (cfg.stall_timeout, cfg.on_stall) == (300.0, "observe")


# -- the shared progress hash, directly ------------------------------------------------------

def _watch(client: object, job: str, node: str, timeout_s: float) -> StallWatch:
    return StallWatch(client, client, job, node, "h", timeout_s, "observe", {},
                      lambda *a, **k: None)


def test_hostile_progress_entries_are_ignored_and_a_stall_is_claimed_once(redis_url, r, job_id):
    keys = JobKeys(job_id)
    now_ms = int(time.time() * 1000)
    # Other members' fields: far in the future, not numbers, NaN, infinities, binary.
    r.hset(keys.progress, mapping={"n1": "99999999999999", "n2": "nan", "n3": "inf",
                                   "n4": "garbage", "n5": b"\xff\x00", "n6": "-5",
                                   "n7": "1e400"})
    # The job's shared newest progress, forged far into the future: not progress either.
    r.set(keys.progress_newest, "0 99999999999999")

    async def main() -> None:
        client = make_async_client(parse_endpoint(redis_url))
        try:
            a = _watch(client, job_id, "me", 5)
            b = _watch(client, job_id, "n1", 5)
            started = now_ms - 20_000
            claimed, idle, newest = await a.check(0, started, 10_000)
            assert claimed and 9_000 <= idle <= 15_000, (idle, newest)
            # One claim per stall: another agent (and the claimer again) see it taken.
            assert (await b.check(0, started, 10_000))[0] is False
            assert (await a.check(0, started, 10_000))[0] is False
            # Newer progress (n1 printed 6 s ago), then silence: a new stall, claimed again.
            assert (await a.check(0, started, 0))[0] is False  # (me: progress now)
            r.hset(keys.progress, "me", now_ms - 7_000)  # (as if that was 7 s ago)
            r.set(keys.progress_newest, f"0 {now_ms - 7_000}")
            claimed, idle, _ = await b.check(0, started, 6_000)
            assert claimed and idle >= 5_000
            # A claimer that dies before reporting: its lease runs out, another claims.
            a.lease_ms = 200
            assert (await a.check(1, started, 10_000))[0] is True
            assert (await b.check(1, started, 10_000))[0] is False
            wait_until(lambda: not r.exists(keys.stall(1)), 5, "the lease to run out")
            assert (await b.check(1, started, 10_000))[0] is True
        finally:
            await client.aclose()

    asyncio.run(main())
    assert r.hget(keys.progress, "n1") != b"99999999999999"  # n1's own write replaced it


def test_progress_meter_counts_output_and_cpu_over_the_threshold():
    class W:
        def __init__(self, rank: int, pid: int) -> None:
            self.global_rank, self.pid = rank, pid

    now = [100.0]
    cpu = {1: 0.0}
    outputs: dict[int, float] = {}
    meter = ProgressMeter(outputs, cpu=lambda pid: cpu.get(pid), clock=lambda: now[0])
    meter.reset()
    ws = [W(0, 1)]
    assert meter.sample(ws) == 100.0
    now[0], cpu[1] = 110.0, 0.2  # 2% of a core over 10 s: background noise, not progress
    assert meter.sample(ws) == 100.0
    now[0], cpu[1] = 120.0, 1.2  # 10% of a core: computing
    assert meter.sample(ws) == 120.0
    outputs[0] = 125.0
    now[0] = 130.0
    assert meter.sample(ws) == 125.0  # a line printed at 125
    now[0] = 140.0
    del cpu[1]  # the worker is gone: no progress from it
    assert meter.sample(ws) == 125.0



def test_the_console_state_marks_stalled_ranks_until_they_print_again():
    from elastic_agent.coordination.wire.event_records import encode_event
    from elastic_agent.coordination.wire.log_records import LogBatch
    from elastic_console.job.state import JobView

    v = JobView("job-s")
    seq = iter(range(1, 100))

    def ev(ms: int, etype: str, **data: object) -> None:
        e = decode_event(f"{ms}-0", encode_event(etype, "n-1-x", data, next(seq)))
        assert e is not None
        v.apply_event(e)

    ev(1000, EventType.WORKERS_STARTED, ranks=[0, 1, 2, 3], local_ranks=[0, 1, 2, 3],
       pids=[10, 11, 12, 13], host="h", restart_count=0)
    ev(5000, EventType.STALLED, request="c-abc", idle_s=300.0, policy="observe", round=0,
       odd_ranks=[2, True, "3"], odd_hosts=["h"],  # (a bool and a string are not ranks)
       groups=[{"ranks": [2], "hosts": ["h"], "summary": "sleep ← straggler",
                "frames": [["t.py", 3, "straggler"], "junk"]},
               {"ranks": [0, 1, 3], "hosts": ["h"], "summary": "wait ← all_reduce"}, "junk"])
    assert [v.ranks[r].state for r in range(4)] == ["waiting", "waiting", "stalled", "waiting"]
    entry = v.timeline[-1]
    assert (entry.kind, entry.ref) == ("stalled", "c-abc")
    assert "odd rank 2 on h (sleep ← straggler)" in entry.text
    assert 'File "t.py", line 3, in straggler' in entry.detail
    v.apply_logs(LogBatch("n-1-x", 2, 2, 0, "out", 1, ["back"], id="6000-0"))
    assert v.ranks[2].state == "running"
    v.apply_logs(LogBatch("n-1-x", 0, 0, 0, "out", 1, ["old"], id="4000-0"))  # (from before)
    assert v.ranks[0].state == "waiting"


def test_a_real_gloo_hang_with_on_stall_stop(redis_url, r, job_id, tmp_path):
    """examples/hang.py: rank 3 sleeps before an all_reduce that ranks 0-2 wait in. Once the
    stall stops the job, the other node's ranks fail (their peer is gone): that node must
    find the job over, not spend a restart on it."""
    procs = [Agent(["--redis", redis_url, "--job-id", job_id, "--nnodes", "2",
                    "--nproc-per-node", "2", "--local-addr", "127.0.0.1",
                    "--shutdown-timeout", "2", "--stall-timeout", "2", "--on-stall", "stop",
                    "--max-restarts", "3", str(EXAMPLES / "hang.py")], tmp_path, f"gloo{i}",
                   env={"HANG_RANK": "3"}) for i in range(2)]
    try:
        codes = [a.wait(120) for a in procs]
    finally:
        finish(procs)
    assert codes == [1, 1], [a.output[-3000:] for a in procs]
    (stalled,) = events(r, job_id, EventType.STALLED)
    assert stalled.data["odd_ranks"] == [3], stalled.data
    assert "stall" in stalled.data["groups"][0]["summary"]
    assert "all_reduce" in stalled.data["groups"][1]["summary"]
    (failed,) = events(r, job_id, EventType.JOB_FAILED)
    assert failed.data["root_cause"]["reason"] == "stalled"
    assert not events(r, job_id, EventType.RESTARTING)
    assert r.get(JobKeys(job_id).restarts) in (None, b"0")
