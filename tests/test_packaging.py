"""The layout installs as the design card says: `agent/` -> `elastic_agent`, `console/` ->
`elastic_console`, from a wheel into a clean venv, and the commands work outside the repo."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.agents import ROOT

TORCH_PIN = "torch==2.13.0"  # the CPU build on these machines' disk, as the Makefile pins it


def _top_level_tree() -> set[str]:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    return {p.split("/", 1)[0] for p in tracked}


def test_the_top_level_is_the_design_cards():
    top = _top_level_tree()
    assert {"agent", "console", "tests", "screenshots", "pyproject.toml", "README.md"} <= top
    assert "src" not in top
    allowed = {"agent", "console", "tests", "screenshots", "pyproject.toml", "README.md",
               "bench", "examples", "docs", "scripts", "Makefile", ".ci", ".gitignore"}
    assert top <= allowed, top - allowed


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # A copy of the tracked files: building in the checkout would leave build/ behind.
    src = out / "src"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    for rel in tracked:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
                   check=True, timeout=300)
    (found,) = out.glob("elastic_console-*.whl")
    return found


def test_the_wheel_installs_our_import_names_only(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    top = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert top == {"elastic_agent", "elastic_console"}, top
    assert "elastic_console/tui/console.tcss" in names  # the stylesheet is package data
    for sub in ("coordination", "coordination/wire", "coordination/transport",
                "coordination/rendezvous", "supervision", "supervision/launch",
                "supervision/diagnosis", "supervision/records", "supervision/hosting"):
        assert f"elastic_agent/{sub}/__init__.py" in names
    for sub in ("job", "commands", "tui", "tui/widgets"):
        assert f"elastic_console/{sub}/__init__.py" in names
    assert "elastic_agent/coordination/wire/protocol.py" in names
    assert "elastic_console/tui/widgets/log_view.py" in names
    assert "elastic-agent = elastic_agent.supervision.cli:main" in entry_points
    assert "elastic-console = elastic_console.cli:main" in entry_points
    assert "redis = elastic_agent.coordination.torch_plugin:rendezvous_handler_factory" in entry_points


@pytest.mark.timeout(600)  # a clean venv installs torch and the wheel: slow under load
def test_a_wheel_in_a_clean_venv_runs_a_job_and_the_console_outside_the_repo(
        wheel: Path, tmp_path: Path, redis_url: str):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # --no-compile: writing torch's thousands of .pyc files was half this test's time; the job
    # below imports torch a few times, each compiling in memory what it uses (~3 s more).
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-compile", TORCH_PIN],
                   check=True, timeout=600)
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], check=True, timeout=600)

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    # Only the venv's bin and the system's: nothing of the repo or of the test venv is reachable.
    redis_bin = shutil.which("redis-server")
    assert redis_bin, "the test session found a redis-server, the agent must too"
    path = os.pathsep.join([str(venv / "bin"), str(Path(redis_bin).parent), "/usr/bin", "/bin"])
    env = {"PATH": path, "HOME": str(tmp_path), "GLOO_SOCKET_IFNAME": "lo", "LANG": "C.UTF-8"}

    where = subprocess.run([str(py), "-c", "import elastic_agent, elastic_console; "
                            "print(elastic_agent.__file__); print(elastic_console.__file__)"],
                           cwd=outside, env=env, capture_output=True, text=True, check=True)
    assert str(ROOT) not in where.stdout and str(venv) in where.stdout, where.stdout
    # No bare `agent` or `console` module was installed (the cwd holds neither).
    bare = subprocess.run([str(py), "-c", "import importlib.util as u; "
                           "print([u.find_spec(m) is None for m in ('agent', 'console')])"],
                          cwd=outside, env=env, capture_output=True, text=True, check=True)
    assert bare.stdout.strip() == "[True, True]", bare.stdout

    shutil.copy(ROOT / "examples" / "train.py", outside / "train.py")
    job = subprocess.run([str(venv / "bin" / "elastic-agent"), "--standalone", "--nproc-per-node", "2",
                          "--log-dir", str(tmp_path / "logs"), "train.py", "--steps", "4",
                          "--checkpoint-dir", str(tmp_path / "ckpt")],
                         cwd=outside, env=env, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
    assert "train.py succeeded" in job.stdout + job.stderr
    # The workers ran the copied script with the venv's torch: its last checkpoint is there.
    assert (tmp_path / "ckpt" / "checkpoint.pt").is_file()

    # The embedded Redis went with its agent: `ls` reads a job run on the session's server.
    job_id = f"pkg-{os.getpid()}"
    hello = shutil.copy(ROOT / "examples" / "hello.py", outside / "hello.py")
    small = subprocess.run([str(venv / "bin" / "elastic-agent"), "--redis", redis_url, "--job-id", job_id,
                            "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs2"), hello],
                           cwd=outside, env=env, capture_output=True, text=True, timeout=120)
    assert small.returncode == 0, (small.stdout + small.stderr)[-3000:]
    ls = subprocess.run([str(venv / "bin" / "elastic-console"), "ls", "--redis", redis_url],
                        cwd=outside, env=env, capture_output=True, text=True, timeout=60)
    assert ls.returncode == 0, ls.stderr
    row = next(line for line in ls.stdout.splitlines() if job_id in line)
    assert "succeeded" in row, ls.stdout
