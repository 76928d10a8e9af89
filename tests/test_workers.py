"""The local worker group with real processes: environment, exits, error files, stops."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from elastic_agent.supervision.launch.exits import GroupResult, WorkerExit, WorkerStartError, WorkerState
from elastic_agent.supervision.launch.worker_env import (
    RankAssignment,
    WorkerSpec,
    error_file_path,
    worker_env,
)
from elastic_agent.supervision.launch.workers import WorkerGroup
from elastic_agent.supervision.records.logs import NodeLogs
from tests.conftest import require
from tests.waiting import wait_until_async

pytestmark = pytest.mark.asyncio

TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stdout_of(tmp_path: Path, rank: int, attempt: int = 0) -> str:
    path = tmp_path / f"attempt_{attempt}" / str(rank) / "stdout.log"
    return path.read_text(errors="replace") if path.exists() else ""


async def wait_for_output(tmp_path: Path, local_rank: int, text: str) -> str:
    return await wait_until_async(lambda: text in stdout_of(tmp_path, local_rank) and
                            stdout_of(tmp_path, local_rank), what=f"{text!r} from the worker")


def make_spec(tmp_path: Path, code: str, nproc: int = 1, **kw: Any) -> WorkerSpec:
    kw.setdefault("shutdown_timeout", 5.0)
    return WorkerSpec(nproc=nproc,
                      entrypoint=[sys.executable, "-u", "-c", textwrap.dedent(code)],
                      run_id="job-1", job_id="job-1", redis_url="redis://127.0.0.1:1",
                      log_dir=tmp_path, **kw)


def assignment(nproc: int = 1, **kw: Any) -> RankAssignment:
    args: dict[str, Any] = dict(group_rank=0, group_world_size=1, world_size=nproc,
                                base_rank=0, master_addr="127.0.0.1", master_port=29500)
    args.update(kw)
    return RankAssignment(**args)


def quiet_logs() -> NodeLogs:
    return NodeLogs(stdout=io.BytesIO(), stderr=io.BytesIO())


class Group:
    """A WorkerGroup that records its exits, stopped at the end of the test."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.exits: list[WorkerExit] = []
        self.group = WorkerGroup(spec, logs=quiet_logs(), on_exit=self.exits.append)

    async def __aenter__(self) -> WorkerGroup:
        return self.group

    async def __aexit__(self, *exc: object) -> None:
        await self.group.stop(timeout=1)
        await self.group.close()  # the keeper started ahead for a next attempt, too


# -- environment ----------------------------------------------------------------------------

async def test_worker_env_is_torchruns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compare with the env torch's own LocalElasticAgent builds for the same placement."""
    lea = require("torch.distributed.elastic.agent.server.local_elastic_agent")
    from torch.distributed.elastic.agent.server import api as tapi
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    for var in ("OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_HEALTH_CHECK_PORT"):
        monkeypatch.delenv(var, raising=False)
    base_env = dict(os.environ)

    class Rdzv:
        use_agent_store = False

        def get_run_id(self) -> str:
            return "job-1"

        def get_backend(self) -> str:
            return "redis"

    captured: dict[str, Any] = {}

    class NoProcesses:
        def pids(self) -> dict[int, int]:
            return {}

    def fake_start_processes(**kw: Any) -> NoProcesses:
        captured.update(kw)
        return NoProcesses()

    monkeypatch.setattr(lea, "start_processes", fake_start_processes)
    tspec = tapi.WorkerSpec(role="trainer", local_world_size=2, rdzv_handler=Rdzv(),
                            entrypoint="python", args=("x.py",), max_restarts=3)
    logs_specs = DefaultLogsSpecs(log_dir=str(tmp_path / "torch"))
    agent = lea.LocalElasticAgent(tspec, logs_specs=logs_specs, start_method="spawn")
    wg = agent._worker_group
    wg.store, wg.group_rank, wg.group_world_size = object(), 1, 2
    wg.master_addr, wg.master_port = "10.0.0.1", 29500
    wg.workers = [tapi.Worker(local_rank=i, global_rank=2 + i, role_rank=2 + i, world_size=4,
                              role_world_size=4) for i in range(2)]
    agent._remaining_restarts = 1  # restart_count = max_restarts - remaining = 2
    # torchrun's run.py sets OMP_NUM_THREADS=1 in its own environment when nproc > 1.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    agent._start_workers(wg)
    torch_envs = captured["envs"]
    logs_specs.reify(torch_envs)  # adds TORCHELASTIC_ERROR_FILE, as torch does

    spec = WorkerSpec(role="trainer", nproc=2, entrypoint=["python", "x.py"], max_restarts=3,
                      run_id="job-1", redis_url="redis://h:1", job_id="job-1",
                      log_dir=tmp_path / "ours")
    a = RankAssignment(group_rank=1, group_world_size=2, world_size=4, base_rank=2,
                       master_addr="10.0.0.1", master_port=29500, restart_count=2, attempt=2)
    for lr in range(2):
        ours = worker_env(spec, a, lr, base_env)
        theirs = {**os.environ, **torch_envs[lr]}  # workers inherit the agent's environment
        for var in (*TORCHRUN_VARS, "OMP_NUM_THREADS"):
            assert var in ours, var
            if var != "TORCHELASTIC_ERROR_FILE":
                assert ours[var] == theirs[var], var
        # torch's DefaultLogsSpecs layout below the run directory: attempt, then local rank
        tail = f"/attempt_2/{lr}/error.json"
        assert theirs["TORCHELASTIC_ERROR_FILE"].endswith(tail)
        assert ours["TORCHELASTIC_ERROR_FILE"] == str(tmp_path / "ours") + tail
        # torchrun's launcher (not the agent) sets TORCHELASTIC_SIGNALS_TO_HANDLE in its own
        # environment, which workers inherit: tests/test_torchrun_parity.py runs both whole.
        assert set(ours) - set(theirs) == {"ELASTIC_REDIS_URL", "ELASTIC_JOB_ID",
                                           "TORCHELASTIC_SIGNALS_TO_HANDLE"}
        assert set(theirs) - set(ours) == set()
        assert ours["ELASTIC_REDIS_URL"] == "redis://h:1" and ours["ELASTIC_JOB_ID"] == "job-1"


async def test_worker_env_formats_and_omp_rule(tmp_path: Path) -> None:
    spec = WorkerSpec(nproc=2, entrypoint=["x"], run_id="r", job_id="j", log_dir=tmp_path,
                      use_agent_store=True, extra_env={"EXTRA": "1", "RANK": "overridden"})
    a = assignment(2, base_rank=6, world_size=8, group_rank=3, group_world_size=4,
                   restart_count=1, attempt=5)
    env = worker_env(spec, a, 1, {"PATH": "/bin"})
    assert env["RANK"] == "7" and env["LOCAL_RANK"] == "1" and env["ROLE_RANK"] == "7"
    assert env["GROUP_RANK"] == "3" and env["WORLD_SIZE"] == "8"
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert env["OMP_NUM_THREADS"] == "1" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["EXTRA"] == "1" and env["PATH"] == "/bin"
    assert env["TORCHELASTIC_ERROR_FILE"] == str(tmp_path / "attempt_5" / "1" / "error.json")
    user = worker_env(spec, a, 0, {"OMP_NUM_THREADS": "4",
                                   "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    assert user["OMP_NUM_THREADS"] == "4" and user["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    single = WorkerSpec(nproc=1, entrypoint=["x"], run_id="r", job_id="j", log_dir=tmp_path)
    assert "OMP_NUM_THREADS" not in worker_env(single, assignment(), 0, {})


async def test_spawned_workers_get_worker_env(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spec = make_spec(tmp_path, """
        import json, os
        print(json.dumps(dict(os.environ)))
    """, nproc=2)
    a = assignment(2)
    async with Group(spec) as group:
        infos = await group.start(a)
        assert [(w.local_rank, w.global_rank) for w in infos] == [(0, 0), (1, 1)]
        assert (await group.wait()).state is WorkerState.SUCCEEDED
        await group.stop()
    for lr in range(2):
        seen = json.loads(stdout_of(tmp_path, lr))
        expected = worker_env(spec, a, lr, os.environ)
        # Python may add LC_CTYPE at start-up (PEP 538 locale coercion); nothing else differs.
        assert set(seen) - set(expected) <= {"LC_CTYPE"}
        assert {k: v for k, v in seen.items() if k != "LC_CTYPE"} == {
            k: v for k, v in expected.items() if k != "LC_CTYPE"}
        for var in (*TORCHRUN_VARS, "OMP_NUM_THREADS", "ELASTIC_REDIS_URL", "ELASTIC_JOB_ID"):
            assert var in seen, var


# -- exits -----------------------------------------------------------------------------------

async def test_exit_code_fails_the_group(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, """
        import os, sys, time
        if os.environ["LOCAL_RANK"] == "1":
            sys.exit(3)
        time.sleep(60)
    """, nproc=2)
    g = Group(spec)
    async with g as group:
        await group.start(assignment(2))
        result = await asyncio.wait_for(group.wait(), 10)
        assert result.state is WorkerState.FAILED
        assert [(f.global_rank, f.exit_code, f.signal, f.message) for f in result.failures] == [
            (1, 3, None, "exit code 3")]
        assert result.root_cause is result.failures[0]
        assert g.exits[0].global_rank == 1 and not g.exits[0].stopping
        await group.stop()
    # The survivor was stopped by us, and says so.
    assert [(e.global_rank, e.signal, e.stopping) for e in g.exits[1:]] == [
        (0, "SIGTERM", True)]
    assert group.state is WorkerState.FAILED


async def test_sigkilled_worker(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, """
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    async with Group(spec) as group:
        await group.start(assignment())
        result = await asyncio.wait_for(group.wait(), 10)
    (failure,) = result.failures
    assert (failure.exit_code, failure.signal, failure.message) == (
        -9, "SIGKILL", "Signal 9 (SIGKILL)")
    assert failure.error_file is None


async def test_error_file_message(tmp_path: Path) -> None:
    # Written by hand in torch's @record format (rank 0) and the plain form (rank 1).
    spec = make_spec(tmp_path, """
        import json, os, sys, time
        path = os.environ["TORCHELASTIC_ERROR_FILE"]
        if os.environ["LOCAL_RANK"] == "0":
            data = {"message": {"message": "ValueError: boom",
                                "extraInfo": {"py_callstack": "Traceback ...",
                                              "timestamp": str(int(time.time()))}}}
        else:
            time.sleep(0.2)
            data = {"message": "plain message", "timestamp": 0}
        with open(path, "w") as f:
            json.dump(data, f)
        sys.exit(1)
    """, nproc=2)
    g = Group(spec)
    async with g as group:
        await group.start(assignment(2))
        result = await asyncio.wait_for(group.wait(), 10)
        await wait_until_async(lambda: len(g.exits) == 2, what="both exits")
    first = result.failures[0]
    assert first.message == "ValueError: boom"
    assert first.error_file is not None
    assert first.error_file["message"]["extraInfo"]["py_callstack"] == "Traceback ..."
    assert first.error_file_path == str(tmp_path / "attempt_0" / "0" / "error.json")
    assert g.exits[1].message == "plain message"


async def test_stale_error_file_is_deleted_at_start(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "import sys; sys.exit(2)")
    stale = error_file_path(spec, assignment(), 0)
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"message": "from an earlier run"}))
    async with Group(spec) as group:
        await group.start(assignment())
        result = await asyncio.wait_for(group.wait(), 10)
    # The worker wrote no error file, so none is there now: the earlier run's was removed.
    assert not stale.exists()
    assert result.failures[0].error_file is None
    assert result.failures[0].message == "exit code 2"


async def test_all_exit_zero_succeeds(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "print('bye')", nproc=3)
    g = Group(spec)
    async with g as group:
        await group.start(assignment(3))
        result = await asyncio.wait_for(group.wait(), 10)
        assert result == GroupResult(WorkerState.SUCCEEDED, (), result.exits)
        assert sorted(e.global_rank for e in result.exits) == [0, 1, 2]
        await group.stop()
    assert all(stdout_of(tmp_path, lr) == "bye\n" for lr in range(3))
    assert group.state is WorkerState.SUCCEEDED


async def test_exit_is_noticed_when_it_happens(tmp_path: Path) -> None:
    """A kill reaches wait() by itself. How soon (no polling tick) is a speed goal: the
    bound here only catches an exit that is never noticed."""
    spec = make_spec(tmp_path, """
        import time
        print("ready")
        time.sleep(60)
    """)
    async with Group(spec) as group:
        (info,) = await group.start(assignment())
        await wait_for_output(tmp_path, 0, "ready")
        waiter = asyncio.create_task(group.wait())
        await asyncio.sleep(0.3)  # let a hypothetical polling loop fall out of phase
        t_wall = time.time()
        os.kill(info.pid, signal.SIGKILL)
        result = await asyncio.wait_for(waiter, 5)
    assert result.state is WorkerState.FAILED
    assert result.failures[0].signal == "SIGKILL"
    assert result.failures[0].timestamp >= t_wall  # stamped when the exit was seen


async def test_exit_is_noticed_while_a_child_holds_the_pipes(tmp_path: Path) -> None:
    """A worker's leftover child keeps stdout open: the worker's exit is still seen."""
    spec = make_spec(tmp_path, """
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("child", child.pid)
        sys.exit(4)
    """)
    async with Group(spec) as group:
        await group.start(assignment())
        result = await asyncio.wait_for(group.wait(), 5)
        assert result.failures[0].exit_code == 4
        child = int(re.findall(r"child (\d+)\n", stdout_of(tmp_path, 0))[0])
        assert alive(child)
        await group.stop()
    assert not alive(child)


# -- stop and signals ------------------------------------------------------------------------

async def test_stop_kills_a_worker_that_ignores_sigterm(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready")
        time.sleep(60)
    """, shutdown_timeout=0.5)
    g = Group(spec)
    async with g as group:
        (info,) = await group.start(assignment())
        await wait_for_output(tmp_path, 0, "ready")
        t0 = time.perf_counter()
        await group.stop()
        elapsed = time.perf_counter() - t0
        assert 0.5 <= elapsed < 5, elapsed
        assert (await group.wait()).state is WorkerState.STOPPED
    assert not alive(info.pid)
    assert [(e.signal, e.stopping) for e in g.exits] == [("SIGKILL", True)]


async def test_stop_leaves_no_process_behind(tmp_path: Path) -> None:
    """Grandchildren that left the worker's session and group are ended too."""
    spec = make_spec(tmp_path, """
        import os, signal, subprocess, sys, time
        setsid_child = (
            "import os, signal, time\\n"
            "os.setsid()\\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
            "os.write(1, b'grandchild %d\\\\n' % os.getpid())\\n"
            "time.sleep(60)\\n")
        subprocess.Popen([sys.executable, "-c", setsid_child])
        if os.fork() == 0:  # a classic daemon: double fork, new session, stdio closed
            os.setsid()
            if os.fork() == 0:
                os.setsid()  # out of the intermediate's group too: only its env betrays it
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                os.write(1, b"daemon %d\\n" % os.getpid())
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                time.sleep(60)
            os._exit(0)
        os.write(1, b"worker ready\\n")
        time.sleep(60)
    """, shutdown_timeout=0.5)
    async with Group(spec) as group:
        (info,) = await group.start(assignment())
        # Three processes share the pipe: each line is one write (a print under -u is
        # several, and two processes' lines interleaved, so the pattern never matched).
        pattern = re.compile(r"^(grandchild|daemon) (\d+)$", re.M)
        await wait_until_async(lambda: len(pattern.findall(stdout_of(tmp_path, 0))) == 2
                         and "worker ready\n" in stdout_of(tmp_path, 0),
                         what="the process tree")
        pids = {name: int(pid) for name, pid in pattern.findall(stdout_of(tmp_path, 0))}
        worker_sid = os.getsid(info.pid)
        assert all(os.getsid(pid) != worker_sid for pid in pids.values())
        assert all(alive(pid) for pid in pids.values())
        await group.stop()
        await group.stop()  # idempotent
    assert not alive(info.pid)
    assert [name for name, pid in pids.items() if alive(pid)] == []


async def test_stop_finds_an_orphan_after_its_worker_exited(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, """
        import os, signal, time
        ready_r, ready_w = os.pipe()
        if os.fork() == 0:
            os.close(ready_r)
            os.setsid()
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            print("orphan", os.getpid(), flush=True)
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.close(ready_w)
            time.sleep(60)
        else:
            os.close(ready_w)
            os.read(ready_r, 1)  # EOF: the orphan has printed its pid and let go of stdout
    """, shutdown_timeout=0.3)
    async with Group(spec) as group:
        await group.start(assignment())
        result = await asyncio.wait_for(group.wait(), 10)
        assert result.state is WorkerState.SUCCEEDED
        orphan = int(re.findall(r"orphan (\d+)\n", stdout_of(tmp_path, 0))[0])
        assert alive(orphan)
        await group.stop()
    assert not alive(orphan)


async def test_signal_rank(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, """
        import time
        print("ready")
        time.sleep(60)
    """, nproc=2)
    async with Group(spec) as group:
        await group.start(assignment(2, base_rank=4, world_size=6))
        await wait_for_output(tmp_path, 1, "ready")  # directories are by local rank
        with pytest.raises(LookupError):
            await group.signal_rank(0, "SIGTERM")
        with pytest.raises(ValueError, match="unknown signal"):
            await group.signal_rank(5, "SIGNOPE")
        assert await group.signal_rank(5, "SIGTERM") is True
        result = await asyncio.wait_for(group.wait(), 5)
        assert [(f.global_rank, f.signal) for f in result.failures] == [(5, "SIGTERM")]
        assert await group.signal_rank(5, signal.SIGKILL) is False


async def test_start_failure_and_next_attempt(tmp_path: Path) -> None:
    bad = WorkerSpec(nproc=2, entrypoint=[str(tmp_path / "no-such-binary")], run_id="r",
                     job_id="j", log_dir=tmp_path)
    group = WorkerGroup(bad, logs=quiet_logs())
    with pytest.raises(WorkerStartError, match="no-such-binary"):
        await group.start(assignment(2))

    spec = make_spec(tmp_path, """
        import os
        print(os.environ["TORCHELASTIC_RESTART_COUNT"])
    """)
    async with Group(spec) as group:
        await group.start(assignment())
        with pytest.raises(RuntimeError, match="stop"):
            await group.start(assignment())
        assert (await group.wait()).state is WorkerState.SUCCEEDED
        await group.stop()
        await group.start(assignment(restart_count=1, attempt=1))
        assert (await group.wait()).state is WorkerState.SUCCEEDED
        await group.stop()
    assert stdout_of(tmp_path, 0, attempt=0) == "0\n"
    assert stdout_of(tmp_path, 0, attempt=1) == "1\n"


# -- the keeper started ahead of time (issue 23) ----------------------------------------------

async def _spare_pid(group: WorkerGroup) -> int:
    """The pid of the keeper the group started ahead for its next attempt."""
    await wait_until_async(lambda: group._spare is not None and group._spare.done(),
                           what="the next attempt's keeper started")
    assert group._spare is not None
    return group._spare.result().process.get_pid()


async def test_the_next_attempt_runs_on_the_keeper_started_ahead(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("elastic_agent.supervision.launch.workers.SPARE_DELAY", 0.0)
    spec = make_spec(tmp_path, """
        import os, time
        print(os.getppid(), flush=True)
        time.sleep(60)
    """, nproc=2)
    async with Group(spec) as group:
        await group.prepare()  # before the rendezvous: the first attempt's keeper
        first = await _spare_pid(group)
        await group.start(assignment(2))
        assert group._keeper is not None and group._keeper.pid == first
        ahead = await _spare_pid(group)  # the next one, while this attempt runs
        assert ahead != first and alive(ahead)
        for rank in range(2):
            await wait_for_output(tmp_path, rank, "\n")
        assert int(stdout_of(tmp_path, 0)) == first  # the workers' parent: that keeper
        await group.stop()  # returns once the keeper has ended the tree; it exits after
        await wait_until_async(lambda: not alive(first), what="the first keeper gone")
        await group.start(assignment(2, attempt=1))
        assert group._keeper.pid == ahead
        await wait_until_async(lambda: all(stdout_of(tmp_path, rank, attempt=1).endswith("\n")
                                           for rank in range(2)), what="attempt 1")
        assert int(stdout_of(tmp_path, 0, attempt=1)) == ahead
        spare = await _spare_pid(group)
        await group.stop()
        await group.close()
        assert not alive(ahead)  # close waits for the last keeper's own exit
        # Closing the group ends the idle keeper too: no process is left behind.
        await wait_until_async(lambda: not alive(spare), what="the idle keeper gone")


async def test_a_dead_spare_keeper_is_replaced_at_start(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("elastic_agent.supervision.launch.workers.SPARE_DELAY", 0.0)
    spec = make_spec(tmp_path, """
        import os
        print(os.getppid(), flush=True)
    """)
    async with Group(spec) as group:
        await group.prepare()
        dead = await _spare_pid(group)
        os.kill(dead, signal.SIGKILL)
        await wait_until_async(lambda: not alive(dead), what="the spare keeper killed")
        await group.start(assignment())
        assert (await group.wait()).state is WorkerState.SUCCEEDED
        keeper_pid = int(stdout_of(tmp_path, 0))
        assert keeper_pid != dead and group._keeper is not None
        assert keeper_pid == group._keeper.pid


async def test_no_spare_keeper_after_success(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "print('done')")
    async with Group(spec) as group:
        await group.start(assignment())
        assert (await group.wait()).state is WorkerState.SUCCEEDED
        await group.stop()
        assert group._spare is None  # no next attempt: nothing started ahead for it


async def test_stop_ends_a_process_outside_the_tree_by_the_workers_marker(tmp_path: Path) -> None:
    """A process that is no descendant of the keeper (started through some other daemon)
    but carries a worker's error file path in its environment is ended by the stop: the
    raw /proc/PID/environ search finds it."""
    spec = make_spec(tmp_path, """
        import time
        print("up", flush=True)
        time.sleep(60)
    """)
    async with Group(spec) as group:
        await group.start(assignment())
        await wait_for_output(tmp_path, 0, "up")
        marker = str(error_file_path(spec, assignment(), 0))
        outsider = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
            env={**os.environ, "TORCHELASTIC_ERROR_FILE": marker})
        try:
            await wait_until_async(
                lambda: marker.encode() in Path(f"/proc/{outsider.pid}/environ").read_bytes(),
                what="the outsider started")
            await group.stop()
            await wait_until_async(lambda: outsider.poll() is not None, what="the outsider ended")
            assert outsider.returncode == -signal.SIGTERM
        finally:
            outsider.kill()
            outsider.wait()


async def test_a_request_larger_than_the_sockets_buffer_reaches_the_keeper_whole(
        tmp_path: Path) -> None:
    """The request goes to an idle keeper without a thread: what its socket's buffer does
    not take at once follows as room comes (4 workers x 100 kB of environment here)."""
    big = "x" * 100_000
    spec = make_spec(tmp_path, """
        import os
        print(len(os.environ["BIG"]), os.environ["RANK"], flush=True)
    """, nproc=4, extra_env={"BIG": big})
    async with Group(spec) as group:
        await group.prepare()
        await group.start(assignment(4))
        assert (await asyncio.wait_for(group.wait(), 60)).state is WorkerState.SUCCEEDED
    assert [stdout_of(tmp_path, rank) for rank in range(4)] == [
        f"100000 {rank}\n" for rank in range(4)]


async def test_a_stop_walks_every_process_once(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop's search of /proc for the workers' tree runs once, while they shut down;
    after they are gone the keeper ends what is left of the tree and the search looks only
    for the workers' markers outside it."""
    from elastic_agent.supervision.launch import keeper

    walks = []
    walk = keeper.parents
    monkeypatch.setattr(keeper, "parents", lambda: walks.append(1) or walk())
    spec = make_spec(tmp_path, """
        import time
        print("up", flush=True)
        time.sleep(60)
    """, nproc=2)
    async with Group(spec) as group:
        await group.start(assignment(2))
        for rank in range(2):
            await wait_for_output(tmp_path, rank, "up")
        await group.stop()
        assert not any(w.pid and alive(w.pid) for w in group.workers)
    assert len(walks) == 1
