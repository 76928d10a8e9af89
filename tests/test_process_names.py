"""What a worker looks like to ps, top, htop, pgrep and /proc: the command line torchrun
would have run (``python -u SCRIPT ARGS``, or ``-m MODULE``), however it was started.

By default (``--preload auto``) and with ``--preload MODULES`` a worker is forked from the
node's zygote, first by the attempt's keeper and on a restart from the workers parked ahead:
all of them ran in the zygote's argv area, which the bootstrap rewrites
(``zygote.set_cmdline``). With ``--preload off`` it is exec'ed through the ``--worker``
bootstrap, whose argv is rewritten the same way. The zygote, a keeper it forked and a parked
worker name themselves (``elastic-agent zygote (job J, node N)``, ...), and ``pgrep -f
SCRIPT`` finds the workers and nothing else of the agent's.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from elastic_agent.supervision.launch import zygote
from elastic_agent.supervision.launch.worker_env import RankAssignment, WorkerSpec
from elastic_agent.supervision.launch.workers import WorkerGroup
from elastic_agent.supervision.records.log_config import LogConfig, Std
from elastic_agent.supervision.records.logs import NodeLogs
from tests.agents import Agent, wait_until
from tests.conftest import require, require_program
from tests.test_agent import FAST, agent_args
from tests.waiting import wait_until_async

NPROC = 2
#: A space inside an argument, an empty one and non-ASCII: a NUL split must give them back.
ARGS = ["two words", "", "ünï", "--lr=0.1"]
#: Reports its pid and sys.argv once per attempt, then runs until it is stopped.
SLEEPER = """
import json, os, sys, time
report = {"pid": os.getpid(), "argv": sys.argv}
name = os.path.join(sys.argv[1], os.environ["TORCHELASTIC_RESTART_COUNT"] + "." +
                    os.environ["RANK"])
with open(name + ".tmp", "w") as f:
    json.dump(report, f)
os.rename(name + ".tmp", name + ".json")
time.sleep(600)  # the test's to end (a kill, or the agent's stop)
"""
#: The comm exec gives a worker: its program's name, cut to 15 bytes by the kernel.
PYTHON_COMM = os.path.basename(sys.executable)[:15]


def raw_cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().rstrip("\n")


def assert_shows(pid: int, argv: list[str]) -> None:
    """/proc/PID/cmdline is ``argv`` as exec lays it out (each argument and its NUL), then
    only the NULs of an argv area longer than it (which ps, top and pgrep drop)."""
    raw = raw_cmdline(pid)
    want = b"\0".join(os.fsencode(a) for a in argv) + b"\0"
    assert raw[:len(want)] == want and not raw[len(want):].strip(b"\0"), (
        f"pid {pid} shows {raw[:300]!r}, not {want[:300]!r}")
    shown = subprocess.run([require_program("ps"), "-ww", "-o", "args=", "-p", str(pid)],
                           capture_output=True, text=True, check=True,
                           env={**os.environ, "LC_ALL": "C.UTF-8"}).stdout.rstrip("\n")
    assert shown == " ".join(argv), shown[:300]


def pgrep(pattern: str) -> set[int]:
    out = subprocess.run([require_program("pgrep"), "-f", "--", pattern],
                         capture_output=True, text=True)
    return {int(pid) for pid in out.stdout.split()}


def titled(root: int, role: str) -> list[psutil.Process]:
    """The descendants of ``root`` whose command line is one ``elastic-agent ROLE (...)``."""
    found = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            argv = raw_cmdline(p.pid).rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        if len(argv) == 1 and argv[0].startswith(f"elastic-agent {role} (".encode()):
            found.append(p)
    return found


def reports(out: Path, restart: int) -> dict[int, dict]:
    return {rank: json.loads((out / f"{restart}.{rank}.json").read_text())
            for rank in range(NPROC) if (out / f"{restart}.{rank}.json").exists()}


def workers_of(out: Path, restart: int, script: Path, argv: list[str], agent: Agent) -> list[int]:
    """Attempt ``restart``'s workers by rank, once each runs, after checking that each shows
    ``argv`` with its interpreter's comm and that ``pgrep -f SCRIPT`` finds them all and
    nothing else but the agent (whose own command line names the script, as torchrun's)."""
    seen = wait_until(lambda: len(reports(out, restart)) == NPROC and reports(out, restart),
                      120, f"attempt {restart}'s workers")
    for report in seen.values():
        assert report["argv"] == argv[2:]  # sys.argv, as ever
        assert_shows(report["pid"], argv)
        assert comm(report["pid"]) == PYTHON_COMM
    pids = [seen[rank]["pid"] for rank in range(NPROC)]
    assert pgrep(str(script)) - {agent.pid} == set(pids)
    return pids


def parked_of(agent: Agent, job: str, running: list[int]) -> set[int]:
    """The workers parked for the next attempt, once there, after checking the titles of
    the zygote, of the keeper it forked ahead and of each parked worker."""
    (zyg,) = titled(agent.pid, "zygote")
    assert zyg.ppid() == agent.pid and comm(zyg.pid) == "elastic-zygote"
    assert re.fullmatch(rf"elastic-agent zygote \(job {job}, node \S+\)\0+",
                        raw_cmdline(zyg.pid).decode()), raw_cmdline(zyg.pid)[:200]
    parked = rf"elastic-agent parked worker \(job {job}, local rank (\d)\)"

    def named(k: psutil.Process) -> bool:
        # A worker forked by the keeper shows the keeper's title until it has set its own:
        # under load, a moment after it is among the keeper's children.
        try:
            return all(re.fullmatch(parked, raw_cmdline(c.pid).rstrip(b"\0").decode())
                       and comm(c.pid) == "elastic-parked" for c in k.children())
        except FileNotFoundError:  # one left (or was released) between the two reads
            return False

    (ahead,) = wait_until(lambda: [k for k in titled(zyg.pid, "keeper")
                                   if len(k.children()) == NPROC
                                   and not {c.pid for c in k.children()} & set(running)
                                   and named(k)],
                          60, "the next attempt's keeper with its parked workers")
    assert comm(ahead.pid) == "elastic-keeper"
    ranks = {}
    for p in ahead.children():
        shown = raw_cmdline(p.pid).rstrip(b"\0").decode()
        found = re.fullmatch(parked, shown)
        assert found and comm(p.pid) == "elastic-parked", shown
        ranks[int(found[1])] = p.pid
    assert sorted(ranks) == list(range(NPROC))
    return set(ranks.values())


@pytest.mark.parametrize("mode", ["default", "torch", "off"])
def test_a_worker_shows_the_command_line_torchrun_runs(redis_url, job_id, tmp_path, mode):
    """Default flags, ``--preload torch`` and ``--preload off``: each running worker, on
    the first attempt and on its restart (released from the workers parked ahead, when
    warm), shows ``python -u SCRIPT ARGS``; the zygote, the keepers it forks and the parked
    workers say what they are."""
    if mode == "torch":
        require("torch")
    script = tmp_path / "train.py"
    script.write_text(SLEEPER)
    out = tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, "-u", str(script), str(out), *ARGS]
    flags = {"default": [], "torch": ["--preload", "torch"], "off": ["--preload", "off"]}[mode]
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", str(NPROC),
                             "--max-restarts", "1", FAST, *flags, *argv[2:]), tmp_path, "a")
    try:
        first = workers_of(out, 0, script, argv, agent)
        parked = parked_of(agent, job_id, first) if mode != "off" else set()
        os.kill(first[1], signal.SIGKILL)  # a failure: the agent restarts the group
        restarted = workers_of(out, 1, script, argv, agent)
        if mode != "off":
            assert set(restarted) == parked  # released, not forked anew
        agent.proc.terminate()
        agent.wait(60)
    finally:
        agent.kill()


async def _running(tmp: Path, entrypoint: list[str], out: Path, auto: bool,
                   check: Callable[[dict], None]) -> None:
    """Two attempts of a WorkerGroup (forked, then released from the parked workers, on
    default flags; exec'ed with ``auto`` False), ``check`` on every running worker's report
    (the SLEEPER's, written to ``out``)."""
    spec = WorkerSpec(nproc=NPROC, entrypoint=entrypoint, run_id="r", job_id="j",
                      log_dir=tmp / "j", preload_auto=auto, shutdown_timeout=2)
    group = WorkerGroup(spec, logs=NodeLogs(LogConfig(redirects=Std.ALL)))
    try:
        await group.prepare()
        for attempt in (0, 1):
            await group.start(RankAssignment(
                group_rank=0, group_world_size=1, world_size=NPROC, base_rank=0,
                master_addr="127.0.0.1", master_port=1234, attempt=attempt,
                restart_count=attempt))
            await wait_until_async(lambda a=attempt: len(reports(out, a)) == NPROC, 60,
                                   "the workers' reports")
            for report in reports(out, attempt).values():
                check(report)
            if attempt == 0 and auto:
                await wait_until_async(lambda: group._spare is not None and group._spare.done()
                                       and len(psutil.Process(group._spare.result().process
                                                              .get_pid()).children()) == NPROC,
                                       30, "the next attempt's parked workers")
            await group.stop()
    finally:
        await group.stop()
        await group.close()


@pytest.mark.parametrize("auto", [True, False], ids=["default", "exec"])
def test_a_long_argument_list_shows_in_full(tmp_path, monkeypatch, auto):
    """3,000 arguments (about 120 KiB, far more than the environment that follows the argv
    area): the zygote's room makes its area, which every fork shares, as long as the
    worker's command line, so none of it is cut; the exec path's bootstrap argv is longer
    than the command line it shows."""
    script = tmp_path / "train.py"
    script.write_text(SLEEPER)
    out = tmp_path / "out"
    out.mkdir()
    many = [f"--arg{i:05d}={'x' * 30}" for i in range(3000)]
    argv = [sys.executable, "-u", str(script), str(out), *many, *ARGS]

    def check(report: dict) -> None:
        assert report["argv"] == argv[2:]
        assert_shows(report["pid"], argv)

    monkeypatch.setattr("elastic_agent.supervision.launch.workers.SPARE_DELAY", 0.0)
    asyncio.run(_running(tmp_path, argv, out, auto, check))
    assert len(os.fsencode("\0".join(argv))) > 100_000 > len(b"\0".join(
        k + b"=" + v for k, v in os.environb.items()))


@pytest.mark.parametrize("auto", [True, False], ids=["default", "exec"])
def test_a_module_worker_shows_python_dash_m(tmp_path, monkeypatch, auto):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(tmp_path)  # -m finds the module in the working directory
    argv = [sys.executable, "-u", "-m", "sleeper", str(out), *ARGS]

    def check(report: dict) -> None:
        assert report["argv"] == [str(tmp_path / "sleeper.py"), str(out), *ARGS]
        assert_shows(report["pid"], argv)
        assert comm(report["pid"]) == PYTHON_COMM

    monkeypatch.setattr("elastic_agent.supervision.launch.workers.SPARE_DELAY", 0.0)
    asyncio.run(_running(tmp_path, argv, out, auto, check))


def test_set_cmdline_stays_in_the_argv_area(tmp_path):
    """What does not fit is cut at the area's end: the environment after it, which
    /proc/PID/environ shows (a stop finds a worker's strays by it), is never written; an
    area someone else titled past its end is left alone."""
    code = (
        "import os, sys\n"
        f"sys.path.insert(0, {os.path.dirname(zygote.__file__)!r})\n"
        "import zygote\n"
        "env = open('/proc/self/environ', 'rb').read()\n"
        "size = len(open('/proc/self/cmdline', 'rb').read())\n"
        "assert zygote.set_cmdline(['x' * 10, 'y' * (2 * size)], 'short-name')\n"
        "assert open('/proc/self/environ', 'rb').read() == env\n"
        "got = open('/proc/self/cmdline', 'rb').read()\n"
        "assert got == b'x' * 10 + b'\\0' + b'y' * (size - 12) + b'\\0', got\n"
        "assert open('/proc/self/comm').read() == 'short-name\\n'\n"
        "fields = open('/proc/self/stat', 'rb').read().rpartition(b')')[2].split()\n"
        "with open('/proc/self/mem', 'r+b', buffering=0) as mem:\n"
        "    mem.seek(int(fields[46]) - 1)\n"
        "    mem.write(b'!')  # a title that ran past the area, as setproctitle's may\n"
        "titled = open('/proc/self/cmdline', 'rb').read()\n"
        "assert not zygote.set_cmdline(['z']) and open('/proc/self/cmdline', 'rb').read() == titled\n"
        "assert sys.argv == ['-c', 'an', 'argument'] and sys.orig_argv[-2:] == ['an', 'argument']\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code, "an", "argument"], capture_output=True,
                          text=True, env={**os.environ, "MARKER": "m" * 500})
    assert done.stdout == "ok\n", done.stderr


def test_the_zygote_gets_room_for_the_workers_command_line():
    short = [sys.executable, "-u", __file__]
    assert zygote.command(short, (), 7, job="j", node="n")[-3:] == ["user", "j", "n"]
    long = [*short, *(["z" * 1000] * 300)]
    argv = zygote.command(long, ("torch",), 7, auto=True, job="j", node="n")
    assert argv is not None and argv[6:9] == ["auto", "j", "n"]
    assert zygote._area_size(argv) == zygote._area_size(long)
    assert max(len(a) for a in argv) < zygote.ROOM_CHUNK
    assert zygote.label("job\x1b[2J\n" + "n" * 100) == "job?[2J?" + "n" * 56
