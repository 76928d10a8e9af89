"""The log tree cannot be turned against its owner: private, unpredictable, never through a
symlink. Real agents and real workers; the attacker is played by the test planting files."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import stat
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from elastic_agent.supervision.launch.exits import WorkerStartError, WorkerState
from elastic_agent.supervision.launch.worker_env import RankAssignment, WorkerSpec
from elastic_agent.supervision.launch.workers import WorkerGroup
from elastic_agent.supervision.records.log_files import LogPathError, open_private_dir
from elastic_agent.supervision.records.logs import NodeLogs
from tests.agents import EXAMPLES, Agent

VICTIM_TEXT = "the user's precious file\n"


def agent_args(redis_url: str, job: str, *extra: str) -> list[str]:
    return ["--redis", redis_url, "--job-id", job, "--local-addr", "127.0.0.1", *extra]


def modes(root: Path) -> dict[str, tuple[str, int]]:
    """Every entry under ``root`` (itself included): relative path -> (kind, permission bits)."""
    out = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "?"
        out[str(path.relative_to(root))] = (kind, stat.S_IMODE(st.st_mode))
    return out


def assert_private(root: Path) -> None:
    tree = modes(root)
    assert any(kind == "file" for kind, _ in tree.values()), tree
    for name, (kind, mode) in tree.items():
        assert kind in ("dir", "file"), (name, kind)
        assert mode == (0o700 if kind == "dir" else 0o600), (name, oct(mode))


# -- real agents ------------------------------------------------------------------------------

def test_names_planted_in_a_shared_log_dir_are_never_used(
        redis_url: str, job_id: str, tmp_path: Path) -> None:
    """The run directory is mkdtemp's (``<job>_<random>``, made atomically, 0700): a name
    someone planted in a shared --log-dir beforehand (the job's own name, the old layout) is
    neither followed nor written."""
    victim = tmp_path / "victim"
    victim.write_text(VICTIM_TEXT)
    logs = tmp_path / "logs"
    planted = logs / job_id / "attempt_0" / "0" / "stdout.log"
    planted.parent.mkdir(parents=True)
    planted.symlink_to(victim)
    (logs / f"{job_id}_").symlink_to(victim.parent, target_is_directory=True)
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "1", "--log-dir", str(logs),
                             str(EXAMPLES / "hello.py")), tmp_path, "agent")
    assert agent.wait(60) == 0, agent.output
    assert victim.read_text() == VICTIM_TEXT and planted.is_symlink()
    (run_dir,) = [p for p in logs.iterdir() if not p.is_symlink() and p.name != job_id]
    assert re.fullmatch(re.escape(job_id) + r"_\w{8}", run_dir.name), run_dir
    assert (run_dir / "attempt_0" / "0" / "stdout.log").read_text().startswith("hello")
    assert_private(run_dir)


def test_a_log_dir_that_is_a_file_is_one_line(redis_url: str, job_id: str,
                                             tmp_path: Path) -> None:
    not_a_dir = tmp_path / "logs"
    not_a_dir.write_text("")
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "1", "--log-dir",
                             str(not_a_dir), str(EXAMPLES / "hello.py")), tmp_path, "agent")
    code = agent.wait(60)
    out = agent.output
    assert code == 2 and "Traceback" not in out and "hello from" not in out, out
    (line,) = [line for line in out.splitlines() if line.strip()]
    assert "--log-dir" in line and str(not_a_dir) in line and "cannot create" in line, line


def test_the_log_tree_is_private(redis_url: str, job_id: str, tmp_path: Path) -> None:
    logs = tmp_path / "logs"  # missing: the agent makes it
    agent = Agent(agent_args(redis_url, job_id, "--nproc-per-node", "2", "--log-dir", str(logs),
                             str(EXAMPLES / "hello.py")), tmp_path, "agent")
    assert agent.wait(60) == 0, agent.output
    (run_dir,) = logs.glob(f"{job_id}_*")
    assert (run_dir / "attempt_0" / "1" / "stdout.log").read_text() == (
        "hello from rank 1 of 2\n")
    assert_private(logs)


def test_the_default_log_dir_is_new_unpredictable_and_private(
        redis_url: str, job_id: str, tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    found = []
    for i in range(2):
        agent = Agent(agent_args(redis_url, f"{job_id}-{i}", "--nproc-per-node", "1",
                                 str(EXAMPLES / "hello.py")),
                      tmp_path, f"agent{i}", env={"TMPDIR": str(tmp)})
        assert agent.wait(60) == 0, agent.output
        (announced,) = re.findall(r"^\[elastic-agent\] per-rank logs in (.+)$", agent.output,
                                  re.MULTILINE)
        job_dir = Path(announced)
        assert job_dir.name.startswith(f"{job_id}-{i}_")
        assert (job_dir / "attempt_0" / "0" / "stdout.log").read_text().startswith("hello")
        found.append(job_dir.parent)
    assert found[0] != found[1]
    for d in found:
        assert d.parent == tmp and d.name.startswith("elastic-agent-"), d
        assert_private(d)
    assert not (tmp / "elastic-agent-logs").exists()  # the old shared, predictable default


# -- the worker group -------------------------------------------------------------------------

def spec_for(log_dir: Path, code: str, nproc: int = 1) -> WorkerSpec:
    return WorkerSpec(nproc=nproc, entrypoint=[sys.executable, "-u", "-c", textwrap.dedent(code)],
                      run_id="job", job_id="job", log_dir=log_dir, shutdown_timeout=5.0)


ASSIGNMENT = RankAssignment(group_rank=0, group_world_size=1, world_size=2, base_rank=0,
                            master_addr="127.0.0.1", master_port=29500)


async def run_group(spec: WorkerSpec) -> WorkerGroup:
    group = WorkerGroup(spec, logs=NodeLogs(stdout=io.BytesIO(), stderr=io.BytesIO()))
    try:
        await group.start(ASSIGNMENT)
        await asyncio.wait_for(group.wait(), 15)
    finally:
        await group.stop(timeout=1)
    return group


def plant_file_link(job: Path, victim: Path) -> Path:
    path = job / "attempt_0" / "1" / "stderr.log"
    path.parent.mkdir(parents=True)
    path.symlink_to(victim)
    return path


def plant_dir_link(rel: str) -> Callable[[Path, Path], Path]:
    def plant(job: Path, victim: Path) -> Path:
        path = job / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(victim.parent / "elsewhere", target_is_directory=True)
        return path
    return plant


@pytest.mark.asyncio
@pytest.mark.parametrize("plant", [plant_file_link, plant_dir_link("attempt_0/1"),
                                   plant_dir_link("attempt_0"), plant_dir_link("")],
                         ids=["file", "rank-dir", "attempt-dir", "job-dir"])
async def test_no_worker_starts_through_a_planted_symlink(tmp_path: Path, plant: Any) -> None:
    victim = tmp_path / "victim"
    victim.write_text(VICTIM_TEXT)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    job = tmp_path / "logs" / "job"
    if plant is not plant_file_link:
        job.parent.mkdir()
    planted = plant(job, victim)
    ran = tmp_path / "ran"
    group = WorkerGroup(spec_for(job, f"open({str(ran)!r}, 'a').write('x')", nproc=2),
                        logs=NodeLogs(stdout=io.BytesIO(), stderr=io.BytesIO()))
    try:
        with pytest.raises(WorkerStartError) as info:
            await group.start(ASSIGNMENT)
    finally:
        await group.stop(timeout=1)  # only does something when the test fails
    message = str(info.value)
    assert "\n" not in message
    assert f"{planted} is a symbolic link" in message and "--log-dir" in message, message
    assert group.workers == [] and not ran.exists()
    assert victim.read_text() == VICTIM_TEXT
    assert list(elsewhere.iterdir()) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["world-writable", "another-user"])
async def test_a_directory_others_control_is_refused(tmp_path: Path, how: str) -> None:
    rank_dir = tmp_path / "job" / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    if how == "world-writable":
        rank_dir.chmod(0o777)
        expected = "other users may write to that directory (mode 777)"
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(rank_dir, 65534, 65534)
        expected = "that directory belongs to another user (uid 65534)"
    with pytest.raises(WorkerStartError, match=re.escape(expected)):
        await run_group(spec_for(tmp_path / "job", "pass"))
    assert list(rank_dir.iterdir()) == []


@pytest.mark.asyncio
async def test_an_earlier_runs_files_are_replaced_without_touching_their_links(
        tmp_path: Path) -> None:
    """Same job id, same log directory: the files are new ones; a hard link planted at a log's
    name loses only that name."""
    victim = tmp_path / "victim"
    victim.write_text(VICTIM_TEXT)
    rank_dir = tmp_path / "job" / "attempt_0" / "0"
    rank_dir.mkdir(parents=True)
    os.link(victim, rank_dir / "stdout.log")
    (rank_dir / "stderr.log").write_text("an earlier run\n")
    (rank_dir / "stderr.log").chmod(0o644)
    await run_group(spec_for(tmp_path / "job", "print('this run')"))
    assert victim.read_text() == VICTIM_TEXT
    assert (rank_dir / "stdout.log").read_text() == "this run\n"
    assert (rank_dir / "stderr.log").read_text() == ""
    for name in ("stdout.log", "stderr.log"):
        st = (rank_dir / name).stat()
        assert st.st_nlink == 1 and stat.S_IMODE(st.st_mode) == 0o600


def test_open_private_dir_refuses_a_symlink_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(LogPathError) as info:
        open_private_dir(tmp_path / "link" / "x", base=tmp_path)
    assert "\n" not in str(info.value) and "symbolic link" in str(info.value)
    assert not (tmp_path / "real" / "x").exists()
    fd = open_private_dir(tmp_path / "a" / "b", base=tmp_path)
    os.close(fd)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o700


# -- the worker's error file is read as untrusted ------------------------------------------------

@pytest.mark.asyncio
@pytest.mark.parametrize("make", [
    "os.symlink(secret, path)",
    "os.mkfifo(path)",
    "open(path, 'w').write('[' * 100000 + ']' * 100000)",
], ids=["symlink", "fifo", "deep-json"])
async def test_a_hostile_error_file_is_ignored(tmp_path: Path, make: str) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"message": "content the agent must not publish"}))
    spec = spec_for(tmp_path / "job", f"""
        import os, sys
        path, secret = os.environ["TORCHELASTIC_ERROR_FILE"], {str(secret)!r}
        {make}
        sys.exit(3)
    """)
    group = await run_group(spec)
    assert group.state is not WorkerState.HEALTHY
    (exit_,) = group.exits
    assert (exit_.exit_code, exit_.message, exit_.error_file) == (3, "exit code 3", None)
