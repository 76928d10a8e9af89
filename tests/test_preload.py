"""--preload (issue 14): workers forked from a warm zygote behave as ``python -u script.py``.

The equivalence tests run the same probe (tests/scripts/preload/probe.py) through a
WorkerGroup with and without ``preload`` and compare everything it reports, its output, its
exit status and its error file; the probe also says (on stderr, not compared) whether it was
forked, so a silent fall-back to exec cannot pass for equivalence. The torch test runs two
real agents with ``--preload torch``: gloo across forked workers, a crash restarted through
the zygote, a DataLoader with workers and torch.multiprocessing.spawn inside a forked worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from elastic_agent.supervision.config import UsageError, parse_args
from elastic_agent.supervision.launch import zygote
from elastic_agent.supervision.launch.exits import GroupResult
from elastic_agent.supervision.launch.worker_env import RankAssignment, WorkerSpec
from elastic_agent.supervision.launch.workers import WorkerGroup
from elastic_agent.supervision.records.log_config import LogConfig, Std
from elastic_agent.supervision.records.logs import NodeLogs
from tests.agents import SCRIPTS, Agent, wait_until
from tests.conftest import require
from tests.test_process_tree import DEATH_BUDGET, describe, kill_all, start_tree, survivors
from tests.waiting import wait_until_async

PRELOAD = SCRIPTS / "preload"
PROBE = PRELOAD / "probe.py"
NPROC = 2

def quiet_logs() -> NodeLogs:
    """Worker output to the log files only (torchrun's ``-r 3``)."""
    return NodeLogs(LogConfig(redirects=Std.ALL))


def assignment(attempt: int = 0) -> RankAssignment:
    return RankAssignment(group_rank=0, group_world_size=1, world_size=NPROC, base_rank=0,
                          master_addr="127.0.0.1", master_port=1234, attempt=attempt,
                          restart_count=attempt)

async def run_group(tmp: Path, entrypoint: list[str], preload: tuple[str, ...],
                    attempts: int = 1) -> tuple[list[GroupResult], WorkerGroup]:
    spec = WorkerSpec(nproc=NPROC, entrypoint=entrypoint, run_id="r", job_id="j",
                      log_dir=tmp / "j", preload=preload, shutdown_timeout=2)
    group = WorkerGroup(spec, logs=quiet_logs())
    results = []
    try:
        await group.prepare()
        for attempt in range(attempts):
            await group.start(assignment(attempt))
            await asyncio.wait_for(group.wait(), 60)
            # A failing rank settles the group: let every rank finish before the stop.
            await wait_until_async(lambda: len(group.exits) >= NPROC, 60,
                                   "every rank's exit")
            results.append(GroupResult(group.state, exits=tuple(group.exits)))
            await group.stop()
    finally:
        await group.stop()
        await group.close()
    return results, group

def outputs(tmp: Path, attempt: int = 0) -> list[tuple[dict, str, str, dict | None]]:
    """Per rank: the probe's report, its stdout after the report, its stderr, error file."""
    out = []
    for rank in range(NPROC):
        d = tmp / "j" / f"attempt_{attempt}" / str(rank)
        first, _, rest = (d / "stdout.log").read_text().partition("\n")
        err = (d / "error.json")
        out.append((json.loads(first), rest, (d / "stderr.log").read_text(),
                    json.loads(err.read_text()) if err.exists() else None))
    return out

def comparable(report: dict, tmp: Path) -> dict:
    """The report with this run's temporary directory, object addresses and stack FIFO (a
    path of its own per worker, in the agent's runtime directory) made neutral."""
    env = report.get("env", {})
    if "ELASTIC_STACKS" in env:
        assert re.fullmatch(r"\d+:/.+\.fifo", env["ELASTIC_STACKS"]), env["ELASTIC_STACKS"]
        env["ELASTIC_STACKS"] = "SIG:FIFO"
    return json.loads(re.sub(r" at 0x[0-9a-f]+", "", json.dumps(report).replace(str(tmp), "TMP")))

def forked(stderr: str) -> bool:
    return json.loads(stderr.splitlines()[0])["forked"]

@pytest.mark.parametrize("how", ["3", "raise", "record", "0"])
def test_forked_worker_is_equivalent_to_exec(tmp_path, how):
    argv = [sys.executable, "-u", str(PROBE), how]
    ran = {}
    for name, preload in (("exec", ()), ("fork", ("preload_marker",))):
        results, _ = asyncio.run(run_group(tmp_path / name, argv, preload))
        ran[name] = ([(e.exit_code, e.message) for e in results[0].exits],
                     outputs(tmp_path / name))
    (exec_exits, exec_out), (fork_exits, fork_out) = ran["exec"], ran["fork"]
    assert sorted(exec_exits) == sorted(fork_exits)
    for rank in range(NPROC):
        e_report, e_rest, e_err, e_file = exec_out[rank]
        f_report, f_rest, f_err, f_file = fork_out[rank]
        assert not forked(e_err) and forked(f_err), "the fork path was not taken"
        assert comparable(e_report, tmp_path / "exec") == comparable(f_report, tmp_path / "fork")
        assert (e_rest, e_err.partition("\n")[2]) == (f_rest, f_err.partition("\n")[2])
        if how == "record":
            assert e_file is not None and f_file is not None
            assert e_file["message"]["message"] == f_file["message"]["message"]
        assert f_report["env"]["RANK"] == f_report["c_env_rank"] == str(rank)
        assert f_report["own_group"] and f_report["own_session"]

def test_module_mode_is_equivalent(tmp_path):
    argv = [sys.executable, "-u", "-m", "probe", "0"]
    ran = {}
    cwd = os.getcwd()
    os.chdir(PRELOAD)  # -m finds the module in the working directory, as python's does
    try:
        for name, preload in (("exec", ()), ("fork", ("preload_marker",))):
            asyncio.run(run_group(tmp_path / name, argv, preload))
            ran[name] = outputs(tmp_path / name)
    finally:
        os.chdir(cwd)
    for rank in range(NPROC):
        assert not forked(ran["exec"][rank][2]) and forked(ran["fork"][rank][2])
        e, f = (comparable(ran[n][rank][0], tmp_path / n) for n in ("exec", "fork"))
        assert e == f
        assert f["argv"][0] == str(PROBE) and f["path0"] == str(PRELOAD)

def test_one_zygote_forks_every_attempts_keeper_and_a_dead_one_is_replaced(tmp_path):
    """The node imports the preload once: the same zygote forks the keeper of a crashed
    attempt and of its restart (no second interpreter imports it meanwhile), stays one
    thread, and only its death (then replacement) costs a second import. The keeper it had
    forked ahead for the next attempt (its workers parked) outlives it and serves that
    attempt; the replacement forks the keepers after it."""
    count = tmp_path / "imports"

    def imports() -> list[str]:
        return count.read_text().split() if count.exists() else []

    async def scenario() -> tuple[list[tuple[int, int, int, int]], int, int]:
        spec = WorkerSpec(nproc=NPROC, entrypoint=[sys.executable, "-u", str(PROBE), "3"],
                          run_id="r", job_id="j", log_dir=tmp_path / "j",
                          preload=("preload_marker", "preload_counter"), shutdown_timeout=2)
        group = WorkerGroup(spec, logs=quiet_logs(),
                            base_env={**os.environ, "PRELOAD_COUNT_FILE": str(count)})
        seen = []  # per attempt: zygote pid, keeper pid, keeper's parent, imports so far
        ahead = 0
        try:
            await group.prepare()
            for attempt in range(4):
                await group.start(assignment(attempt))
                keeper_pid = group._keeper.pid
                z_pid = group._zygote[0].get_pid()
                seen.append((z_pid, keeper_pid, psutil.Process(keeper_pid).ppid(),
                             len(imports())))
                if attempt == 2:
                    assert keeper_pid == ahead  # forked by the dead zygote before its death
                await asyncio.wait_for(group.wait(), 60)
                # Every rank reports before the stop (the first failure settles the group,
                # and a stop that comes at once would end a rank still printing).
                await wait_until_async(lambda: len(group.exits) == NPROC, 60, "every exit")
                await group.stop()
                if attempt == 1:  # the zygote dies: attempt 3 needs a new one
                    threads = len(os.listdir(f"/proc/{z_pid}/task"))
                    ahead = (await group._spare).process.get_pid()  # forked at the stop
                    os.kill(z_pid, signal.SIGKILL)
                    await asyncio.wait_for(asyncio.shield(group._zygote[2]), 10)
        finally:
            await group.stop()
            await group.close()
        return seen, threads, len(imports())

    seen, threads, total = asyncio.run(scenario())
    (z0, k0, p0, n0), (z1, k1, p1, n1), (z2, _, _, _), (z3, _, p3, n3) = seen
    assert z0 == z1 == p0 == p1 and k0 != k1, seen  # one zygote, a keeper per attempt
    assert n0 == n1 == 1, seen  # one import while both attempts ran
    assert threads == 1  # still fork-safe after forking keepers
    assert z2 == z3 != z0 and p3 == z3 and n3 == total == 2, seen
    for attempt in range(4):
        assert all(forked(err) for _, _, err, _ in outputs(tmp_path, attempt))


def test_forked_workers_inherit_the_preload_frozen_and_collect(tmp_path):
    """The preload's objects are frozen before the forks, so no collection in a worker copies
    their pages (about 40 MiB of PSS with torch in bench/preload_bench.py); the worker's own
    objects are still collected, as in a new interpreter."""
    argv = [sys.executable, "-u", str(PRELOAD / "gc_state.py")]
    asyncio.run(run_group(tmp_path, argv, ("preload_marker",)))
    for rank in range(NPROC):
        out = tmp_path / "j" / "attempt_0" / str(rank) / "stdout.log"
        assert out.read_text() == "True True\n"


def test_unsafe_zygote_falls_back_to_exec_with_one_warning(tmp_path, capfd):
    argv = [sys.executable, "-u", str(PROBE), "0"]
    results, _ = asyncio.run(run_group(tmp_path, argv, ("preload_marker", "preload_thread")))
    assert [e.exit_code for e in results[0].exits] == [0] * NPROC
    assert not any(forked(err) for _, _, err, _ in outputs(tmp_path))
    warnings = [line for line in capfd.readouterr().err.splitlines() if "zygote" in line]
    assert len(warnings) == 1 and "Python threads" in warnings[0], warnings

def test_changed_environment_falls_back_to_exec(tmp_path, capfd):
    async def scenario() -> None:
        spec = WorkerSpec(nproc=NPROC, entrypoint=[sys.executable, "-u", str(PROBE), "0"],
                          run_id="r", job_id="j", log_dir=tmp_path / "j",
                          preload=("preload_marker",), shutdown_timeout=2)
        base = dict(os.environ)
        group = WorkerGroup(spec, logs=quiet_logs(), base_env=base)
        try:
            await group.prepare()
            base["PYTHONHASHSEED"] = "7"  # read at interpreter start: a fork would ignore it
            await group.start(assignment())
            await asyncio.wait_for(group.wait(), 60)
        finally:
            await group.stop()
            await group.close()

    asyncio.run(scenario())
    assert not any(forked(err) for _, _, err, _ in outputs(tmp_path))
    assert "PYTHONHASHSEED" in capfd.readouterr().err

def test_preload_with_no_python_is_refused():
    with pytest.raises(UsageError, match="--preload cannot be used with --no-python"):
        parse_args(["--standalone", "--preload", "torch", "--no-python", "/bin/true"])
    cfg = parse_args(["--standalone", "--preload", "torch,numpy", str(PROBE)])
    assert cfg.preload == ("torch", "numpy")

def test_sigkilled_agent_takes_its_forked_workers_and_zygotes(redis_url, job_id, tmp_path):
    agent, reported, procs = start_tree(redis_url, job_id, tmp_path, "--preload", "json")
    try:
        workers = {pids["worker"] for pids in reported.values()}

        def zygote_forks() -> list[psutil.Process]:
            """The node's zygote and the processes it forked: the keepers and parked workers
            (each titled ``elastic-agent ...``, see test_process_names.py) and the workers."""
            forks = []
            for p in agent.descendants():
                with contextlib.suppress(psutil.Error, IndexError):
                    if p.pid in workers or p.cmdline()[0].startswith("elastic-agent "):
                        forks.append(p)
            return forks

        # The next attempt's keeper, forked ahead with its workers parked: they die too.
        wait_until(lambda: len(zygote_forks()) == 3 + 2 * len(reported), 60,
                   "the next attempt's keeper and its parked workers")
        forks = zygote_forks()
        # The node's zygote (the agent's child), the keeper it forked for the attempt, and
        # the workers that keeper forked.
        (zygote,) = [z for z in forks if z.ppid() == agent.pid]
        (keeper,) = [z for z in forks if z.ppid() == zygote.pid
                     and workers <= {c.pid for c in z.children()}]
        (ahead,) = [z for z in forks if z.ppid() == zygote.pid and z != keeper]
        assert len([z for z in forks if z.ppid() == ahead.pid]) == len(reported), describe(forks)
        procs += [z for z in forks if z not in procs]
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(10)
        try:
            wait_until(lambda: not survivors(procs), DEATH_BUDGET, "every process to die")
        except AssertionError:
            raise AssertionError(describe(survivors(procs))) from None
    finally:
        kill_all(procs)
        agent.kill()

def test_torch_gloo_crash_restart_through_the_zygote(redis_url, job_id, tmp_path):
    require("torch")
    args = ["--redis", redis_url, "--job-id", job_id, "--local-addr", "127.0.0.1",
            "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1",
            "--preload", "torch", str(PRELOAD / "gloo_crash.py")]
    agents = [Agent(args, tmp_path, f"a{i}") for i in range(2)]
    try:
        codes = [a.wait(120) for a in agents]
        out = "".join(a.output for a in agents)
        assert codes == [0, 0], out[-4000:]
        for rank in range(2):
            for restart in range(2):
                assert f"rank {rank} restart {restart} preloaded True sum 3" in out, out[-4000:]
            assert f"rank {rank} loader 28 spawn 2.0" in out, out[-4000:]
    finally:
        for a in agents:
            a.kill()


def test_restart_command_restarts_through_the_zygote(redis_url, r, job_id, tmp_path):
    from elastic_agent.coordination.wire.command_records import Command, encode_command
    from elastic_agent.coordination.wire.event_records import EventType
    from elastic_agent.coordination.wire.keyspace import JobKeys
    from tests.test_agent import FAST, of_type

    logs = tmp_path / "logs"
    args = ["--redis", redis_url, "--job-id", job_id, "--local-addr", "127.0.0.1",
            "--nproc-per-node", "1", "--log-dir", str(logs), "--preload", "preload_marker",
            FAST, str(PROBE), "sleep"]
    agent = Agent(args, tmp_path, "a")
    try:
        started = lambda n: len(of_type(r, job_id, EventType.WORKERS_STARTED)) >= n  # noqa: E731
        wait_until(lambda: started(1), 60, "workers")
        # The probe has reported before the restart: a stop may otherwise end it first.
        wait_until(lambda: any(p.read_text() for p in logs.glob("*/attempt_0/0/stderr.log")),
                   30, "the first probe")
        r.xadd(JobKeys(job_id).commands,
               encode_command(Command("restart-1", "restart", "tester@host", args={})))
        wait_until(lambda: started(2), 60, "restart by command")
        for attempt in range(2):
            (run_dir,) = logs.glob(f"{job_id}_*")
            err = run_dir / f"attempt_{attempt}" / "0" / "stderr.log"
            wait_until(lambda err=err: err.exists() and err.read_text(), 30, "the probe")
            assert forked(err.read_text()), f"attempt {attempt} was not forked"
        r.xadd(JobKeys(job_id).commands,
               encode_command(Command("stop-1", "stop", "tester@host", args={})))
        assert agent.wait(30) == 143, agent.output[-3000:]
    finally:
        agent.kill()


# -- --preload auto, the default (issue 23) ---------------------------------------------------

#: A worker that says whether it was forked: a forked one inherits the objects the zygote
#: froze before forking (its command line is the script's either way: test_process_names.py).
WHICH = """
import gc, os
print("forked" if gc.get_freeze_count() else "exec", flush=True)
"""


@pytest.mark.parametrize(("source", "expected"), [
    ("import torch\n", ("torch",)),
    ('"""Train."""\nfrom __future__ import annotations\nimport os, sys\n'
     "import torch.distributed as dist\nx = 1\n", ("torch",)),
    ("from torch import nn\nimport numpy\n", ("torch",)),
    ("import os\nos.environ['TORCH_LOGS'] = '+dynamo'\nimport torch\n", ()),  # code first
    ("def main():\n    import torch\n", ()),
    ("try:\n    import torch\nexcept ImportError:\n    torch = None\n", ()),
    ("import torchvision\n", ()),
    ("from .torch import x\n", ()),
    ("import json\n", ()),
    ("import torch(\n", ()),  # not Python
])
def test_auto_preload_takes_torch_from_the_leading_imports_only(tmp_path, source, expected):
    script = tmp_path / "train.py"
    script.write_text(source)
    assert zygote.auto_preload([sys.executable, "-u", str(script)]) == expected


def test_auto_preload_never_looks_at_what_it_cannot_fork(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\n")
    assert zygote.auto_preload([sys.executable, "-u", "-m", "train"]) == ()
    assert zygote.auto_preload([sys.executable, "-u", "-c", "import torch"]) == ()
    assert zygote.auto_preload(["/bin/sh", str(script)]) == ()  # --no-python
    assert zygote.auto_preload([sys.executable, "-u", str(tmp_path / "gone.py")]) == ()


def test_preload_flag_auto_by_default_off_and_modules():
    script = str(PROBE)
    assert parse_args([script]).preload_auto
    assert parse_args(["--preload", "auto", script]).preload_auto
    off = parse_args(["--preload", "off", script])
    assert (off.preload, off.preload_auto) == ((), False)
    named = parse_args(["--preload", "torch", script])
    assert (named.preload, named.preload_auto) == (("torch",), False)
    assert not parse_args(["--no-python", "/bin/true"]).preload_auto


def _which(tmp: Path, attempt: int = 0) -> list[str]:
    return [(tmp / "j" / f"attempt_{attempt}" / str(rank) / "stdout.log").read_text()
            for rank in range(NPROC)]


#: Stands in for torch (the same path, without a second of import): records the pid that
#: imported it, so a worker can tell whether the zygote had imported it already.
AUTOMARK = "import os\nPID = os.getpid()\n"


@pytest.mark.parametrize(("leading", "auto", "expected"), [
    ("import automark\n", True, "forked preloaded"),  # auto: forked, automark imported once
    ("x = 1\nimport automark\n", True, "forked fresh"),  # code first: forked, not preloaded
    ("import automark\n", False, "exec fresh"),  # --preload off: exec, as before
    ("import automark_thread\nimport automark\n", True, "exec fresh"),  # unsafe to fork
])
def test_auto_forks_every_python_worker_and_falls_back_to_exec(tmp_path, monkeypatch, leading,
                                                               auto, expected):
    monkeypatch.setattr(zygote, "AUTO_MODULES", ("automark", "automark_thread"))
    (tmp_path / "automark.py").write_text(AUTOMARK)
    (tmp_path / "automark_thread.py").write_text((PRELOAD / "preload_thread.py").read_text())
    script = tmp_path / "train.py"
    script.write_text(leading + WHICH.replace(
        '"exec", flush=True)', '"exec", "preloaded" if automark.PID != os.getpid() else '
        '"fresh", flush=True)'))

    async def scenario() -> None:
        spec = WorkerSpec(nproc=NPROC, entrypoint=[sys.executable, "-u", str(script)],
                          run_id="r", job_id="j", log_dir=tmp_path / "j", preload_auto=auto,
                          shutdown_timeout=2)
        group = WorkerGroup(spec, logs=quiet_logs())
        try:
            await group.prepare()
            for attempt in range(2):  # the first start and a restart alike
                await group.start(assignment(attempt))
                assert (await asyncio.wait_for(group.wait(), 60)).state.value == "SUCCEEDED"
                await group.stop()
        finally:
            await group.stop()
            await group.close()

    asyncio.run(scenario())
    assert _which(tmp_path, 0) == _which(tmp_path, 1) == [expected + "\n"] * NPROC


def test_a_torch_script_is_forked_warm_by_default(tmp_path):
    """No flag: a script that starts by importing torch restarts from the warm zygote."""
    script = tmp_path / "train.py"
    script.write_text("import torch\n" + WHICH + textwrap.dedent("""
        import sys
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
            sys.exit(3)
    """))
    logs = tmp_path / "logs"
    agent = Agent(["--standalone", "--nproc-per-node", str(NPROC), "--max-restarts", "1",
                   "--log-dir", str(logs), str(script)], tmp_path, "a")
    try:
        assert agent.wait(180) == 0, agent.output[-3000:]
    finally:
        agent.kill()
    assert "zygote" not in agent.output  # no warning: nothing fell back
    (run_dir,) = logs.glob("*_*")
    for attempt in (0, 1):
        for rank in range(NPROC):
            out = run_dir / f"attempt_{attempt}" / str(rank) / "stdout.log"
            assert out.read_text() == "forked\n", (attempt, rank, agent.output[-2000:])


# -- workers forked ahead of a restart, parked until it releases them (issue 23) --------------

def _children(pid: int) -> list[int]:
    try:
        return sorted(p.pid for p in psutil.Process(pid).children())
    except psutil.Error:
        return []


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def _two_attempts(tmp: Path, preload: tuple[str, ...], case: str,
                        auto: bool = False) -> tuple[list[int], list[int]]:
    """Attempt 0, then attempt 1 on the next keeper, started ahead: (the workers it had
    parked, attempt 1's worker pids). ``auto``: default flags (``--preload auto``)."""
    base = dict(os.environ)
    spec = WorkerSpec(nproc=NPROC, entrypoint=[sys.executable, "-u", str(PROBE), "0"],
                      run_id="r", job_id="j", log_dir=tmp / "j", preload=preload,
                      preload_auto=auto, shutdown_timeout=2)
    group = WorkerGroup(spec, logs=quiet_logs(), base_env=base)
    try:
        await group.prepare()
        await group.start(assignment(0))
        await asyncio.wait_for(group.wait(), 60)
        await wait_until_async(lambda: len(group.exits) == NPROC, 60, "every exit")
        await wait_until_async(lambda: group._spare is not None and group._spare.done(), 30,
                               "the next attempt's keeper")
        assert group._spare is not None
        keeper_pid = group._spare.result().process.get_pid()
        if preload or auto:
            await wait_until_async(lambda: len(_children(keeper_pid)) == NPROC, 30,
                                   "its workers parked")
        parked = _children(keeper_pid)
        if case == "one died" and parked:
            os.kill(parked[0], signal.SIGKILL)
            await wait_until_async(lambda: _dead(parked[0]), 30, "the parked worker's death")
        if case == "environment changed":
            base["PYTHONHASHSEED"] = "7"  # read at interpreter start: no fork may serve it
        await group.stop()
        await group.start(RankAssignment(
            group_rank=0, group_world_size=1, world_size=NPROC, base_rank=0,
            master_addr="127.0.0.1", master_port=4321, attempt=1, restart_count=1))
        pids = [w.pid for w in group.workers]
        await asyncio.wait_for(group.wait(), 60)
        await wait_until_async(lambda: len(group.exits) == NPROC, 60, "every exit")
    finally:
        await group.stop()
        await group.close()
    return parked, pids


@pytest.mark.parametrize("case", ["parked", "one died", "environment changed"])
def test_a_restart_releases_the_workers_parked_ahead(tmp_path, monkeypatch, capfd, case):
    """The next attempt's keeper is forked ahead with its workers parked before any user
    code; the restart hands each its argv, the new round's environment (rank, master port,
    restart count) and its pipes: it is then the exec'ed worker's equal. A parked worker
    that died is replaced by a fresh fork; an environment that changed since the zygote
    started still falls back to exec."""
    monkeypatch.setattr("elastic_agent.supervision.launch.workers.SPARE_DELAY", 0.0)
    parked, pids = asyncio.run(_two_attempts(tmp_path / "fork", ("preload_marker",), case))
    asyncio.run(_two_attempts(tmp_path / "exec", (), case))
    assert len(parked) == NPROC
    released = [p for p in pids if p in parked]
    expected = {"parked": NPROC, "one died": NPROC - 1, "environment changed": 0}[case]
    assert len(released) == expected, (parked, pids)
    fork, exec_ = outputs(tmp_path / "fork", 1), outputs(tmp_path / "exec", 1)
    for rank in range(NPROC):
        f_report, f_rest, f_err, _ = fork[rank]
        e_report, e_rest, e_err, _ = exec_[rank]
        assert forked(f_err) == (case != "environment changed") and not forked(e_err)
        assert comparable(f_report, tmp_path / "fork") == comparable(e_report, tmp_path / "exec")
        assert (f_rest, f_err.partition("\n")[2]) == (e_rest, e_err.partition("\n")[2])
        env = f_report["env"]
        assert (env["RANK"], env["MASTER_PORT"], env["TORCHELASTIC_RESTART_COUNT"],
                f_report["c_env_rank"]) == (str(rank), "4321", "1", str(rank))
        assert f_report["fds"] == e_report["fds"]  # nothing of the parking left open
    if case == "environment changed":
        assert "PYTHONHASHSEED" in capfd.readouterr().err


def test_on_default_flags_a_restart_releases_parked_workers(tmp_path, monkeypatch):
    """No flag (``--preload auto``): a Python worker's restart is the parked path too."""
    monkeypatch.setattr("elastic_agent.supervision.launch.workers.SPARE_DELAY", 0.0)
    parked, pids = asyncio.run(_two_attempts(tmp_path, (), "parked", auto=True))
    assert len(parked) == NPROC and sorted(pids) == parked
    for rank, (report, _, _, _) in enumerate(outputs(tmp_path, 1)):
        assert (report["env"]["RANK"], report["env"]["TORCHELASTIC_RESTART_COUNT"]) == (
            str(rank), "1")


#: Rank 0 listens on MASTER_PORT after a moment's work (as torch's env:// store does once
#: the script got there); the others try to connect at once.
STORE = """
import os, socket, time
port = int(os.environ["MASTER_PORT"])
if os.environ["RANK"] == "0":
    end = time.monotonic() + 0.05
    while time.monotonic() < end:
        pass
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    server.settimeout(30)
    server.accept()
    print("served", flush=True)
else:
    try:
        socket.create_connection(("127.0.0.1", port)).close()
        print("connected", flush=True)
    except ConnectionRefusedError:
        print("refused", flush=True)
"""


def test_warm_rank_0_gets_a_lead_to_listen_before_the_others_start(tmp_path, monkeypatch):
    """With torch.distributed preloaded, the keeper starts the other ranks once global rank
    0 listens on MASTER_PORT (or sleeps without, or after ``keeper.STORE_LEAD``): released
    or forked at once, they would connect before it listens, and torch's store client waits
    up to a second before it tries again. A stand-in torch.distributed is preloaded here."""
    monkeypatch.setattr("elastic_agent.supervision.launch.workers.SPARE_DELAY", 0.0)
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    (tmp_path / "torch" / "distributed.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text(STORE)

    async def scenario() -> None:
        spec = WorkerSpec(nproc=NPROC, entrypoint=[sys.executable, "-u", str(script)],
                          run_id="r", job_id="j", log_dir=tmp_path / "j",
                          preload=("torch.distributed",), shutdown_timeout=2)
        group = WorkerGroup(spec, logs=quiet_logs())
        try:
            await group.prepare()
            for attempt in range(2):  # forked, then released from the parked workers
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", 0))
                    port = probe.getsockname()[1]
                await group.start(RankAssignment(
                    group_rank=0, group_world_size=1, world_size=NPROC, base_rank=0,
                    master_addr="127.0.0.1", master_port=port, attempt=attempt,
                    restart_count=attempt))
                await asyncio.wait_for(group.wait(), 60)
                await wait_until_async(lambda: len(group.exits) == NPROC, 60, "every exit")
                await group.stop()
                if attempt == 0:
                    await wait_until_async(lambda: group._spare is not None
                                           and group._spare.done(), 30, "the next keeper")
        finally:
            await group.stop()
            await group.close()

    asyncio.run(scenario())
    for attempt in range(2):
        assert _which(tmp_path, attempt) == ["served\n", "connected\n"], attempt
