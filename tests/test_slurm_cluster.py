"""elastic-agent under a real SLURM: a two-node cluster on this host (tests/slurm.py: munged,
slurmctld, ``slurmd -N n1`` and ``-N n2``), jobs started with srun and sbatch as a user would.

Never skipped: a machine without SLURM fails here saying how to get it (make test installs
it through scripts/ensure-tools.sh).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

from elastic_agent.coordination.protocol import Event, EventType, JobKeys, decode_event
from elastic_console.state import JobView
from tests.agents import EXAMPLES, ROOT, SCRIPTS
from tests.slurm import SlurmCluster
from tests.waiting import wait_until

AGENT = [sys.executable, "-m", "elastic_agent.supervision.cli"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    c = SlurmCluster().start()  # raises (the tests fail) when SLURM cannot run here
    c.env.update({"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
                  "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
                  "ELASTIC_STANDALONE_LINGER": "0"})
    c.env.pop("ELASTIC_REDIS_URL", None)
    yield c
    c.cleanup()


def srun(cluster: SlurmCluster, *args: str, env: dict[str, str] | None = None,
         timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return cluster.run("srun", "-N2", "-n2", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
                       *AGENT, *args, check=False, timeout=timeout, env=env or {},
                       cwd=str(ROOT))


def hellos(out: str) -> set[tuple[int, int]]:
    return {(int(r), int(w)) for r, w in re.findall(r"hello from rank (\d+) of (\d+)", out)}


def test_srun_forms_one_job_of_world_4_with_a_given_redis(cluster: SlurmCluster,
                                                         redis_url: str,
                                                         r: redis.Redis) -> None:
    proc = srun(cluster, "--nproc-per-node", "2", str(EXAMPLES / "hello.py"),
                env={"ELASTIC_REDIS_URL": redis_url})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert hellos(proc.stdout) == {(rank, 4) for rank in range(4)}, proc.stdout
    job = re.search(r"slurm-\d+\.0", proc.stdout + proc.stderr)
    assert job is not None, proc.stdout + proc.stderr
    assert r.hget(JobKeys(job.group()).meta, "final_state") == b"succeeded"


def test_srun_with_no_redis_at_all_hosts_one_on_the_first_node(cluster: SlurmCluster) -> None:
    proc = srun(cluster, "--nproc-per-node", "2", str(EXAMPLES / "hello.py"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert hellos(proc.stdout) == {(rank, 4) for rank in range(4)}, proc.stdout + proc.stderr
    attach = re.findall(r"elastic-console attach (slurm-\d+\.0) --redis redis://127\.0\.0\.1:\d+",
                        proc.stderr)
    assert len(attach) == 1, proc.stderr  # printed once, by the node that hosts it
    assert "single point of failure" in proc.stderr


WORKER = str(SCRIPTS / "slurm_worker.py")


def events(r: redis.Redis, job: str) -> list[Event]:
    return [e for e in (decode_event(i, f) for i, f in r.xrange(JobKeys(job).events)) if e]


def of_type(r: redis.Redis, job: str, t: str) -> list[Event]:
    return [e for e in events(r, job) if e.type == t]


def test_a_crash_restarts_the_two_node_job_once_job_wide(cluster: SlurmCluster, redis_url: str,
                                                        r: redis.Redis) -> None:
    proc = srun(cluster, "--nproc-per-node", "2", "--max-restarts", "1", WORKER, "crash-once",
                env={"ELASTIC_REDIS_URL": redis_url})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"slurm-\d+\.0", proc.stdout + proc.stderr).group()
    assert len(of_type(r, job, EventType.GROUP_FAILED)) == 1
    assert r.get(JobKeys(job).restarts) == b"1"
    restarted = [e for e in of_type(r, job, EventType.WORKERS_STARTED)
                 if e.data.get("restart_count") == 1]
    assert len({e.node for e in restarted}) == 2  # both nodes' workers, one job
    assert sorted(re.findall(r"worker rank (\d) of 4 pid \d+ attempt 1", proc.stdout)) == [
        "0", "1", "2", "3"]
    assert r.hget(JobKeys(job).meta, "final_state") == b"succeeded"


def _start_in_background(cluster: SlurmCluster, tmp_path: Path, *args: str,
                         env: dict[str, str]) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp_path / "srun.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            ["srun", "-N2", "-n2", "--ntasks-per-node=1", *AGENT, *args],
            env={**cluster.env, **env}, stdout=f, stderr=subprocess.STDOUT, cwd=str(ROOT))
    return proc, out


def test_scancel_stops_the_job_cleanly_as_the_schedulers(cluster: SlurmCluster, redis_url: str,
                                                         r: redis.Redis,
                                                         tmp_path: Path) -> None:
    proc, out = _start_in_background(cluster, tmp_path, "--nproc-per-node", "2",
                                     "--shutdown-timeout", "5", WORKER, "run",
                                     env={"ELASTIC_REDIS_URL": redis_url})
    try:
        pids = wait_until(lambda: [int(p) for p in re.findall(
            r"worker rank \d of 4 pid (\d+)", out.read_text())] if len(re.findall(
                r"worker rank", out.read_text())) == 4 else None, 60, "4 workers running")
        job = re.search(r"slurm-(\d+)\.0", out.read_text())
        assert job is not None, out.read_text()
        cluster.run("scancel", job.group(1))
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    keys = JobKeys(job.group())
    assert r.hget(keys.meta, "final_state") == b"stopped", text
    stopped = of_type(r, job.group(), EventType.JOB_STOPPED)
    assert len(stopped) == 1, text
    assert (stopped[0].data.get("issuer"), stopped[0].data.get("scheduler"),
            stopped[0].data.get("signal")) == ("the scheduler", "slurm", "SIGTERM")
    # Not a failure: no restart spent, no group failure reported.
    assert not of_type(r, job.group(), EventType.GROUP_FAILED), text
    assert r.get(keys.restarts) in (None, b"0")
    assert {e.node for e in of_type(r, job.group(), EventType.WORKERS_STOPPED)
            if e.data.get("reason") == "signal"} or "stopped by the scheduler" in text
    assert "stopped by the scheduler (SIGTERM)" in text
    state = JobView(job.group())
    state.apply_events(events(r, job.group()))
    assert state.state == "stopped"
    assert any("stopped by the scheduler (slurm, SIGTERM" in t.text for t in state.timeline)
    wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 10, "no worker left")
