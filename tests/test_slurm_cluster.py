"""elastic-agent under a real SLURM: a two-node cluster on this host (tests/slurm.py: munged,
slurmctld, ``slurmd -N n1`` and ``-N n2``), jobs started with srun and sbatch as a user would.

Never skipped: a machine without SLURM fails here saying how to get it (make test installs
it through scripts/ensure-tools.sh).
"""

from __future__ import annotations

import os
import random
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

from elastic_agent.coordination.transport.job_secret import JOB_SECRET_ENV
from elastic_agent.coordination.wire.event_records import Event, EventType, decode_event
from elastic_agent.coordination.wire.keyspace import JobKeys
from elastic_console.job.state import JobView
from tests.agents import EXAMPLES, ROOT, SCRIPTS, Agent
from tests.slurm import SlurmCluster
from tests.waiting import wait_until

AGENT = [sys.executable, "-m", "elastic_agent.supervision.cli"]
WORKER = str(SCRIPTS / "slurm_worker.py")


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


def secret_env() -> dict[str, str]:
    """What examples/slurm.sbatch exports before srun: the job's secret."""
    return {JOB_SECRET_ENV: secrets.token_hex(32)}


def test_srun_with_no_redis_at_all_hosts_one_on_the_first_node(cluster: SlurmCluster) -> None:
    env = secret_env()
    proc = srun(cluster, "--nproc-per-node", "2", str(EXAMPLES / "hello.py"), env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert hellos(proc.stdout) == {(rank, 4) for rank in range(4)}, proc.stdout + proc.stderr
    attach = re.findall(r"elastic-console attach (slurm-\d+\.0) --redis redis://agent@127\.0\.0\.1:"
                        r"\d+", proc.stderr)
    assert len(attach) == 1, proc.stderr  # printed once, by the node that hosts it
    assert "single point of failure" in proc.stderr
    assert env[JOB_SECRET_ENV] not in proc.stdout + proc.stderr


def test_the_workers_of_a_hosted_redis_hold_no_secret_and_a_lesser_user(
        cluster: SlurmCluster) -> None:
    proc = srun(cluster, "--nproc-per-node", "2", WORKER, "env", env=secret_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = sorted(re.findall(r"worker rank (\d) env: (.*)", proc.stdout))
    assert reports == [(str(rank), "secret False user worker store True commands refused")
                       for rank in range(4)], proc.stdout + proc.stderr


def test_srun_of_several_nodes_without_a_redis_or_a_secret_is_refused(
        cluster: SlurmCluster) -> None:
    proc = srun(cluster, "--nproc-per-node", "2", str(EXAMPLES / "hello.py"))
    assert sorted(re.findall(r"task (\d): Exited with exit code (\d+)", proc.stderr)) == [
        ("0", "2"), ("1", "2")], proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "elastic-agent: error:" in line]
    assert len(errors) == 2 and all(f"export {JOB_SECRET_ENV}=" in e for e in errors), errors
    assert not hellos(proc.stdout)


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


@pytest.mark.parametrize(("how", "sig", "code"), [
    ((), "SIGTERM", "143"),  # scancel
    (("--signal=USR1",), "SIGUSR1", "138"),  # what sbatch --signal=USR1@T sends before the limit
])
def test_scancel_without_a_redis_ends_every_agent_before_slurms_sigkill(
        cluster: SlurmCluster, tmp_path: Path, how: tuple[str, ...], sig: str,
        code: str) -> None:
    """SLURM's signal reaches the first node's redis-server too: it must outlive the agents
    recording the job's end (both exit by the signal themselves, nobody is SIGKILLed at
    KillWait)."""
    proc, out = _start_in_background(cluster, tmp_path, "--nproc-per-node", "2",
                                     "--shutdown-timeout", "5", WORKER, "run",
                                     env=secret_env())
    try:
        wait_until(lambda: out.read_text().count("worker rank") == 4, 60, "4 workers running")
        job = re.search(r"slurm-(\d+)\.0", out.read_text())
        assert job is not None, out.read_text()
        cluster.run("scancel", *how, job.group(1))
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = out.read_text()
    assert f"stopped by the scheduler ({sig})" in text, text
    codes = sorted(re.findall(r"task (\d): Exited with exit code (\d+)", text))
    # An agent that sees the job closed by the other before its own signal exits 143.
    assert [t for t, _ in codes] == ["0", "1"] and code in {c for _, c in codes}, text
    assert {c for _, c in codes} <= {code, "143"}, text


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
    # Both nodes stopped their workers; every rank's end is on record (the evidence).
    assert len({e.node for e in of_type(r, job.group(), EventType.WORKERS_STOPPED)
                if e.data.get("reason") == "signal"}) == 2, text
    assert sorted(e.data["rank"] for e in of_type(r, job.group(), EventType.WORKER_EXITED)
                  ) == [0, 1, 2, 3]
    assert "stopped by the scheduler (SIGTERM)" in text
    assert sorted(re.findall(r"task (\d): Exited with exit code (\d+)", text)) == [
        ("0", "143"), ("1", "143")], text
    state = JobView(job.group())
    state.apply_events(events(r, job.group()))
    assert state.state == "stopped"
    assert any("stopped by the scheduler (slurm, SIGTERM" in t.text for t in state.timeline)
    wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 10, "no worker left")


def _sbatch(cluster: SlurmCluster, out: Path, *args: str,
            env: dict[str, str] | None = None) -> str:
    """``sbatch examples/slurm.sbatch ARGS`` from the repo's root, as the README says; the
    job's output to ``out`` (the script's own --output names a file in the root)."""
    proc = cluster.run("sbatch", "--parsable", f"--output={out}",
                       str(EXAMPLES / "slurm.sbatch"), *args, env=env or {}, cwd=str(ROOT))
    return proc.stdout.strip().split(";")[0]


def _ended(cluster: SlurmCluster, slurm_job: str) -> str | None:
    state = cluster.job_state(slurm_job)
    return state if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") else None


def test_the_example_sbatch_script_runs_as_written(cluster: SlurmCluster,
                                                   tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    slurm_job = _sbatch(cluster, out, env={"ELASTIC_REDIS_URL": "",  # no Redis of its own
                                           "CHECKPOINT_DIR": str(tmp_path / "checkpoints")})
    try:
        state = wait_until(lambda: _ended(cluster, slurm_job), 120, "the batch job's end")
    finally:
        cluster.run("scancel", slurm_job, check=False)
    text = out.read_text()
    assert state == "COMPLETED", text
    ranks = set(re.findall(r"rank (\d)/4 local_rank", text))
    assert ranks == {"0", "1", "2", "3"}, text
    assert f"elastic-console attach slurm-{slurm_job}.0 --redis" in text
    assert f"succeeded: job slurm-{slurm_job}.0" in text
    assert (tmp_path / "checkpoints").is_dir()


def test_a_requeued_job_keeps_its_id_history_and_restart_count(cluster: SlurmCluster,
                                                               redis_url: str, r: redis.Redis,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "job.out"
    slurm_job = _sbatch(cluster, out, WORKER, "requeue", env={"ELASTIC_REDIS_URL": redis_url})
    job = f"slurm-{slurm_job}.0"
    try:
        # First run: rank 1 crashes, the job restarts once and runs until requeued.
        wait_until(lambda: out.exists() and len(re.findall(
            r"attempt 1 requeue 0", out.read_text())) == 4, 60, "the restarted first run")
        cluster.run("scontrol", "requeue", slurm_job)
        # SLURM holds a requeued job back (Reason=BeginTime) before it runs it again.
        wait_until(lambda: cluster.job_state(slurm_job) == "PENDING", 30, "the job requeued")
        cluster.run("scontrol", "update", f"JobId={slurm_job}", "StartTime=now")
        state = wait_until(lambda: _ended(cluster, slurm_job), 60, "the requeued run's end")
    finally:
        cluster.run("scancel", slurm_job, check=False)
    text = out.read_text()
    assert state == "COMPLETED", text
    assert len(re.findall(r"attempt 1 requeue 1", text)) == 4, text  # counter continued
    history = [e.type for e in events(r, job)]
    assert history.count(EventType.GROUP_FAILED) == 1  # the first run's, kept
    first_stop = history.index(EventType.JOB_STOPPED)
    assert EventType.JOB_REQUEUED in history[first_stop:]
    assert history[-1] == EventType.JOB_SUCCEEDED
    assert r.get(JobKeys(job).restarts) == b"1"
    assert r.hget(JobKeys(job).meta, "final_state") == b"succeeded"
    view = JobView(job)
    view.apply_events(events(r, job))
    assert view.state == "succeeded" and view.restarts_used == 1
    assert any("requeued by the scheduler" in t.text for t in view.timeline)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGUSR1, 138)])
def test_a_worker_killed_by_slurms_signal_just_before_its_agent_is_no_failure(
        redis_url: str, r: redis.Redis, tmp_path: Path, sig: signal.Signals, code: int) -> None:
    """SLURM signals every process of a step one after another: here the worker first, its
    agent 0.1 s later (deterministically; on the cluster the order varies). The job ends
    stopped by the scheduler, no restart spent (--max-restarts 0 would fail it otherwise)."""
    slurm_job = str(random.randrange(10**6, 10**7))
    env = {"SLURM_JOB_ID": slurm_job, "SLURM_STEP_ID": "0", "SLURM_NNODES": "1",
           "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NODELIST": "n1", "SLURMD_NODENAME": "n1"}
    agent = Agent(["--redis", redis_url, "--shutdown-timeout", "5", WORKER, "run"], tmp_path,
                  "agent", env=env)
    try:
        pid = int(wait_until(lambda: re.search(r"worker rank 0 of 1 pid (\d+)", agent.output),
                             30, "the worker running").group(1))
        os.kill(pid, sig)
        time.sleep(0.1)  # the gap between SLURM's kill() of two processes of the step
        os.kill(agent.pid, sig)
        assert agent.wait(30) == code, agent.output
    finally:
        agent.kill()
    job = f"slurm-{slurm_job}.0"
    assert r.hget(JobKeys(job).meta, "final_state") == b"stopped", agent.output
    assert not of_type(r, job, EventType.GROUP_FAILED)
    assert of_type(r, job, EventType.JOB_STOPPED)[0].data["signal"] == sig.name
