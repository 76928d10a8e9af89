"""torch's launcher tests, where they test the command line, run through both launchers.

The cases are those of pytorch's test/distributed/launcher/test_run.py (torch's wheel does not
ship it; the code here is our own): a Python script on N workers, restarts, a failing worker
and its summary, --run-path, -m, --no-python, --nnodes MIN:MAX, static rendezvous with
--master-addr/--master-port, --tee with --local-ranks-filter, --nproc-per-node values, bad
command lines, SIGTERM to the launcher. Each case runs once under torchrun 2.13
(``python -m torch.distributed.run``) and once under ``elastic-agent`` with the same flags, all
cases at once (one batch, to keep the suite fast); the tests compare exit status, what every
worker saw (tests/scripts/launcher_report.py writes it down) and the files.

Where elastic-agent differs on purpose it says so in one line, and the test asserts that line.
Worker variables whose values differ by design are listed in ``DIFFERENT`` with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import psutil
import pytest

from elastic_agent.coordination.ports import free_port
from elastic_agent.supervision import cli
from tests.agents import AGENT, SCRIPTS, alive, wait_until
from tests.conftest import require_program

REPORT = SCRIPTS / "launcher_report.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMEOUT = 90  # only to catch a hang

# Worker variables that must differ between the launchers, and why; everything else a worker
# sees must be equal.
DIFFERENT = {
    "MASTER_PORT": "a free port each; torchrun keeps one for all restarts, elastic-agent "
                   "takes a new one each rendezvous round (compared where it is given)",
    "TORCHELASTIC_RUN_ID": "torchrun's --rdzv-id (a uuid under --standalone), here the job id: "
                           "only its presence is compared (is_torchelastic_launched)",
    "TORCHELASTIC_ERROR_FILE": "each launcher's own log directory: the tail "
                               "attempt_<n>/<local_rank>/error.json is compared",
    "TORCHELASTIC_USE_AGENT_STORE": "torchrun's agent hosts a TCPStore the workers reuse; "
                                    "here the workers' store is theirs (MASTER_ADDR/PORT)",
    "pid": "a process id",
}


@dataclass(frozen=True)
class Case:
    """One command line for both launchers: ``flags`` for both, then the worker ``entry``
    (the report script) with its output directory and ``args``."""

    flags: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    torch: tuple[str, ...] | None = ("--standalone",)  # None: elastic-agent only
    ours: tuple[str, ...] = ()  # replaces --redis/--job-id of the test's Redis when given
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    entry: tuple[str, ...] = (str(REPORT),)
    prefix: tuple[str, ...] = ()  # before the launcher, e.g. taskset


class Run:
    """One launcher process of a case; output to a file so a chatty run never blocks."""

    def __init__(self, argv: list[str], out_dir: Path, case: Case) -> None:
        self.out_dir = out_dir
        out_dir.mkdir(parents=True)
        self.log = out_dir.with_suffix(".out")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PET_", "TORCHELASTIC_", "ELASTIC_"))}
        env |= {"PYTHONUNBUFFERED": "1", **case.env}
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         cwd=case.cwd, start_new_session=True)

    def wait(self) -> int:
        try:
            return self.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.proc.args} hung:\n{self.output[-3000:]}") from None

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def reports(self) -> dict[str, dict]:
        """``<restart>_<rank>`` -> what that worker saw."""
        return {p.stem: json.loads(p.read_text()) for p in self.out_dir.glob("*.json")}

    def files(self) -> set[str]:
        return {p.name for p in self.out_dir.iterdir()}

    def kill(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


@dataclass
class Pair:
    theirs: Run | None
    ours: Run

    def codes(self) -> tuple[int | None, int]:
        return (None if self.theirs is None else self.theirs.wait()), self.ours.wait()


def shell_entry(tmp: Path) -> tuple[str, ...]:
    """torch's test_script.sh in spirit: an executable that is not Python."""
    script = tmp / "launcher_touch.sh"
    script.write_text('#!/bin/sh\ntouch "$1/$RANK-of-$WORLD_SIZE.$ROLE_NAME"\n')
    script.chmod(0o755)
    return (str(script),)


def cases(tmp: Path) -> dict[str, Case]:
    rdzv_port, torch_master, our_master = free_port(), free_port(), free_port()
    return {
        # test_launch_user_script_python + restarts, --role, -m and an inherited variable.
        "restarts": Case(("--nproc-per-node", "2", "--role", "trainer", "--max-restarts", "2",
                          "-m"), ("--fail-restarts", "1"), ours=("--standalone",),
                         env={"LAUNCHER_PARENT_SENTINEL": "FOOBAR"}, cwd=SCRIPTS,
                         entry=("launcher_report",)),
        # test_launch_elastic_worker_raise_exception: restarts run out, with --nnodes MIN:MAX
        # and only MIN nodes there (test_launch_elastic).
        "exhausted": Case(("--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "1"),
                          ("--fail-restarts", "-1", "--exit", "7"),
                          torch=("--rdzv-backend", "c10d", "--rdzv-endpoint",
                                 f"127.0.0.1:{rdzv_port}", "--rdzv-id", uuid.uuid4().hex,
                                 "--rdzv-conf", "join_timeout=60,last_call_timeout=1"),
                          ours=("--rdzv-conf", "last_call_timeout=1")),
        # test_launch_run_path + test_launch_user_script_default_nproc.
        "run_path": Case(("--run-path",), ("x", "--y")),
        # test_launch_user_script_bash.
        "no_python": Case(("--no-python", "--nproc-per-node", "2", "--role", "sh"),
                          entry=shell_entry(tmp)),
        # test_launch_user_script_python_caffe2_bc (static, the given master) and
        # test_capture_logs_using_default_logs_specs (teed lines, filtered local ranks).
        "static_tee": Case(("--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1",
                            "--nproc-per-node", "2", "--redirects", "3", "--tee", "3",
                            "--local-ranks-filter", "1"),
                           torch=("--master-port", str(torch_master)),
                           ours=("--master-port", str(our_master))),
        # A script that does not exist: torchrun starts workers, which fail ("can't open
        # file", exit 2), and exits 1; elastic-agent refuses before starting any.
        "missing": Case(entry=(str(tmp / "no_such_script.py"),), torch=None),
        # SIGTERM to the launcher (the test sends it once every worker is ready).
        "sigterm": Case(("--nproc-per-node", "2"), ("--wait-signal",)),
        # torchrun reads every flag from PET_<FLAG> too (test_launch_with_env_vars).
        "pet_env": Case(torch=None, env={"PET_NPROC_PER_NODE": "2", "PET_ROLE": "pet"}),
        # torchrun's prefix of teed lines comes from this variable (it has no flag for it).
        "prefix_env": Case(("--nproc-per-node", "2", "--tee", "3"), torch=None,
                           env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]: "}),
        # auto/cpu count the CPUs this process may run on, as torch._utils.cpu_count does.
        **{f"nproc_{kind}": Case(("--nproc-per-node", kind), torch=None,
                                 prefix=("taskset", "-c", "0")) for kind in ("auto", "cpu")},
    }


@pytest.fixture(scope="module")
def runs(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Pair]]:
    """Every case under both launchers, all started at once: most of a run is torchrun
    importing torch, which overlaps well."""
    tmp = tmp_path_factory.mktemp("launchers")
    pairs = {}
    for name, case in cases(tmp).items():
        if case.prefix and shutil.which(case.prefix[0]) is None:
            continue  # not run: its test fails, naming the missing program (require_program)
        ours_flags = case.ours if "--standalone" in case.ours else (
            "--redis", redis_url, "--job-id", f"lp-{name.replace('_', '-')}-{uuid.uuid4().hex[:6]}",
            *case.ours)
        theirs = None if case.torch is None else Run(
            [*case.prefix, *TORCHRUN, *case.torch, *case.flags, *case.entry,
             str(tmp / name / "torchrun"), *case.args], tmp / name / "torchrun", case)
        ours = Run([*case.prefix, *AGENT, *ours_flags, *case.flags, *case.entry,
                    str(tmp / name / "ours"), *case.args], tmp / name / "ours", case)
        pairs[name] = Pair(theirs, ours)
    yield pairs
    for pair in pairs.values():
        for run in (pair.theirs, pair.ours):
            if run is not None:
                run.kill()


def seen(report: dict) -> dict:
    """What a worker saw, minus what differs by design (``DIFFERENT``), in comparable form."""
    out = {k: v for k, v in report.items() if k not in DIFFERENT}
    out["run_id_set"] = report["TORCHELASTIC_RUN_ID"] is not None
    out["error_file_tail"] = list(Path(report["TORCHELASTIC_ERROR_FILE"]).parts[-3:])
    out["master_port_set"] = (report["MASTER_PORT"] or "").isdigit()
    out["argv"] = [Path(report["argv"][0]).name, *report["argv"][2:]]  # [1] is its own dir
    return out


def same_workers(pair: Pair) -> dict[str, dict]:
    assert pair.theirs is not None
    theirs = {k: seen(v) for k, v in pair.theirs.reports().items()}
    ours = {k: seen(v) for k, v in pair.ours.reports().items()}
    assert sorted(ours) == sorted(theirs), "not the same workers (<restart>_<rank>)"
    differ = {(w, key): (theirs[w].get(key), ours[w].get(key)) for w in theirs
              for key in theirs[w].keys() | ours[w].keys()
              if theirs[w].get(key) != ours[w].get(key)}
    assert not differ, f"(worker, variable): (torchrun, elastic-agent): {differ}"
    return ours


def summary(output: str) -> dict[str, str]:
    """The root-cause fields of a failure summary (torch's ChildFailedError text, ours)."""
    cause = output.rsplit("Root Cause", 1)[-1]
    return {m[1]: m[2].strip() for m in re.finditer(r"^\s*(\w+)\s*: (.*)$", cause, re.M)}


# -- what every worker sees, exit status ---------------------------------------------------

def test_restarts_role_module_and_inherited_environment(runs: dict[str, Pair]) -> None:
    pair = runs["restarts"]
    assert pair.codes() == (0, 0), pair.ours.output
    workers = same_workers(pair)
    assert sorted(workers) == ["0_0", "0_1", "1_0", "1_1"]
    w = workers["1_1"]
    assert (w["RANK"], w["LOCAL_RANK"], w["ROLE_RANK"], w["GROUP_RANK"]) == ("1", "1", "1", "0")
    assert (w["WORLD_SIZE"], w["LOCAL_WORLD_SIZE"], w["ROLE_WORLD_SIZE"]) == ("2", "2", "2")
    assert (w["ROLE_NAME"], w["TORCHELASTIC_RESTART_COUNT"],
            w["TORCHELASTIC_MAX_RESTARTS"]) == ("trainer", "1", "2")
    assert w["LAUNCHER_PARENT_SENTINEL"] == "FOOBAR" and w["OMP_NUM_THREADS"] == "1"
    assert w["name"] == "__main__" and w["argv"][0] == "launcher_report.py" and w["run_id_set"]
    assert w["error_file_tail"] == ["attempt_1", "1", "error.json"]


def test_a_failure_that_outlives_the_restarts_fails_the_launcher(runs: dict[str, Pair]) -> None:
    pair = runs["exhausted"]
    assert pair.codes() == (1, 1), pair.ours.output
    workers = same_workers(pair)
    assert sorted(workers) == ["0_0", "0_1", "1_0", "1_1"]
    # --nnodes 1:2 with one node: the round closes at the last call with what is there.
    assert {(w["WORLD_SIZE"], w["GROUP_WORLD_SIZE"]) for w in workers.values()} == {("2", "1")}
    theirs, ours = summary(pair.theirs.output), summary(pair.ours.output)
    for s in (theirs, ours):
        assert s["rank"] == "1 (local_rank: 1)" and s["exitcode"].split()[0] == "7", s
    for run in (pair.theirs, pair.ours):
        assert f"{REPORT} FAILED" in run.output


def test_run_path_and_one_worker_by_default(runs: dict[str, Pair]) -> None:
    pair = runs["run_path"]
    assert pair.codes() == (0, 0), pair.ours.output
    workers = same_workers(pair)
    assert list(workers) == ["0_0"]
    w = workers["0_0"]
    assert w["argv"] == ["launcher_report.py", "x", "--y"] and w["name"] == "__main__"
    assert w["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS")  # set only for 2+ workers


def test_no_python_runs_an_executable(runs: dict[str, Pair]) -> None:
    pair = runs["no_python"]
    assert pair.codes() == (0, 0), pair.ours.output
    assert pair.ours.files() == pair.theirs.files() == {"0-of-2.sh", "1-of-2.sh"}


def test_static_rendezvous_gives_the_workers_the_given_master(runs: dict[str, Pair]) -> None:
    pair = runs["static_tee"]
    assert pair.codes() == (0, 0), pair.ours.output
    same_workers(pair)
    for run in (pair.theirs, pair.ours):
        port = run.proc.args[run.proc.args.index("--master-port") + 1]
        assert {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in run.reports().values()} == {
            ("127.0.0.1", port)}


def test_tee_shows_only_the_filtered_local_ranks(runs: dict[str, Pair]) -> None:
    pair = runs["static_tee"]
    assert pair.codes() == (0, 0), pair.ours.output
    for run in (pair.theirs, pair.ours):
        assert "[default1]:creating report of rank 1" in run.output.splitlines(), run.output
        assert "creating report of rank 0" not in run.output


def test_sigterm_reaches_every_worker_and_fails_the_launcher(runs: dict[str, Pair]) -> None:
    pair = runs["sigterm"]
    runs_ = (pair.theirs, pair.ours)
    for run in runs_:
        wait_until(lambda run=run: {"0.ready", "1.ready"} <= run.files(), TIMEOUT,
                   f"the workers of {run.proc.args[:3]} to be ready")
        run.proc.send_signal(signal.SIGTERM)
    theirs, ours = pair.codes()
    for run in runs_:
        assert {p.name: p.read_text() for p in run.out_dir.glob("*.term")} == {
            "0.term": "SIGTERM", "1.term": "SIGTERM"}
        assert not alive([r["pid"] for r in run.reports().values()])
    # torchrun leaves with the SignalException's traceback (1); elastic-agent with 128+N, as
    # README's exit statuses say, on one line.
    assert theirs == 1 and "SignalException" in pair.theirs.output
    assert ours == 128 + signal.SIGTERM, pair.ours.output
    assert "Traceback" not in pair.ours.output


def test_a_missing_script_is_refused_before_any_worker_starts(runs: dict[str, Pair]) -> None:
    pair = runs["missing"]
    assert pair.codes() == (None, 2)
    (line,) = pair.ours.output.strip().splitlines()
    assert "no_such_script.py' does not exist" in line


# -- bad command lines: torchrun raises, elastic-agent says one line and exits 2 -------------

def torch_refuses(argv: list[str]) -> bool:
    from torch.distributed.run import config_from_args, parse_args

    # config_from_args writes OMP_NUM_THREADS into os.environ: keep it out of this process.
    with mock.patch.dict(os.environ, clear=False):
        try:
            config_from_args(parse_args(argv))
        except (ValueError, RuntimeError):
            return True
    return False


def our_refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(("flags", "ours_say"), [
    (["--nproc-per-node", "unknown"], "is not a positive number, auto, cpu or gpu"),
    (["--nproc-per-node", "xpu"], "is not a positive number, auto, cpu or gpu"),
    (["--no-python", "-m"], "--no-python and -m cannot be used together"),
    (["--nnodes", "2:20:30"], "is not N or MIN:MAX"),
    (["--logs-specs", "DOESNOT_EXIST"], "--logs[-_]specs"),
], ids=["nproc-unknown", "nproc-xpu", "no-python-with-module", "nnodes-3-parts", "logs-specs"])
def test_command_lines_torchrun_refuses_are_refused_in_one_line(
        flags: list[str], ours_say: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert torch_refuses([*flags, str(REPORT)])
    assert re.search(ours_say, our_refusal([*flags, str(REPORT)], capsys))


def test_nproc_gpu_without_a_gpu_is_refused_by_both(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: this is the no-GPU case")
    assert torch_refuses(["--nproc-per-node", "gpu", str(REPORT)])
    assert "no CUDA device is visible" in our_refusal(
        ["--nproc-per-node", "gpu", str(REPORT)], capsys)


def test_c10d_rendezvous_is_our_one_deliberate_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400", str(REPORT)]
    assert not torch_refuses(flags)
    assert "elastic-agent meets in Redis" in our_refusal(flags, capsys)


# -- torchrun behaviour read from the environment and the CPU affinity ------------------------

def test_flags_from_pet_variables(runs: dict[str, Pair]) -> None:
    from torch.distributed.run import parse_args

    with mock.patch.dict(os.environ, {"PET_NPROC_PER_NODE": "2", "PET_ROLE": "pet"}):
        ns = parse_args([str(REPORT)])
    assert (ns.nproc_per_node, ns.role) == ("2", "pet")  # torchrun's reading
    pair = runs["pet_env"]
    assert pair.codes() == (None, 0), pair.ours.output
    assert {(r["RANK"], r["ROLE_NAME"]) for r in pair.ours.reports().values()} == {
        ("0", "pet"), ("1", "pet")}


def test_log_line_prefix_from_the_variable(runs: dict[str, Pair]) -> None:
    from torch.distributed.run import config_from_args, parse_args

    template = "[rank${rank}]: "
    with mock.patch.dict(os.environ, {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": template}):
        config, *_ = config_from_args(parse_args(["--tee", "3", str(REPORT)]))
    assert config.log_line_prefix_template == template  # torchrun's reading
    pair = runs["prefix_env"]
    assert pair.codes() == (None, 0), pair.ours.output
    lines = pair.ours.output.splitlines()
    assert {"[rank0]: creating report of rank 0", "[rank1]: creating report of rank 1"} <= set(
        lines), pair.ours.output


@pytest.mark.parametrize("kind", ["auto", "cpu"])
def test_nproc_auto_and_cpu_count_the_cpus_this_process_may_use(
        kind: str, runs: dict[str, Pair]) -> None:
    from torch.distributed.run import determine_local_world_size

    require_program("taskset")  # util-linux: a failure where it is missing, never a skip
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPUs, to tell affinity from the machine's count")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})  # this thread only, as taskset -c does for a child
    try:
        assert determine_local_world_size(kind) == 1  # torchrun's reading
    finally:
        os.sched_setaffinity(0, before)
    pair = runs[f"nproc_{kind}"]
    assert pair.codes() == (None, 0), pair.ours.output
    assert len(pair.ours.reports()) == 1
