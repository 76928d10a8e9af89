"""Every rank's Python stacks on demand (issue 13), end to end, without root or ptrace.

* Launch paths: a worker started by the exec path (script, ``-m``, ``--run-path``'s ``-c``)
  or forked by a ``--preload`` zygote answers with its frames; one stuck in a C call that
  holds the GIL answers too (faulthandler's handler needs no GIL); a ``--no-python`` worker is
  reported as such, and a worker that exec'd another program is never sent the signal (its
  default action would kill it).
* A real hang: examples/hang.py on 8 gloo ranks over 2 agents, rank 3 sleeping before the
  ``all_reduce`` the others wait in. ``elastic-console stacks`` lists rank 3 alone first, with
  its sleeping frame; the console's ``d`` shows the same; a restart command's
  ``workers_stopped`` events carry the stacks captured before the kill.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import redis

from elastic_agent.coordination.transport.connection import make_async_client
from elastic_agent.coordination.transport.endpoints import parse_endpoint
from elastic_agent.coordination.wire.command_records import Command, encode_command
from elastic_agent.coordination.wire.event_records import EventType
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_agent.coordination.wire.stack_replies import read_stack_replies
from elastic_agent.supervision.config import RUN_PATH_BOOTSTRAP
from elastic_agent.supervision.diagnosis import stacks
from elastic_agent.supervision.launch import probes
from elastic_agent.supervision.launch.worker_env import RankAssignment, WorkerSpec
from elastic_agent.supervision.launch.workers import WorkerGroup
from elastic_agent.supervision.records.log_config import LogConfig, Std
from elastic_agent.supervision.records.logs import NodeLogs
from tests.agents import EXAMPLES, SCRIPTS, Agent, wait_until
from tests.conftest import require
from tests.test_agent import of_type
from tests.test_console_cli import console
from tests.waiting import wait_until_async

STUCK = SCRIPTS / "stuck_in_c.py"
HANG = EXAMPLES / "hang.py"


def line_of(path: Path, needle: str) -> int:
    """The 1-based line of ``path`` holding ``needle`` (the frame a dump must point at)."""
    (n,) = [i for i, text in enumerate(path.read_text().splitlines(), 1) if needle in text]
    return n


# -- launch paths ------------------------------------------------------------------------------

async def dump_group(tmp: Path, entrypoint: list[str], preload: tuple[str, ...] = (),
                     nproc: int = 1, wait_for: str = "stuck",
                     settled: Callable[[list], bool] = lambda dumps: True,
                     ) -> tuple[list, WorkerGroup]:
    """Dump the group's stacks once its workers printed ``wait_for``; dump again while
    ``settled`` says the dumps are not there yet (a worker prints before it enters the call
    the test looks for, and a loaded machine may dump in between)."""
    spec = WorkerSpec(nproc=nproc, entrypoint=entrypoint, run_id="r", job_id="j",
                      log_dir=tmp / "j", preload=preload, shutdown_timeout=2)
    group = WorkerGroup(spec, logs=NodeLogs(LogConfig(redirects=Std.ALL)))
    try:
        await group.prepare()
        await group.start(RankAssignment(group_rank=0, group_world_size=1, world_size=nproc,
                                         base_rank=0, master_addr="127.0.0.1", master_port=1))
        out = [tmp / "j" / "attempt_0" / str(r) / "stdout.log" for r in range(nproc)]
        await wait_until_async(lambda: all(p.exists() and wait_for in p.read_text()
                                           for p in out), 60, "the workers to start")
        dumps = await group.dump_stacks()
        deadline = time.monotonic() + 30
        while not settled(dumps) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            dumps = await group.dump_stacks()
        return dumps, group
    finally:
        await group.stop()
        await group.close()


@pytest.mark.parametrize("how", ["script", "module", "run-path", "preload"])
def test_every_launch_path_answers_even_holding_the_gil(tmp_path, monkeypatch, how):
    monkeypatch.chdir(SCRIPTS)  # -m finds the module in the working directory
    exe = [sys.executable, "-u"]
    entrypoint = {"script": [*exe, str(STUCK)], "preload": [*exe, str(STUCK)],
                  "module": [*exe, "-m", "stuck_in_c"],
                  "run-path": [*exe, "-c", RUN_PATH_BOOTSTRAP, str(STUCK)]}[how]
    preload = ("json",) if how == "preload" else ()
    def in_c(dumps: list) -> bool:
        return "held_in_c" in dumps[0].text

    (dump,), _ = asyncio.run(dump_group(tmp_path, entrypoint, preload, settled=in_c))
    assert not dump.error and not dump.truncated, dump
    rank = stacks.to_rank_stack(dump, "n", "h")
    frames = [f for t in rank.threads for f in t.frames]
    stuck = [f for f in frames if f.function == "held_in_c"]
    assert stuck and stuck[0].file == str(STUCK)
    assert stuck[0].line == line_of(STUCK, "ctypes.PyDLL(None).sleep")
    # the GIL is held, yet the other thread is listed too, and the bootstrap's frames are not
    assert any(f.function == "never_runs" for f in frames)
    assert not any(f.file.endswith("zygote.py") for f in frames)


def test_no_python_and_exec_are_not_signalled(tmp_path):
    async def scenario() -> None:
        (dump,), _ = await dump_group(tmp_path / "a", ["/bin/sh", "-c", "echo stuck; sleep 30"])
        assert dump.error == probes.NOT_PYTHON and not dump.text
        # a Python worker that became another program: its handler is gone with the exec
        code = "import os; print('stuck', flush=True); os.execv('/bin/sleep', ['sleep', '30'])"
        spec = WorkerSpec(nproc=1, entrypoint=[sys.executable, "-u", "-c", code], run_id="r",
                          job_id="j", log_dir=tmp_path / "b" / "j", shutdown_timeout=2)
        group = WorkerGroup(spec, logs=NodeLogs(LogConfig(redirects=Std.ALL)))
        try:
            (w,) = await group.start(RankAssignment(group_rank=0, group_world_size=1,
                                                    world_size=1, base_rank=0,
                                                    master_addr="127.0.0.1", master_port=1))
            await wait_until_async(lambda: psutil.Process(w.pid).name() == "sleep", 30,
                                   "the worker to exec sleep")
            (dump,) = await group.dump_stacks()
            assert dump.error == probes.NO_HANDLER
            await asyncio.sleep(0.3)  # not a wait: a stretch in which a kill would show
            assert psutil.Process(w.pid).status() != psutil.STATUS_ZOMBIE  # not killed
        finally:
            await group.stop()
    asyncio.run(scenario())


# -- a real hang over two agents -----------------------------------------------------------------

@pytest.fixture(scope="module")
def hung_job(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """examples/hang.py, 8 ranks as 2 agents x 4, rank 3 stalled; every other rank inside
    ``all_reduce``. Yields the job id."""
    require("torch")
    tmp = tmp_path_factory.mktemp("hang")
    job = f"hang-{os.getpid()}-{int(time.time())}"
    args = ["--redis", redis_url, "--job-id", job, "--local-addr", "127.0.0.1",
            "--nnodes", "2", "--nproc-per-node", "4", "--log-dir", str(tmp / "logs"),
            "--rdzv-conf=last_call_timeout=1,heartbeat_timeout=5,keep_alive_interval=0.5",
            str(HANG)]
    agents = [Agent(args, tmp, f"a{i}", env={"HANG_RANK": "3"}) for i in range(2)]
    try:
        def hung() -> bool:
            out = "".join(a.output for a in agents)
            return out.count("waiting in all_reduce") >= 7 and "rank 3: stalling" in out
        wait_until(hung, 120, "the hang",
                   explain=lambda: "\n".join(f"--- {a.out_path.name}:\n{a.output[-3000:]}" for a in agents))
        yield job
    finally:
        for a in agents:
            a.kill()


def test_stacks_cli_names_the_odd_rank(hung_job, redis_url):
    p = console("stacks", hung_job, "--json", redis_url=redis_url)
    assert p.returncode == 0, p.stderr
    answer = json.loads(p.stdout)
    odd, rest = answer["groups"]
    assert odd["ranks"] == [3] and rest["ranks"] == [0, 1, 2, 4, 5, 6, 7]
    top = odd["threads"][0]["frames"][0]
    assert (top["file"], top["line"], top["function"]) == (
        str(HANG), line_of(HANG, "time.sleep(seconds)"), "stall")
    assert odd["summary"] == "stall \u2190 train_step \u2190 main"
    assert rest["summary"].startswith("all_reduce \u2190 train_step")
    assert len({s["node"] for s in answer["stacks"]}) == 2  # both agents answered
    text = console("stacks", hung_job, redis_url=redis_url)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("1 rank"))
    assert lines[first].startswith("1 rank [3]: stall \u2190 train_step \u2190 main")
    assert any(f"hang.py:{line_of(HANG, 'time.sleep(seconds)')}" in x for x in lines[first:])
    one = json.loads(console("stacks", hung_job, "--rank", "6", "--json",
                             redis_url=redis_url).stdout)
    assert [g["ranks"] for g in one["groups"]] == [[6]]


def test_console_d_shows_the_odd_group_first(hung_job, redis_url):
    from elastic_console.tui.widgets.stacks import StacksScreen
    from tests.test_console_app import console as app_for
    from tests.test_console_app import loaded, on_screen, run, screen_text
    from tests.waiting import wait_until_async

    async def body(pilot, app) -> None:
        await loaded(app, ranks=8)
        await pilot.press("d")
        await on_screen(app, StacksScreen)
        screen = app.screen
        await wait_until_async(lambda: screen.result is not None or screen.error, 30,
                               "the stacks")
        assert screen.group_lines[0].startswith("1 rank [3]: stall"), screen.group_lines
        await wait_until_async(lambda: "1 rank [3]: stall" in screen_text(app), 5, "drawn")
        where = f"hang.py:{line_of(HANG, 'time.sleep(seconds)')}"
        assert where not in screen_text(app)  # groups start collapsed...
        await pilot.press("enter")  # ...and expand to their frames
        await wait_until_async(lambda: where in screen_text(app), 5, "the frames")
        await pilot.press("escape")
        await on_screen(app, StacksScreen, shown=False)

    run(app_for(redis_url, hung_job), body)


def test_a_restart_captures_the_stacks_before_the_kill(hung_job, redis_url):
    r = redis.Redis.from_url(redis_url)
    r.xadd(JobKeys(hung_job).commands,
           encode_command(Command("restart-h", "restart", "tester@host", args={})))

    def stopped() -> list:
        return [e for e in of_type(r, hung_job, EventType.WORKERS_STOPPED)
                if e.data.get("reason") == "restart"]
    wait_until(lambda: len(stopped()) == 2, 60, "both agents' workers_stopped")
    by_rank = {tuple(g["ranks"]): g for e in stopped() for g in e.data["stacks"]["groups"]}
    (request,) = {e.data["stacks"]["request"] for e in stopped()}
    odd = by_rank[(3,)]
    assert odd["frames"][0] == [str(HANG), line_of(HANG, "time.sleep(seconds)"), "stall"]

    async def published() -> list:
        client = make_async_client(parse_endpoint(redis_url), blocking_ms=2000)
        try:
            return await read_stack_replies(client, hung_job, request, range(8), 10)
        finally:
            await client.aclose()
    captured = asyncio.run(published())
    assert [s.rank for s in captured if s.threads] == list(range(8))
    assert re.fullmatch(r"stop-\d+", request)


def test_stack_signal_flag_and_off(tmp_path):
    from elastic_agent.supervision.config import UsageError, parse_args
    from elastic_agent.supervision.launch.worker_env import worker_argv, worker_env

    base = ["--standalone", "--log-dir", str(tmp_path), str(STUCK)]
    assert parse_args(base).stack_signal == probes.DEFAULT_SIGNAL
    with pytest.raises(UsageError, match="--stack-signal"):
        parse_args(["--stack-signal", "SIGUSR1", *base])
    cfg = parse_args(["--stack-signal", "off", *base])
    a = RankAssignment(group_rank=0, group_world_size=1, world_size=1, base_rank=0,
                       master_addr="127.0.0.1", master_port=1)
    for signum, wrapped in ((None, False), (probes.DEFAULT_SIGNAL, True)):
        spec = WorkerSpec(nproc=1, entrypoint=cfg.entrypoint, run_id="r", job_id="j",
                          log_dir=tmp_path / "j", stack_signal=signum)
        assert ("--worker" in worker_argv(spec, 0)) is wrapped
        assert (probes.STACKS_ENV in worker_env(spec, a, 0, {})) is wrapped


def test_replies_behind_every_nodes_ack_are_all_read(redis_url, r, job_id):
    """Each node acks after publishing its ranks' replies; the acks (one per node) are read
    faster than the replies (one per rank): every reply in the stream's tail after the last
    ack is still read, however many reads long it is."""
    from elastic_agent.coordination.wire.event_records import encode_event
    from elastic_agent.coordination.wire.trace_records import StackReply, encode_stack_reply

    keys = JobKeys(job_id)
    request = "c-0123456789ab"
    nodes = [f"n{i}" for i in range(4)]
    ranks = 600  # 150 a node: more than one read (128 entries) behind the acks
    for i, node in enumerate(nodes):
        for rank in range(i * 150, (i + 1) * 150):
            r.xadd(keys.stacks, encode_stack_reply(StackReply(
                request=request, node=node, host="h", rank=rank, pid=1000 + rank,
                text='Thread 0x01 (most recent call first):\n  File "t.py", line 1 in f\n',
                error="")))
        r.xadd(keys.events, encode_event(EventType.COMMAND_ACK, node, {
            "command_id": request, "status": "done", "reason": "published"}))

    async def read() -> list:
        client = make_async_client(parse_endpoint(redis_url), blocking_ms=30_000)
        try:
            return await read_stack_replies(client, job_id, request, range(ranks), 20,
                                            since="0-0", events_since="0-0",
                                            expected_nodes=nodes)
        finally:
            await client.aclose()

    got = asyncio.run(read())
    missing = [s.rank for s in got if not s.threads]
    assert not missing, f"{len(missing)} of {ranks} replies not read ({missing[:5]}...)"


def test_the_replies_of_a_job_larger_than_the_streams_floor_are_all_kept(redis_url, r, job_id):
    """The stacks stream's cap grows with the job: one request's replies of 12,000 ranks are
    all there for a reader that is behind (a fixed cap of 10,000 trimmed the first ones)."""
    from elastic_agent.coordination.wire.stack_dumps import RankStack, parse_faulthandler

    ranks = 12_000
    threads = parse_faulthandler('Thread 0x01 (most recent call first):\n'
                                 '  File "t.py", line 1 in f\n')
    collector = stacks.StackCollector(None, make_async_client(parse_endpoint(redis_url)),
                                      job_id, "n0", "h")
    collector.world_size = ranks

    async def publish() -> None:
        try:
            await collector.publish("c-0123456789ab",
                                    [RankStack(k, "n0", "h", 1000 + k, threads)
                                     for k in range(ranks)])
        finally:
            await collector.client.aclose()

    asyncio.run(publish())
    assert r.xlen(JobKeys(job_id).stacks) == ranks
