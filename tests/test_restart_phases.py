"""The restart's phases (issue 23): what the agent records, what the console shows, and the
two changes of the restart's path that keep the evidence: the stacks capture that ends when
the workers' handler has returned, not after a silence, and the keeper started ahead.

Speed goals live in bench/launch_bench.py (phase by phase, next to torchrun); these tests
check that the marks exist, are ordered and mean what they say.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import textwrap

import pytest

from elastic_agent.coordination.wire.event_records import (
    RESTART_PHASES,
    EventType,
    decode_event,
    encode_event,
)
from elastic_agent.supervision.launch import probes
from elastic_agent.supervision.records.events import RestartClock
from elastic_console.job.restarts import restart_took
from elastic_console.job.state import JobView
from tests.agents import EXAMPLES, Agent
from tests.test_agent import FAST, of_type

SIG = int(probes.DEFAULT_SIGNAL)


# -- the agent's record ----------------------------------------------------------------------

def test_the_clock_keeps_each_phases_first_mark_in_order():
    clock = RestartClock("failed")
    clock.mark("evidence")
    clock.mark("stopped")
    first = clock.marks["stopped"]
    clock.mark("stopped", at=clock._t0 + 3600)  # a second mark of a phase changes nothing
    clock.mark("started")
    record = clock.record()
    assert record["reason"] == "failed"
    assert list(record["phases_ms"]) == ["evidence", "stopped", "started"]  # the protocol's order
    assert record["phases_ms"]["stopped"] == first
    assert abs(record["detected_at"] - clock.detected_at) < 1e-3
    with pytest.raises(ValueError):
        clock.mark("lunch")


def test_a_restart_after_a_failure_carries_every_phase_in_order(redis_url, r, job_id, tmp_path):
    stamps = tmp_path / "stamps"
    agent = Agent(["--redis", redis_url, "--job-id", job_id, "--local-addr", "127.0.0.1",
                   "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir",
                   str(tmp_path / "logs"), FAST, str(EXAMPLES / "crash_timing.py"),
                   "--out", str(stamps), "--crash-after", "0.5"], tmp_path, "a")
    try:
        assert agent.wait(90) == 0, agent.output[-3000:]
    finally:
        agent.kill()
    first, second = of_type(r, job_id, EventType.WORKERS_STARTED)
    assert "restart" not in first.data  # the first start is no restart
    restart = second.data["restart"]
    assert restart["reason"] == "failed"
    phases = restart["phases_ms"]
    assert list(phases) == list(RESTART_PHASES)
    values = list(phases.values())
    assert values == sorted(values) and values[0] >= 0, phases
    # The failure was seen after the worker's exit was reaped, and before the restart ended.
    crashed = next(e for e in of_type(r, job_id, EventType.WORKER_EXITED)
                   if e.data["exit_code"] == 1)
    assert crashed.data["timestamp"] <= restart["detected_at"] + 0.01
    assert restart["detected_at"] * 1000 <= second.server_ms + 50  # same host's clock
    # The evidence is still there: the survivor's stacks, captured before the stop.
    (stopped,) = [e for e in of_type(r, job_id, EventType.WORKERS_STOPPED)
                  if e.data["reason"] == "failed"]
    frames = [f for g in stopped.data["stacks"]["groups"] for f in g["frames"]]
    assert any(f[0].endswith("crash_timing.py") for f in frames), stopped.data["stacks"]


# -- the console -----------------------------------------------------------------------------

def _started(**restart) -> object:
    ev = decode_event("5-0", encode_event(
        EventType.WORKERS_STARTED, "a-1-x", {"ranks": [0], "local_ranks": [0], "pids": [9],
                                            "restart_count": 1, "attempt": 1, "host": "a",
                                            **({"restart": restart} if restart else {})}))
    assert ev is not None
    return ev


def test_the_timeline_shows_how_long_the_restart_took_and_where():
    v = JobView("j")
    v.apply_event(_started(reason="failed", detected_at=1.0, phases_ms={
        "evidence": 4, "stopped": 40.4, "reported": 43, "rendezvous": 46, "keeper": 60,
        "started": 95.2}))
    entry = v.timeline[-1]
    assert entry.kind == "restarted"
    assert entry.text == ("workers on a running again 95 ms after the failure was seen "
                          "(evidence 4, stopped 36, reported 3, rendezvous 3, keeper 14, "
                          "started 35 ms)")
    assert "workers stopped: +36 ms (at 40 ms)" in entry.detail
    v.apply_event(_started())  # a first start: nothing to say
    assert len(v.timeline) == 1


@pytest.mark.parametrize("bad", [
    None, [], "fast", {"phases_ms": []}, {"phases_ms": {}}, {"phases_ms": {"stopped": -1}},
    {"phases_ms": {"stopped": math.nan}}, {"phases_ms": {"stopped": "soon"}},
    {"phases_ms": {"stopped": 1e300}}, {"phases_ms": {"lunch": 5}},
])
def test_a_restart_record_that_makes_no_sense_is_not_shown(bad):
    assert restart_took(bad) is None


def test_hostile_reason_is_escaped_and_bounded():
    line, detail = restart_took({"reason": ["x"] * 3 + ["\x1b]0;pwned\x07" * 50],
                                 "phases_ms": {"started": 7}})
    assert "\x1b" not in line and "\x1b" not in detail and len(line) < 200


# -- the stacks capture ends with the handler --------------------------------------------------

BLOCKER = textwrap.dedent("""
    import faulthandler, os, signal, sys
    fd = os.open(sys.argv[1], os.O_WRONLY)
    faulthandler.register(int(sys.argv[2]), file=fd, all_threads=True, chain=False)
    signal.pthread_sigmask(signal.SIG_BLOCK, [int(sys.argv[2])])
    print("blocked", flush=True)
    sys.stdin.readline()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [int(sys.argv[2])])  # the handler runs here
    print("unblocked", flush=True)
    sys.stdin.readline()
""")


def test_handler_done_follows_the_signal_from_pending_to_handled(tmp_path):
    out = tmp_path / "dump"
    out.touch()
    proc = subprocess.Popen([sys.executable, "-c", BLOCKER, str(out), str(SIG)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "blocked\n"
        before = probes.blocking_threads(proc.pid, SIG)
        assert before is not None and proc.pid in before  # its main thread blocks it
        os.kill(proc.pid, SIG)
        # Pending (blocked everywhere): the handler has not run, whatever ``before`` says.
        assert not probes.handler_done(proc.pid, SIG, frozenset())
        assert not probes.handler_done(proc.pid, SIG, before)
        assert out.read_text() == ""
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "unblocked\n"
        assert "Current thread" in out.read_text()  # the dump, written by the handler
        assert probes.handler_done(proc.pid, SIG, frozenset())
    finally:
        proc.kill()
        proc.wait()


def test_a_dump_ends_when_the_handler_returns_not_after_a_silence(tmp_path, monkeypatch):
    """With the silence made endless, only the handler's end can complete the capture: a
    capture that waited for silence would hang here (the deadline catches the hang)."""
    monkeypatch.setattr(probes, "QUIET_S", 3600.0)
    script = tmp_path / "threads.py"
    script.write_text(textwrap.dedent("""
        import threading, time
        def deep(n):
            return deep(n - 1) if n else time.sleep(3600)
        for i in range(20):
            threading.Thread(target=deep, args=(40,), daemon=True).start()
        print("ready", flush=True)
        time.sleep(3600)
    """))

    async def capture() -> probes.LocalDump:
        fifo = tmp_path / "run" / "s.fifo"
        fifo.parent.mkdir(mode=0o700)
        pipe = await probes.StackPipe.connect(probes.open_fifo(fifo, tmp_path))
        env = {**os.environ, **probes.worker_vars(SIG, fifo)}
        proc = await asyncio.create_subprocess_exec(
            *probes.boot_argv([sys.executable, "-u", str(script)]), env=env,
            stdout=asyncio.subprocess.PIPE)
        try:
            assert await asyncio.wait_for(proc.stdout.readline(), 60) == b"ready\n"
            (dump,) = await asyncio.wait_for(probes.dump_workers(
                [(0, 0, proc.pid, True, pipe)], SIG, timeout=3600), 60)
            return dump
        finally:
            proc.kill()
            await proc.wait()
            pipe.close()

    dump = asyncio.run(capture())
    assert dump.error == "" and not dump.truncated
    threads = [t for t in dump.text.split("\n\n") if t.strip()]
    assert len(threads) == 21, dump.text[-2000:]  # every thread, the last one whole
    assert dump.text.count("in deep") == 20 * 41


def test_a_process_whose_proc_cannot_be_read_is_never_called_done():
    assert probes.blocking_threads(2**22 + 12345, SIG) is None  # no such process
    assert not probes.handler_done(2**22 + 12345, SIG, frozenset())
