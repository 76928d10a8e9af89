"""One script under torchrun and under elastic-agent, same flags: the same worker
environments and the same log tree (issue 12, point 2).

Both run ``--standalone --nproc-per-node 2 --max-restarts 1 --tee 3 --log-dir D`` with
tests/scripts/parity_probe.py, whose rank 1 fails on the first attempt through torch's own
``@record``. Compared: every variable of every worker of both attempts (the values that must
differ are listed below, each with its reason), the tree under ``D/<run_id>_<random>/``
(directories, file names), the bytes of every stdout.log/stderr.log, and the error file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PROBE = ROOT / "tests" / "scripts" / "parity_probe.py"

#: Only in our workers' environment.
OURS_ONLY = {
    "ELASTIC_REDIS_URL",  # where the agent's Redis is (the torch store adapter uses it)
    "ELASTIC_JOB_ID",  # the job the worker belongs to
    "ELASTIC_STACKS",  # where the worker's faulthandler writes its stacks on request
    "ELASTIC_RECORDER",  # the socket the worker's collective-trace thread serves (issue 22)
    "TORCH_FR_BUFFER_SIZE",  # --flight-recorder: torch's flight recorder on (issue 22)
}
#: In both, with values that must differ.
DIFFERENT = {
    "MASTER_PORT",  # a free port each launcher picks
    "TORCHELASTIC_RUN_ID",  # --standalone: torchrun a uuid, elastic-agent a job id
    "TORCHELASTIC_ERROR_FILE",  # below each run's own <run_id>_<random> directory
    # torchrun's c10d rendezvous hosts a TCPStore in the agent that workers join; ours is in
    # Redis, so rank 0 hosts MASTER_PORT's store, as torch's env:// does with False.
    "TORCHELASTIC_USE_AGENT_STORE",
}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "ELASTIC_")) and k not in (
               "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _launch(launcher: str, tmp: Path, *flags: str, name: str = "",
            env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / (name or launcher)
    out.mkdir()
    cmd = [str(BIN / launcher), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.1", "--log-dir", str(out / "logs"), *flags,
           str(PROBE), str(out)]
    proc = subprocess.run(cmd, cwd=tmp, env={**_env(), **(env or {})}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, (launcher, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    tmp = tmp_path_factory.mktemp("parity")
    found = {}
    for launcher, name, flags in (("torchrun", "", ()), ("elastic-agent", "", ()),
                                  ("elastic-agent", "plugin", ("--logs-specs", "default"))):
        _, out = _launch(launcher, tmp, "--tee", "3", *flags, name=name)
        (run_dir,) = (out / "logs").iterdir()
        found[name or launcher] = (run_dir, out)
    return found


def _tree(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): "dir" if p.is_dir() else "file"
            for p in sorted(run_dir.rglob("*"))}


def test_the_run_directory_is_named_as_torchs(runs) -> None:
    for run_dir, out in runs.values():
        run_id = json.loads((out / "env.0.0.json").read_text())["TORCHELASTIC_RUN_ID"]
        assert re.fullmatch(re.escape(run_id) + r"_[a-z0-9_]{8}", run_dir.name), run_dir


@pytest.mark.parametrize("ours", ["elastic-agent", "plugin"])
def test_the_same_log_tree_and_bytes(runs, ours: str) -> None:
    """Our own layout, and torch's DefaultLogsSpecs through ``--logs-specs default``."""
    (theirs, _), (ours, _) = runs["torchrun"], runs[ours]
    assert _tree(ours) == _tree(theirs)
    assert "attempt_1/0/stdout.log" in _tree(ours)
    for rel, kind in _tree(theirs).items():
        if kind == "file" and rel.endswith(".log"):
            assert (ours / rel).read_bytes() == (theirs / rel).read_bytes(), rel


def test_the_same_error_file(runs) -> None:
    (theirs, _), (ours, _) = runs["torchrun"], runs["elastic-agent"]
    t = json.loads((theirs / "attempt_0" / "1" / "error.json").read_text())
    o = json.loads((ours / "attempt_0" / "1" / "error.json").read_text())
    assert o["message"]["message"] == t["message"]["message"] == (
        "ValueError: probe failure on rank 1")
    assert o["message"]["extraInfo"]["py_callstack"] == t["message"]["extraInfo"]["py_callstack"]
    assert set(o["message"]["extraInfo"]) == set(t["message"]["extraInfo"])


@pytest.mark.parametrize("attempt,rank", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_the_same_worker_environment(runs, attempt: int, rank: int) -> None:
    (t_dir, t_out), (o_dir, o_out) = runs["torchrun"], runs["elastic-agent"]
    theirs = json.loads((t_out / f"env.{attempt}.{rank}.json").read_text())
    ours = json.loads((o_out / f"env.{attempt}.{rank}.json").read_text())
    assert set(theirs) - set(ours) == set()
    assert set(ours) - set(theirs) == OURS_ONLY
    differing = {k for k in set(theirs) & set(ours) if theirs[k] != ours[k]}
    assert differing == DIFFERENT, {k: (theirs[k], ours[k]) for k in differing ^ DIFFERENT}
    tail = f"attempt_{attempt}/{rank}/error.json"
    assert theirs["TORCHELASTIC_ERROR_FILE"] == str(t_dir / tail)
    assert ours["TORCHELASTIC_ERROR_FILE"] == str(o_dir / tail)


PLUGIN = """\
import os
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsDest


class FlatLogsSpecs(DefaultLogsSpecs):
    \"\"\"Every worker's stdout in LOG_DIR/flat/out.<rank>, stderr on the console, the error
    file in LOG_DIR/flat/err.<rank>.json; it also tells workers which plugin ran.\"\"\"

    def reify(self, envs):
        flat = os.path.join(self.root_log_dir, "flat")
        os.makedirs(flat, exist_ok=True)
        dest = LogsDest()
        for lr, env in envs.items():
            env["FLAT_LOGS"] = "yes"
            dest.stdouts[lr] = os.path.join(flat, f"out.{env['RANK']}")
            dest.stderrs[lr] = ""
            dest.error_files[lr] = os.path.join(flat, f"err.{env['RANK']}.json")
            env["TORCHELASTIC_ERROR_FILE"] = dest.error_files[lr]
        return dest
"""


def test_a_logs_specs_plugin_decides_files_console_and_environment(tmp_path: Path) -> None:
    """A ``torchrun.logs_specs`` entry point installed by a package of its own, as torchrun
    finds it: files, console and the workers' environment are the plugin's."""
    site = tmp_path / "site"
    (site / "flat_logs-1.0.dist-info").mkdir(parents=True)
    (site / "flat_logs.py").write_text(PLUGIN)
    (site / "flat_logs-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: flat-logs\nVersion: 1.0\n")
    (site / "flat_logs-1.0.dist-info" / "entry_points.txt").write_text(
        "[torchrun.logs_specs]\nflat = flat_logs:FlatLogsSpecs\n")
    proc, out = _launch("elastic-agent", tmp_path, "--logs-specs", "flat",
                        env={"PYTHONPATH": str(site)})
    flat = out / "logs" / "flat"
    # err.1.json of the failed attempt is gone: a stale error file is removed before the
    # next attempt starts (torch leaves it, to be misread as the new attempt's failure)
    assert sorted(p.name for p in flat.iterdir()) == ["out.0", "out.1"]
    # the last attempt's stdout (the files are truncated per attempt, as torch opens them)
    assert (flat / "out.1").read_text() == "out line 1 from 1\nout line 2 from 1 attempt 1\n"
    # the failure's message came from the plugin's error file
    assert "worker group failed (ValueError: probe failure on rank 1)" in proc.stderr
    assert "\nerr line from 0\n" in f"\n{proc.stderr}", proc.stderr  # console, no prefix
    assert "out line 1 from 0" not in proc.stdout + proc.stderr  # redirected to the file
    env = json.loads((out / "env.1.1.json").read_text())
    assert env["FLAT_LOGS"] == "yes"
    assert env["TORCHELASTIC_ERROR_FILE"] == str(flat / "err.1.json")
    assert not list((out / "logs").glob("job-*")), "our own layout must not be written too"
